import sys
import warnings

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3] / "tests"))
import torch
import torch.nn.functional as F
from _reference import jacobian_loop
from torch import nn

from skpathkernel._tangent import tangent_gram
from skpathkernel.rules import check_rule, layer_routes

torch.set_num_threads(1)
C = 4


class LN2d(nn.LayerNorm):  # timm
    def forward(self, x):
        x = x.permute(0, 2, 3, 1)
        x = F.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)
        return x.permute(0, 3, 1, 2)


class Kw(nn.LayerNorm):
    def forward(self, x):
        return F.layer_norm(
            x.permute(0, 2, 3, 1),
            self.normalized_shape,
            eps=self.eps,
            bias=self.bias,
            weight=self.weight,
        ).permute(0, 3, 1, 2)


class Swap(nn.LayerNorm):
    def forward(self, x):
        return F.layer_norm(
            x.permute(0, 2, 3, 1), self.normalized_shape, self.bias, self.weight, self.eps
        ).permute(0, 3, 1, 2)


class SwapKw(nn.LayerNorm):
    def forward(self, x):
        return F.layer_norm(
            x.permute(0, 2, 3, 1), self.normalized_shape, weight=self.bias, bias=self.weight
        ).permute(0, 3, 1, 2)


class Times1(nn.LayerNorm):
    def forward(self, x):
        return F.layer_norm(
            x.permute(0, 2, 3, 1), self.normalized_shape, self.weight * 1, self.bias, self.eps
        ).permute(0, 3, 1, 2)


class View(nn.LayerNorm):
    def forward(self, x):
        return F.layer_norm(
            x.permute(0, 2, 3, 1),
            self.normalized_shape,
            self.weight.view(-1),
            self.bias.view(C),
            self.eps,
        ).permute(0, 3, 1, 2)


class Shape(
    nn.LayerNorm
):  # normalized over (H, W, C) with weight of (C,) broadcast? no: different shape, weight reshaped
    def forward(self, x):
        # normalizes over last two dims (W, C) channels-last, weight (C,) expanded: a read otherwise
        y = x.permute(0, 2, 3, 1)
        return F.layer_norm(
            y, y.shape[-2:], self.weight.expand(y.shape[-2:]), self.bias.expand(y.shape[-2:])
        ).permute(0, 3, 1, 2)


class ShapeNoAffine(
    nn.LayerNorm
):  # normalized_shape from call (W, C) vs layer (C,), params unused -> they are in own call? no
    def forward(self, x):
        y = x.permute(0, 2, 3, 1)
        y = F.layer_norm(y, y.shape[-2:])
        return (y * self.weight + self.bias).permute(0, 3, 1, 2)


class Group(nn.LayerNorm):
    def forward(self, x):
        return F.group_norm(x, 1, self.weight, self.bias, self.eps)


class Twice(nn.LayerNorm):
    def forward(self, x):
        y = x.permute(0, 2, 3, 1)
        a = F.layer_norm(y[:, :1], self.normalized_shape, self.weight, self.bias, self.eps)
        b = F.layer_norm(y[:, 1:], self.normalized_shape, self.weight, self.bias, self.eps)
        return torch.cat([a, b], 1).permute(0, 3, 1, 2)


class Flip(nn.LayerNorm):
    def forward(self, x):
        return (
            F.layer_norm(
                x.permute(0, 2, 3, 1).flip(0),
                self.normalized_shape,
                self.weight,
                self.bias,
                self.eps,
            )
            .permute(0, 3, 1, 2)
            .flip(0)
        )


class Mix(nn.LayerNorm):  # batch-mixing input
    def forward(self, x):
        y = x.permute(0, 2, 3, 1)
        y = y + y.mean(0, keepdim=True)
        return F.layer_norm(y, self.normalized_shape, self.weight, self.bias, self.eps).permute(
            0, 3, 1, 2
        )


class Post(nn.LayerNorm):  # extra weight use after: read twice
    def forward(self, x):
        y = F.layer_norm(
            x.permute(0, 2, 3, 1), self.normalized_shape, self.weight, self.bias, self.eps
        )
        return (y * self.weight).permute(0, 3, 1, 2)


class Eps(nn.LayerNorm):  # eps differs from layer's (call's eps must be read)
    def forward(self, x):
        return F.layer_norm(
            x.permute(0, 2, 3, 1), self.normalized_shape, self.weight, self.bias, 0.5
        ).permute(0, 3, 1, 2)


class TorchLN(nn.LayerNorm):
    def forward(self, x):
        return torch.layer_norm(
            x.permute(0, 2, 3, 1), self.normalized_shape, self.weight, self.bias, self.eps
        ).permute(0, 3, 1, 2)


class Wrong(nn.LayerNorm):  # channels-first input: normalizes W (C == W), not the channels
    def forward(self, x):
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


def net(cls, **kw):
    torch.manual_seed(0)
    ln = cls(C, **kw)
    with torch.no_grad():
        if ln.weight is not None:
            ln.weight.copy_(torch.randn(C))
        if getattr(ln, "bias", None) is not None:
            ln.bias.copy_(torch.randn(C))
    return (
        nn.Sequential(
            nn.Conv2d(2, C, 3, padding=1),
            ln,
            nn.GELU(),
            nn.Conv2d(C, 3, 2),
            nn.Flatten(),
            nn.Linear(3 * 3 * 3, 2),
        )
        .double()
        .eval()
    )


X = torch.randn(5, 2, 4, 4, dtype=torch.float64)
for cls, kw in [
    (LN2d, {}),
    (Kw, {}),
    (Swap, {}),
    (SwapKw, {}),
    (Times1, {}),
    (View, {}),
    (Shape, {}),
    (ShapeNoAffine, {}),
    (Group, {}),
    (Twice, {}),
    (Flip, {}),
    (Mix, {}),
    (Post, {}),
    (Eps, {}),
    (TorchLN, {}),
    (LN2d, dict(elementwise_affine=False)),
    (LN2d, dict(bias=False)),
    (Swap, dict(bias=False)),
    (Wrong, {}),
]:
    m = net(cls, **kw)
    params = {k: v.detach() for k, v in m.named_parameters()}
    J = jacobian_loop(m, X)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        r = layer_routes(m, X)[1]
        G = tangent_gram(m, params, X, output="full")
    R = torch.einsum("ncp,mdp->ncmd", J, J)
    err = float((G - R).abs().max() / R.abs().max())
    try:
        cr = check_rule(m, X, rtol=1e-10)
    except Exception as e:
        cr = type(e).__name__
    print(
        ("OK  " if err < 1e-10 else "BAD ")
        + f"{cls.__name__}{kw}: err={err:.1e} route={r.route} check_rule={cr} "
        + f"reason={r.reason[:150]}",
        flush=True,
    )
