"""One-process A/B of a position embedding read through a slice: fallback (ref) vs rule.

``x + self.pos[:, :L]`` (a table with room for more tokens than the input has) went to the
generic ``torch.func`` fallback; the tree's raw-parameter rule watches the slice as a view
of the parameter (:mod:`skpathkernel._tangent._parameters`). The ref side is the tree with
the view reads switched off (``_capture.parameter_view`` answering None), which routes the
slice as the ref code did: a read that no rule covers. Each case is the public call
``TangentKernel(net)(X)`` (trace, float32, ``net`` the module at its parameters as a
one-point recorded path), timed by ``time.process_time`` on one torch thread, the two
sides alternating, each side's routes checked first: a small ViT (a patch-embedding
convolution, a class token, ``self.pos[:, :L]`` with 17 of its 20 rows, one pre-norm
``nn.TransformerEncoderLayer``, 10 outputs) and a GPT-like network (a token embedding plus
``self.pos[:L]``, one pre-norm causal block), ``N = 256``.

Usage: ``THREADS=1 taskset -c 1 python -m benchmarks.bench_sliced_param_ab [RESULTS]``
(RESULTS ``sliced_param_ab``). Writes ``benchmarks/results/RESULTS.md`` and ``.json``.
"""

import os
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from benchmarks._ab import ab_provenance, ab_row, write_ab
from skpathkernel import PathRecorder, TangentKernel
from skpathkernel._tangent import _capture
from skpathkernel.rules import layer_routes

ROOT = Path(__file__).resolve().parent.parent
REPS = 7
N, D, C = 256, 32, 10


class _ViT(nn.Module):
    def __init__(self, patch=4, side=16, max_tokens=20):
        super().__init__()
        self.patch = nn.Conv2d(3, D, patch, stride=patch)
        self.cls_token = nn.Parameter(torch.randn(1, 1, D) * 0.02)
        self.pos = nn.Parameter(torch.randn(1, max_tokens, D) * 0.02)
        self.encoder = nn.TransformerEncoderLayer(D, 4, 2 * D, dropout=0.0, batch_first=True,
                                                  norm_first=True)
        self.norm = nn.LayerNorm(D)
        self.head = nn.Linear(D, C)

    def forward(self, x):
        x = self.patch(x).flatten(2).transpose(1, 2)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = x + self.pos[:, :x.shape[1]]
        return self.head(self.norm(self.encoder(x))[:, 0])


class _GPT(nn.Module):
    def __init__(self, vocab=100, block_size=32, heads=4):
        super().__init__()
        self.heads = heads
        self.tok = nn.Embedding(vocab, D)
        self.pos = nn.Parameter(torch.randn(block_size, D) * 0.02)
        self.ln1, self.ln2 = nn.LayerNorm(D), nn.LayerNorm(D)
        self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
        self.mlp = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))
        self.head = nn.Linear(D, C)

    def forward(self, ids):
        n, L = ids.shape
        x = self.tok(ids) + self.pos[:L]
        q, k, v = self.qkv(self.ln1(x)).reshape(n, L, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        h = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(h.transpose(1, 2).reshape(n, L, D))
        return self.head(x + self.mlp(self.ln2(x)))[:, -1]


def _cases():
    torch.manual_seed(0)
    yield ("ViT, pos[:, :17] of 20 rows, n=256, C=10", _ViT().eval(),
           torch.randn(N, 3, 16, 16).numpy())
    yield ("GPT, pos[:16] of 32 rows, n=256, C=10", _GPT().eval(),
           torch.randint(0, 100, (N, 16)).numpy())


def main(results="sliced_param_ab"):
    torch.set_num_threads(int(os.environ.get("THREADS", "1")))
    warnings.simplefilter("ignore")
    view = _capture.parameter_view
    sides = {"ref": lambda *args: None, "tree": view}
    rows = []
    try:
        for case, net, X in _cases():
            est = PathRecorder(net, torch.optim.SGD(net.parameters(), lr=0.0)).as_estimator()
            times, grams = {"ref": [], "tree": []}, {}
            for _ in range(REPS):
                for side, read in sides.items():
                    _capture.parameter_view = read
                    routes = {r.route for r in layer_routes(net, torch.as_tensor(X[:2]))}
                    assert routes == ({"rule", "fallback"} if side == "ref" else {"rule"})
                    start = time.process_time()
                    grams[side] = TangentKernel(est)(X)
                    times[side].append(time.process_time() - start)
            diff = float(np.abs(grams["ref"] - grams["tree"]).max()
                         / np.abs(grams["ref"]).max())
            rows.append(ab_row(case, times, os.getloadavg()[0], max_rel_diff=diff))
            print(case, f"{rows[-1]['ref_median']:.3f} {rows[-1]['tree_median']:.3f} "
                  f"{rows[-1]['ratio_median']:.2f} {diff:.1e}", flush=True)
    finally:
        _capture.parameter_view = view
    prov = ab_provenance(ROOT, "bench_sliced_param_ab",
                         ["skpathkernel/_tangent", "benchmarks/bench_sliced_param_ab.py"],
                         "the tree with view reads off", REPS, float32=True)
    write_ab(ROOT / "benchmarks" / "results" / results,
             "A position embedding read through a slice: fallback (ref) vs rule (tree)",
             "time.process_time", prov, rows, 3, machine=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
