"""One-process A/B of raw parameters read by a matrix product: main's capture (the
fallback) vs the tree's (sites of the Linear rule, ``._parameters.product_site``).

REF's ``_tangent/_capture.py`` is loaded beside the tree's (:func:`benchmarks._ab.reference_module`)
and patched in and out of ``_gram`` (its ``capture`` and autograd check), the two sides
alternating; each case is ``TangentKernel`` (the trace Gram, one recorded point) of a
hand-written LoRA network (frozen base Linears, raw ``A``, ``B`` read by ``x @ A.T @ B.T``)
or of single-head attention with raw ``Wq``, ``Wk``, ``Wv`` on ``(N, 16, 32)`` sequences,
timed by ``time.process_time`` on one torch thread; each side's routes checked first.

Usage: ``taskset -c 0 python -m benchmarks.bench_free_matmul_ab [REF] [RESULTS]``
(REF ``main``; RESULTS ``free_matmul_ab``; the s54 run is ``free_matmul-s54``). Writes
``benchmarks/results/RESULTS.md`` and ``.json``.
"""

import os
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import nn

from benchmarks._ab import ab_provenance, ab_row, reference_module, write_ab
from skpathkernel import PathRecorder
from skpathkernel._tangent import _gram
from skpathkernel.kernels import TangentKernel
from skpathkernel.rules import layer_routes

ROOT = Path(__file__).resolve().parent.parent
REPS = int(os.environ.get("REPS", "5"))


class LoRA(nn.Module):
    def __init__(self, d, out, r=8):
        super().__init__()
        self.base = nn.Linear(d, out).requires_grad_(False)
        self.A = nn.Parameter(torch.randn(r, d) / d**0.5)
        self.B = nn.Parameter(torch.randn(out, r) / r**0.5)

    def forward(self, x):
        return self.base(x) + x @ self.A.T @ self.B.T


class LoRANet(nn.Module):
    """Two LoRA layers 64 -> 128 -> 4 (rank 8): 2,592 trained parameters, all raw."""

    def __init__(self):
        super().__init__()
        self.l1, self.l2 = LoRA(64, 128), LoRA(128, 4)

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(x)))


class RawAttention(nn.Module):
    """Single-head attention, raw Wq, Wk, Wv (32 x 32), mean-pooled, a Linear head."""

    def __init__(self, d=32, n_out=4):
        super().__init__()
        self.Wq, self.Wk, self.Wv = (nn.Parameter(torch.randn(d, d) / d**0.5)
                                     for _ in range(3))
        self.head = nn.Linear(d, n_out)

    def forward(self, x):
        q, k, v = x @ self.Wq, x @ self.Wk, x @ self.Wv
        att = torch.softmax(q @ k.transpose(-2, -1) / q.shape[-1]**0.5, dim=-1)
        return self.head((att @ v).mean(1))


def _cases():
    torch.manual_seed(0)
    cases = {}
    for n in (256, 1024):
        cases[f"LoRA 64-128-4 rank 8, N={n}, C=4"] = (LoRANet(), torch.randn(n, 64))
        cases[f"raw attention d=32, L=16, N={n}, C=4"] = (RawAttention(),
                                                         torch.randn(n, 16, 32))
    return cases


def main(ref="main", results="free_matmul_ab"):
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    ref_capture = reference_module(ROOT, ref, "skpathkernel/_tangent/_capture.py")
    sides = {"ref": (ref_capture.capture, ref_capture._numerical_misfits),
             "tree": (_gram.capture, _gram._numerical_misfits)}
    rows = []
    try:
        for case, (net, X) in _cases().items():
            est = PathRecorder(net, torch.optim.SGD(net.parameters(), lr=0.0)).as_estimator()
            times, grams = {"ref": [], "tree": []}, {}
            params = {k: v.detach() for k, v in net.named_parameters() if v.requires_grad}
            raw = {k for k in params if not k.startswith("head.")}
            for side, (cap, _) in sides.items():
                fallback = set(cap(net, params, X[:2], [0], memory_budget=2**26).fallback)
                assert fallback == (raw if side == "ref" else set()), (side, fallback)
            routes = {r.route for r in layer_routes(net, X[:2])}
            for _ in range(REPS):
                for side, (cap, check) in sides.items():
                    _gram.capture, _gram._numerical_misfits = cap, check
                    start = time.process_time()
                    grams[side] = TangentKernel(est)(X.numpy())
                    times[side].append(time.process_time() - start)
            diff = float(abs(grams["ref"] - grams["tree"]).max() / abs(grams["ref"]).max())
            rows.append(ab_row(case, times, os.getloadavg()[0], max_rel_diff=diff,
                               tree_routes=sorted(routes)))
            print(case, f"{rows[-1]['ratio_median']:.3f}", flush=True)
    finally:
        _gram.capture, _gram._numerical_misfits = sides["tree"]
    prov = ab_provenance(ROOT, "bench_free_matmul_ab",
                         ["skpathkernel/_tangent/_capture.py",
                          "skpathkernel/_tangent/_parameters.py",
                          "benchmarks/bench_free_matmul_ab.py"], ref, REPS)
    write_ab(ROOT / "benchmarks" / "results" / results,
             "Raw parameters read by matrix products: ref (fallback) vs tree (Linear rule "
             "sites), TangentKernel trace", "time.process_time", prov, rows, 3,
             machine=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
