import sys
import warnings

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3] / "tests"))
import torch
from _reference import jacobian_loop
from torch import nn

from skpathkernel._tangent import tangent_gram
from skpathkernel.rules import layer_routes

torch.set_num_threads(1)


class P(nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.a = nn.Linear(3, 4)
        self.n = layer
        self.b = nn.Linear(4, 2)

    def forward(self, x):
        y = self.a(x)
        y = y + y.mean(0, keepdim=True)
        return self.b(torch.tanh(self.n(y)))


X = torch.randn(5, 3, dtype=torch.float64)
for layer in (nn.LayerNorm(4), nn.Linear(4, 4)):
    torch.manual_seed(0)
    m = P(layer).double()
    params = {k: v.detach() for k, v in m.named_parameters()}
    J = jacobian_loop(m, X)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = [(x.name, x.route) for x in layer_routes(m, X)]
        G = tangent_gram(m, params, X, output="full")
    R = torch.einsum("ncp,mdp->ncmd", J, J)
    print(type(layer).__name__, r, float((G - R).abs().max() / R.abs().max()))
