"""One-process A/B of raw parameters read by matrix products, main vs the tree (s55):
products passing their arguments by keyword and products on rows flattened as
``x.view(-1, d)`` (main: the fallback; the tree: sites of the Linear rule), and raw
attention projections ``x @ Wq``, ``x @ Wk``, ``x @ Wv`` (both sides sites; main copies
each site's output, the tree hands it on as nn.Linear's).

REF's ``_tangent/_parameters.py`` and ``_tangent/_capture.py`` are loaded beside the tree's
(:func:`benchmarks._ab.reference_module`, REF's ``_capture`` importing REF's
``_parameters``) and patched in and out of ``_gram`` (its ``capture`` and
``checked_capture``), the two sides alternating; each case is ``TangentKernel`` (the trace
Gram, one recorded point), timed by ``time.process_time`` on one torch thread; each side's
routes checked first. Memory, per side, once: the bytes ``aten::clone`` allocates in the
call (``torch.profiler``, ``profile_memory=True``), and ``Capture.graph_bytes`` of one
capture of the rows as the engine runs it (``copy_sites=False``): what the forward pass
holds for the backward passes, the sites and their inputs.

Usage: ``taskset -c 0 python -m benchmarks.bench_free_matmul_s55_ab [REF] [RESULTS]``
(REF ``main``; RESULTS ``free_matmul-s55``; ``REPS``, and ``ONLY`` a part of the case names
to run, in the environment: ``free_matmul-s55-attention`` is ``ONLY=attention REPS=21``).
Writes ``benchmarks/results/RESULTS.md`` and
``.json``.
"""

import os
import sys
import time
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.profiler import ProfilerActivity, profile

from benchmarks._ab import ab_provenance, ab_row, reference_module, write_ab
from benchmarks.bench_free_matmul_ab import RawAttention  # s54's case
from skpathkernel import PathRecorder
from skpathkernel._tangent import _gram
from skpathkernel.kernels import TangentKernel

ROOT = Path(__file__).resolve().parent.parent
REPS = int(os.environ.get("REPS", "5"))
# Only the cases whose names hold this (ONLY="attention": the memory-only change, rerun
# with more rounds).
ONLY = os.environ.get("ONLY", "")


class KeywordMLP(nn.Module):
    """A two-layer MLP on sequences (N, 16, 32) -> 64 -> 32, F.linear by keyword."""

    def __init__(self, d=32, h=64, n_out=4):
        super().__init__()
        self.W1, self.b1 = nn.Parameter(torch.randn(h, d) / d**0.5), nn.Parameter(torch.zeros(h))
        self.W2, self.b2 = nn.Parameter(torch.randn(d, h) / h**0.5), nn.Parameter(torch.zeros(d))
        self.head = nn.Linear(d, n_out)

    def forward(self, x):
        h = torch.tanh(F.linear(x, weight=self.W1, bias=self.b1))
        h = torch.tanh(F.linear(input=h, weight=self.W2, bias=self.b2))
        return self.head(h.mean(1))


class FlatMLP(KeywordMLP):
    """The same MLP written on the rows samples x positions: F.linear(x.view(-1, d), ...)
    and x.view(-1, h) @ W2.T + b2, viewed back to (N, 16, .)."""

    def forward(self, x):
        n, s, d = x.shape
        h = torch.tanh(F.linear(x.view(-1, d), self.W1, self.b1).view(n, s, -1))
        h = torch.tanh((h.view(n * s, -1) @ self.W2.T + self.b2).view(n, s, -1))
        return self.head(h.mean(1))


def _cases():
    torch.manual_seed(0)
    cases = {}
    for n in (256, 1024):
        X = torch.randn(n, 16, 32)
        # With main's fallback set (x.view(-1, h) @ W2.T was a site already).
        cases[f"raw attention d=32, L=16, N={n}, C=4"] = (RawAttention(), X, set())
        cases[f"keyword F.linear MLP 32-64-32, L=16, N={n}, C=4"] = (
            KeywordMLP(), X, {"W1", "b1", "W2", "b2"})
        cases[f"flattened-rows MLP 32-64-32, L=16, N={n}, C=4"] = (
            FlatMLP(), X, {"W1", "b1", "b2"})
    return {case: v for case, v in cases.items() if ONLY in case}


