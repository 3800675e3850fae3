"""Review s51 (4b3ecc7): reshape/view/unsqueeze reads of raw parameters against a per-sample
autograd loop (features, Gram, one-point TangentKernel), float64 and float32.
Run from the repository root with PYTHONPATH=.:tests."""

import sys
import warnings

sys.path.insert(0, "tests")
import torch
from _reference import jacobian_loop
from torch import nn

from skpathkernel import PathRecorder, TangentKernel
from skpathkernel._tangent import capture, tangent_features, tangent_gram
from skpathkernel.rules import layer_routes

C, H, W = 3, 4, 2


class M(nn.Module):
    def __init__(self, form, dtype):
        super().__init__()
        self.form = form
        g = torch.Generator().manual_seed(1)
        self.conv = nn.Conv2d(2, C, 1)
        self.a = nn.Parameter(torch.randn(C, generator=g, dtype=dtype))
        self.b = nn.Parameter(torch.randn(C * H, generator=g, dtype=dtype))
        self.t = nn.Parameter(
            torch.randn(H, C, generator=g, dtype=dtype).t()
        )  # (C,H) non-contiguous
        self.q = nn.Parameter(torch.randn(C, H, generator=g, dtype=dtype))
        self.head = nn.Linear(C * H * W, 3)

    def forward(self, x):
        h = torch.tanh(self.conv(x))  # (n, C, H, W)
        f = self.form
        if f == "view-1":
            h = h * self.a.view(-1, 1, 1) + self.b.view(-1, H, 1)
        elif f == "reshape_CH":  # (C*H,) -> (C,H,1)
            h = h * self.b.reshape(C, H, 1)
        elif f == "reshape_perm":  # (C,H) param reinterpreted as (H,C) against (n, W, H, C)
            h = (h.permute(0, 3, 2, 1) * self.q.reshape(H, C)).permute(0, 3, 2, 1)
        elif f == "noncontig":
            h = h * self.t.reshape(1, C, H, 1) + self.t.unsqueeze(-1)
        elif f == "unsq0":
            h = h + self.q.unsqueeze(0).unsqueeze(-1) if False else h + torch.unsqueeze(self.q, -1)
        elif f == "unsq1":  # (C,H) -> (C,1,H) against (n, C, W, H)
            h = (h.transpose(2, 3) * self.q.unsqueeze(1)).transpose(2, 3)
        elif f == "unsq_neg":
            h = h * self.a.unsqueeze(-1).unsqueeze(-1) * 1.0
        elif f == "twice":
            h = h * self.a.view(C, 1, 1) + self.a.reshape(1, C, 1, 1) + self.a[:, None, None] * h
        elif f == "direct_and_view":
            h = (h.transpose(1, 3) * self.a).transpose(1, 3) + self.a.view(C, 1, 1)
        elif f == "slice_reshape":
            h = h * self.b[: C * H].reshape(C, H, 1)
        elif f == "reshape_slice":
            h = h * self.b.reshape(C, H)[:, :H].unsqueeze(-1)
        elif f == "reshape_list":
            h = h + torch.reshape(self.b, [C, H, 1]) * 0.5
        elif f == "view_size":
            h = h * self.a.view(torch.Size([C, 1, 1]))
        elif f == "add_flat":
            h = (h.flatten(1) + self.b.repeat(W).reshape(-1)).reshape(h.shape)
        return self.head(torch.tanh(h).flatten(1))


def err(a, b):
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    assert a.shape == b.shape, (a.shape, b.shape)
    return float((a - b).abs().max() / b.abs().max())


forms = [
    "view-1",
    "reshape_CH",
    "reshape_perm",
    "noncontig",
    "unsq0",
    "unsq1",
    "unsq_neg",
    "twice",
    "direct_and_view",
    "slice_reshape",
    "reshape_slice",
    "reshape_list",
    "view_size",
    "add_flat",
]
for dtype in (torch.float64, torch.float32):
    for form in forms:
        torch.manual_seed(0)
        m = M(form, dtype).to(dtype).eval()
        X = torch.randn(5, 2, H, W, dtype=dtype)
        params = {k: v.detach() for k, v in m.named_parameters()}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            routes = [(r.name, r.route) for r in layer_routes(m, X) if r.route != "rule"]
            fb = capture(m, params, X, [0, 1, 2], memory_budget=2**24).fallback
            J = jacobian_loop(m, X)
            F = tangent_features(m, params, X, output="full")
            G = tangent_gram(m, params, X, output="full")
            rec = PathRecorder(m, torch.optim.SGD(m.parameters(), lr=0.0)).as_estimator()
            K = TangentKernel(rec, output="full")(X.numpy())
        e = max(
            err(F, J),
            err(G, torch.einsum("ncp,mdp->ncmd", J, J)),
            err(K, torch.einsum("ncp,mdp->nmcd", J.double(), J.double())),
        )
        print(f"{str(dtype)[6:]:8s} {form:16s} fallback={sorted(fb)} err={e:.2e}")
