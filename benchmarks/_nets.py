"""The networks of the image and token Gram rows (issue 18), built the same way by the
torch cases and by the JAX peer (which copies their weights).

(a) ``cnn8``: conv 32 -> ReLU -> conv 64 -> ReLU -> flatten -> Linear 10 on (n, 1, 8, 8),
    3x3 kernels with padding 1 (P = 59786): the 8x8 digits classifier of the issue.
(b) ``cifar``: the same on (n, 3, 32, 32) with a 2x2 max-pool after each ReLU
    (P = 60362): CIFAR-shaped inputs, 1024 and 256 positions per convolution.
(c) ``transformer``: token and position embeddings (16 tokens, d = 64), two
    nn.TransformerEncoderLayer (4 heads, feed-forward 128, dropout 0, post-norm, ReLU),
    mean pooling, Linear 1 (P = 69057), on (n, 16) token ids.
"""

from __future__ import annotations

import torch
from torch import nn

ARCHS = {
    "cnn8": dict(shape=(1, 8, 8), outputs=10),
    "cifar": dict(shape=(3, 32, 32), outputs=10),
    "transformer": dict(shape=(16,), outputs=1, vocab=16, d=64, heads=4, ff=128, layers=2),
}


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