def _memory(cap_fn, net, params, est, X):
    """(bytes aten::clone allocates in a TangentKernel call, the graph bytes of one
    capture of the rows as the engine runs it)."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        TangentKernel(est)(X.numpy())
    clone = sum(e.cpu_memory_usage for e in prof.key_averages() if e.key == "aten::clone")
    cap = cap_fn(net, params, X, [0, 1, 2, 3], memory_budget=2**30, measure_graph=True,
                 copy_sites=False)
    return clone, cap.graph_bytes


def main(ref="main", results="free_matmul-s55"):
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    ref_params = reference_module(ROOT, ref, "skpathkernel/_tangent/_parameters.py")
    ref_capture = reference_module(
        ROOT, ref, "skpathkernel/_tangent/_capture.py",
        replace=[("from ._parameters import", "from ._parameters_ref import")])
    assert ref_capture.product_site is ref_params.product_site
    sides = {"ref": (ref_capture.capture, ref_capture.checked_capture),
             "tree": (_gram.capture, _gram.checked_capture)}
    rows = []
    try:
        for case, (net, X, ref_fallback) in _cases().items():
            est = PathRecorder(net, torch.optim.SGD(net.parameters(), lr=0.0)).as_estimator()
            times, grams, memory = {"ref": [], "tree": []}, {}, {}
            params = {k: v.detach() for k, v in net.named_parameters() if v.requires_grad}
            for side, (cap, _) in sides.items():
                fallback = set(cap(net, params, X[:2], [0], memory_budget=2**26).fallback)
                assert fallback == (ref_fallback if side == "ref" else set()), (side, fallback)
                _gram.capture, _gram.checked_capture = sides[side]
                memory[side] = _memory(cap, net, params, est, X)
            for _ in range(REPS):
                for side, (cap, check) in sides.items():
                    _gram.capture, _gram.checked_capture = cap, check
                    start = time.process_time()
                    grams[side] = TangentKernel(est)(X.numpy())
                    times[side].append(time.process_time() - start)
            diff = float(abs(grams["ref"] - grams["tree"]).max() / abs(grams["ref"]).max())
            row = ab_row(case, times, os.getloadavg()[0], max_rel_diff=diff,
                         ref_clone_bytes=memory["ref"][0], tree_clone_bytes=memory["tree"][0],
                         ref_graph_bytes=memory["ref"][1], tree_graph_bytes=memory["tree"][1])
            row.update(clones=f"{memory['ref'][0] / 2**20:.1f} / {memory['tree'][0] / 2**20:.1f}",
                       graph=f"{memory['ref'][1] / 2**20:.2f} / {memory['tree'][1] / 2**20:.2f}")
            rows.append(row)
            print(case, f"{row['ratio_median']:.3f}", row["clones"], row["graph"],
                  f"diff {diff:.1e}", flush=True)
    finally:
        _gram.capture, _gram.checked_capture = sides["tree"]
    prov = ab_provenance(ROOT, "bench_free_matmul_s55_ab",
                         ["skpathkernel/_tangent/_capture.py",
                          "skpathkernel/_tangent/_parameters.py",
                          "benchmarks/bench_free_matmul_s55_ab.py"], ref, REPS)
    write_ab(ROOT / "benchmarks" / "results" / results,
             "Raw parameters read by matrix products (keywords, flattened rows, attention "
             "projections): ref vs tree, TangentKernel trace", "time.process_time", prov,
             rows, 3, machine=True,
             columns=(("aten::clone MiB ref / tree", "clones"),
                      ("graph MiB ref / tree", "graph")))


if __name__ == "__main__":
    main(*sys.argv[1:])
