"""One-process A/B of raw parameters read by a matrix product: main's capture (the
fallback) vs the tree's (sites of the Linear rule, ``._parameters.product_site``).

REF's ``_tangent/_capture.py`` is loaded beside the tree's (:func:`benchmarks._ab.reference_module`)
and patched in and out of ``_gram`` (its ``capture`` and ``checked_capture``), the two sides
alternating; each case is ``TangentKernel`` (the trace Gram, one recorded point) of a
hand-written LoRA network (frozen base Linears, raw ``A``, ``B`` read by ``x @ A.T @ B.T``)
or of single-head attention with raw ``Wq``, ``Wk``, ``Wv`` on ``(N, 16, 32)`` sequences,
timed by ``time.process_time`` on one torch thread; each side's routes checked first.

A third side, alternated in the same rounds, is the peer: torch.func's empirical NTK as
PyTorch's tutorial "Neural Tangent Kernels" writes it (:func:`empirical_ntk_jacobian_contraction`,
its ``compute='trace'`` variant, called on ``(X, X)``), its K over C checked against the
tree's (TangentKernel's trace is ``trace(J J^T) / C``).

Usage: ``taskset -c 0 python -m benchmarks.bench_free_matmul_ab [REF] [RESULTS]``
(REF ``main``; RESULTS ``free_matmul_ab``; the s54 run is ``free_matmul-s54``, with REF
main before the change; since main holds it, REF is its parent ``31114579``, as in the
``free_matmul-s54b`` run with the peer). Writes ``benchmarks/results/RESULTS.md`` and ``.json``.
"""

import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import nn
from torch.func import functional_call, jacrev, vmap

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


def empirical_ntk_jacobian_contraction(fnet_single, params, x1, x2, compute="full"):
    """The tutorial's method 1 as it writes it: per-sample Jacobians by
    ``vmap(jacrev(fnet_single), (None, 0))``, flattened per parameter, contracted by einsum
    and summed over the parameters; ``compute='trace'`` is its trace over the outputs."""
    jac1 = vmap(jacrev(fnet_single), (None, 0))(params, x1)
    jac1 = [j.flatten(2) for j in jac1.values()]
    jac2 = vmap(jacrev(fnet_single), (None, 0))(params, x2)
    jac2 = [j.flatten(2) for j in jac2.values()]
    einsum_expr = {"full": "Naf,Mbf->NMab", "trace": "Naf,Maf->NM",
                   "diagonal": "Naf,Maf->NMa"}[compute]
    result = torch.stack([torch.einsum(einsum_expr, j1, j2) for j1, j2 in zip(jac1, jac2)])
    return result.sum(0)


def torch_func_ntk(net, params, X):
    """The peer's call: the tutorial's ``fnet_single`` (``functional_call`` on one sample)
    and its trace NTK of ``X`` with itself. ``params`` holds the trained parameters only
    (the tutorial passes all of its CNN's, all trained; a frozen LoRA base is not in the
    tangent kernel, and ``functional_call`` reads it from the module)."""

    def fnet_single(params, x):
        return functional_call(net, params, (x.unsqueeze(0),)).squeeze(0)

    return empirical_ntk_jacobian_contraction(fnet_single, params, X, X, "trace")


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
    # _gram calls capture and checked_capture (the autograd check, session s54's reorder
    # branch moved it into _capture); each side's pair is patched in.
    sides = {"ref": (ref_capture.capture, ref_capture.checked_capture),
             "tree": (_gram.capture, _gram.checked_capture)}
    rows = []
    try:
        for case, (net, X) in _cases().items():
            est = PathRecorder(net, torch.optim.SGD(net.parameters(), lr=0.0)).as_estimator()
            times, grams = {"ref": [], "tree": [], "func": []}, {}
            params = {k: v.detach() for k, v in net.named_parameters() if v.requires_grad}
            raw = {k for k in params if not k.startswith("head.")}
            for side, (cap, _) in sides.items():
                fallback = set(cap(net, params, X[:2], [0], memory_budget=2**26).fallback)
                assert fallback == (raw if side == "ref" else set()), (side, fallback)
            routes = {r.route for r in layer_routes(net, X[:2])}
            for _ in range(REPS):
                for side, (cap, check) in sides.items():
                    _gram.capture, _gram.checked_capture = cap, check
                    start = time.process_time()
                    grams[side] = TangentKernel(est)(X.numpy())
                    times[side].append(time.process_time() - start)
                start = time.process_time()
                grams["func"] = torch_func_ntk(net, params, X)
                times["func"].append(time.process_time() - start)
            diff = float(abs(grams["ref"] - grams["tree"]).max() / abs(grams["ref"]).max())
            # TangentKernel's trace is trace(J J^T) / C, the tutorial's trace(J J^T).
            n_out = net(X[:1]).shape[-1]
            func_diff = float(abs(grams["func"].double().numpy() / n_out - grams["tree"]).max()
                              / abs(grams["tree"]).max())
            assert func_diff < 1e-5, (case, func_diff)
            func_least, func_median = min(times["func"]), statistics.median(times["func"])
            row = ab_row(case, times, os.getloadavg()[0], max_rel_diff=diff,
                         tree_routes=sorted(routes), func_times=times["func"],
                         func_least=func_least, func_median=func_median,
                         func_max_rel_diff=func_diff)
            row["func_ratio_median"] = func_median / row["tree_median"]
            row.update(func_least_s=f"{func_least:.3f}", func_median_s=f"{func_median:.3f}",
                       func_ratio=f"{row['func_ratio_median']:.2f}",
                       func_diff=f"{func_diff:.1e}")
            rows.append(row)
            print(case, f"{row['ratio_median']:.3f}", f"func {row['func_ratio_median']:.3f}",
                  f"diff {func_diff:.1e}", flush=True)
    finally:
        _gram.capture, _gram.checked_capture = sides["tree"]
    prov = ab_provenance(ROOT, "bench_free_matmul_ab",
                         ["skpathkernel/_tangent/_capture.py",
                          "skpathkernel/_tangent/_parameters.py",
                          "benchmarks/bench_free_matmul_ab.py"], ref, REPS)
    write_ab(ROOT / "benchmarks" / "results" / results,
             "Raw parameters read by matrix products: ref (fallback) vs tree (Linear rule "
             "sites), TangentKernel trace; peer: torch.func's empirical NTK (tutorial)",
             "time.process_time", prov, rows, 3, machine=True,
             columns=(("torch.func least (s)", "func_least_s"),
                      ("torch.func median", "func_median_s"),
                      ("torch.func / tree median", "func_ratio"),
                      ("torch.func vs tree rel. diff", "func_diff")))


if __name__ == "__main__":
    main(*sys.argv[1:])
