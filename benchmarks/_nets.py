"""The networks of the image and token Gram rows (issue 18), built the same way by the
torch cases and by the JAX peer (which copies their weights).

(a) ``cnn8``: conv 32 -> ReLU -> conv 64 -> ReLU -> flatten -> Linear 10 on (n, 1, 8, 8),
    3x3 kernels with padding 1 (P = 59786): the 8x8 digits classifier of the issue.
(b) ``cifar``: the same on (n, 3, 32, 32) with a 2x2 max-pool after each ReLU
    (P = 60362): CIFAR-shaped inputs, 1024 and 256 positions per convolution.
(c) ``transformer``: token and position embeddings (16 tokens, d = 64), two
    nn.TransformerEncoderLayer (4 heads, feed-forward 128, dropout 0, post-norm, ReLU),
    mean pooling, Linear 1 (P = 69057), on (n, 16) token ids.
(d) ``resnet``: a CIFAR-style ResNet on (n, 3, 32, 32): conv 16 -> BatchNorm -> ReLU,
    three residual blocks (16, 32 and 64 channels, the last two downsampling by a stride-2
    3x3 convolution with a 1x1 stride-2 shortcut, each convolution followed by BatchNorm),
    global average pooling, Linear 10; BatchNorm in eval mode (running statistics set to
    fixed non-trivial values, so that they enter the function).
(e) ``vit``: a small vision transformer on (n, 3, 32, 32): 4x4 patch-embedding conv to
    d = 64 (64 patches), a class token and a position embedding held as raw
    ``nn.Parameter``s, two pre-norm nn.TransformerEncoderLayer (4 heads, feed-forward 128,
    GELU, dropout 0), a final LayerNorm, Linear 10 on the class token.
"""

from __future__ import annotations

import torch
from torch import nn

ARCHS = {
    "cnn8": dict(shape=(1, 8, 8), outputs=10),
    "cifar": dict(shape=(3, 32, 32), outputs=10),
    "transformer": dict(shape=(16,), outputs=1, vocab=16, d=64, heads=4, ff=128, layers=2),
    "resnet": dict(shape=(3, 32, 32), outputs=10, widths=(16, 32, 64)),
    "vit": dict(shape=(3, 32, 32), outputs=10, patch=4, d=64, heads=4, ff=128, layers=2),
}


class Block(nn.Module):
    """A basic residual block: two 3x3 convolutions with BatchNorm, a 1x1 shortcut with
    BatchNorm when the block changes the width or the resolution."""

    def __init__(self, c_in, c_out, stride):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False),
                                          nn.BatchNorm2d(c_out))

    def forward(self, x):
        y = self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x)))))
        return torch.relu(y + self.shortcut(x))


class ResNet(nn.Module):
    """Stem, one residual block per width, global average pooling, a linear head."""

    def __init__(self, c_in, widths, n_out):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(c_in, widths[0], 3, padding=1, bias=False),
                                  nn.BatchNorm2d(widths[0]), nn.ReLU())
        self.blocks = nn.Sequential(*(Block(a, b, 1 if a == b else 2)
                                      for a, b in zip(widths[:1] + widths[:-1], widths)))
        self.head = nn.Linear(widths[-1], n_out)

    def forward(self, x):
        return self.head(self.blocks(self.stem(x)).mean((2, 3)))


class ViT(nn.Module):
    """Patch embedding, class token, position embedding, pre-norm encoder, linear head."""

    def __init__(self, c_in, side, patch, d, heads, ff, layers, n_out):
        super().__init__()
        self.embed = nn.Conv2d(c_in, d, patch, stride=patch)
        # Raw parameters, as timm and torchvision hold them.
        self.cls = nn.Parameter(0.02 * torch.randn(1, 1, d))
        self.pos = nn.Parameter(0.02 * torch.randn(1, (side // patch) ** 2 + 1, d))
        layer = nn.TransformerEncoderLayer(d, heads, dim_feedforward=ff, dropout=0.0,
                                           activation="gelu", batch_first=True,
                                           norm_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.norm = nn.LayerNorm(d)
        self.head = nn.Linear(d, n_out)

    def forward(self, x):
        x = self.embed(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1) + self.pos
        return self.head(self.norm(self.encoder(x))[:, 0])


def _eval_batchnorm(module):
    """Eval mode, with running statistics away from 0 / 1 (as after training), fixed by
    the seed: the Gram must use them, not batch statistics."""
    g = torch.Generator().manual_seed(1)
    for m in module.modules():
        if isinstance(m, nn.BatchNorm2d):
            c = m.num_features
            m.running_mean.copy_(0.1 * torch.randn(c, generator=g))
            m.running_var.copy_(1 + 0.2 * torch.rand(c, generator=g))
            m.weight.data.copy_(1 + 0.1 * torch.randn(c, generator=g))
            m.bias.data.copy_(0.1 * torch.randn(c, generator=g))
    return module.eval()


class Tokens(nn.Module):
    """Embeddings, an nn.TransformerEncoder, mean pooling, a linear head."""

    def __init__(self, vocab, S, d, heads, ff, layers, n_out):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(S, d)
        layer = nn.TransformerEncoderLayer(d, heads, dim_feedforward=ff, dropout=0.0,
                                           batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, n_out)

    def forward(self, ids):
        # Positions as a (n, S) index: the embedding's rows are then the samples.
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        return self.head(self.encoder(self.tok(ids) + self.pos(positions)).mean(1))


def build(arch: str) -> nn.Module:
    a = ARCHS[arch]
    if arch == "transformer":
        return Tokens(a["vocab"], a["shape"][0], a["d"], a["heads"], a["ff"], a["layers"],
                      a["outputs"]).eval()
    c_in, side = a["shape"][0], a["shape"][1]
    if arch == "resnet":
        return _eval_batchnorm(ResNet(c_in, a["widths"], a["outputs"]))
    if arch == "vit":
        return ViT(c_in, side, a["patch"], a["d"], a["heads"], a["ff"], a["layers"],
                   a["outputs"]).eval()
    pool = [nn.MaxPool2d(2)] if arch == "cifar" else []
    flat = side // 4 if pool else side
    return nn.Sequential(nn.Conv2d(c_in, 32, 3, padding=1), nn.ReLU(), *pool,
                         nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), *pool,
                         nn.Flatten(), nn.Linear(64 * flat * flat, a["outputs"]))


def inputs(arch: str, n: int, dtype=torch.float32) -> torch.Tensor:
    """Random inputs: N(0, 1) images, or uniform token ids."""
    a = ARCHS[arch]
    if arch == "transformer":
        return torch.randint(0, a["vocab"], (n, *a["shape"]))
    return torch.randn(n, *a["shape"], dtype=dtype)
