"""One-process A/B of the generic fallback's first-row autograd check.

``_tangent._generic.per_sample_jacobian`` now checks each chunk's first row of the
``vmap(jacrev)`` Jacobian against plain autograd (torch 2.13's vmap of prelu's backward is
silently wrong on some chunks). The ref's ``_generic.py`` (``git show REF:...``) is loaded
beside the tree's and patched in and out of the capture, the two sides alternating; each
case is ``tangent_gram`` (the trace Gram) on a network whose fallback layers are an
``nn.RMSNorm`` (a small share of the parameters; a subclass, since nn.RMSNorm itself now
has a rule) or a tensordot on a raw parameter (most of them), timed by
``time.process_time`` on one torch thread.

Usage: ``THREADS=1 taskset -c 1 python -m benchmarks.bench_fallback_check_ab [REF] [RESULTS]``
(REF ``main``; RESULTS ``fallback_check_ab``). Writes ``benchmarks/results/RESULTS.md``
and ``.json``.
"""

import importlib.util
import os
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch
from torch import nn

from benchmarks._ab import ab_provenance, ab_row, write_ab
from skpathkernel._tangent import _capture, _generic, tangent_gram

ROOT = Path(__file__).resolve().parent.parent
REPS = 7


class _TensorDot(nn.Module):
    """A raw weight read by a tensordot: on the fallback (``x @ self.w`` is a site of the
    Linear rule since session s54, ``_parameters.product_site``)."""

    def __init__(self, a, b):
        super().__init__()
        self.w = nn.Parameter(torch.randn(a, b) / a**0.5)

    def forward(self, x):
        return torch.tensordot(x, self.w, dims=1)


class _RMSNorm(nn.RMSNorm):
    """nn.RMSNorm under a type without a rule (a subclass overriding forward): on the
    fallback, as nn.RMSNorm was when these cases were measured."""

    def forward(self, x):
        return super().forward(x)


def _cases():
    torch.manual_seed(0)
    return {
        "raw tensordot 64x128 (fallback), N=512, C=10": (
            nn.Sequential(_TensorDot(64, 128), nn.Tanh(), nn.Linear(128, 10)),
            torch.randn(512, 64)),
        "Linear-RMSNorm-Linear, N=1024, C=10": (
            nn.Sequential(nn.Linear(64, 256), _RMSNorm(256), nn.Tanh(), nn.Linear(256, 10)),
            torch.randn(1024, 64)),
        "Linear-RMSNorm-Linear, N=256, C=1": (
            nn.Sequential(nn.Linear(64, 256), _RMSNorm(256), nn.Tanh(), nn.Linear(256, 1)),
            torch.randn(256, 64)),
        "tokens: Linear-RMSNorm-Linear, N=256 x 8, C=10": (
            nn.Sequential(nn.Linear(16, 64), _RMSNorm(64), nn.Flatten(), nn.Linear(512, 10)),
            torch.randn(256, 8, 16)),
    }


def _ref_generic(ref):
    source = subprocess.run(["git", "show", f"{ref}:skpathkernel/_tangent/_generic.py"],
                            cwd=ROOT, capture_output=True, text=True, check=True).stdout
    path = Path(tempfile.mkdtemp()) / "_ref_generic.py"
    path.write_text(source.replace("from .._memory", "from skpathkernel._memory"))
    spec = importlib.util.spec_from_file_location("_ref_generic", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.per_sample_jacobian


def main(ref="main", results="fallback_check_ab"):
    torch.set_num_threads(int(os.environ.get("THREADS", "1")))
    warnings.simplefilter("ignore")
    sides = {"ref": _ref_generic(ref), "tree": _generic.per_sample_jacobian}
    rows = []
    for case, (net, X) in _cases().items():
        params = {k: v.detach() for k, v in net.named_parameters()}
        times, grams = {"ref": [], "tree": []}, {}
        for _ in range(REPS):
            for side, fn in sides.items():
                _capture.per_sample_jacobian = fn
                start = time.process_time()
                grams[side] = tangent_gram(net, params, X)
                times[side].append(time.process_time() - start)
        _capture.per_sample_jacobian = sides["tree"]
        diff = ((grams["ref"] - grams["tree"]).abs().max() / grams["ref"].abs().max()).item()
        rows.append(ab_row(case, times, os.getloadavg()[0], max_rel_diff=diff))
        print(case, f"{rows[-1]['ratio_least']:.3f}", flush=True)
    prov = ab_provenance(ROOT, "bench_fallback_check_ab",
                         ["skpathkernel/_tangent/_generic.py",
                          "benchmarks/bench_fallback_check_ab.py"], ref, REPS)
    write_ab(ROOT / "benchmarks" / "results" / results,
             "The fallback's first-row autograd check: ref (no check) vs tree",
             "time.process_time", prov, rows, 3)


if __name__ == "__main__":
    main(*sys.argv[1:])
