"""One-process A/B of the copy each forward pass of the user's network now gets.

``_device.forward_input`` hands every forward pass a copy of its rows, so that a network
writing into its input (``nn.ReLU(inplace=True)`` before its first layer with parameters)
rewrites neither the caller's X nor the rows later passes read. The ref side patches it
to the identity (the code before: the rows themselves) in every module that imported it;
the tree side copies. Each case is the public call ``TangentKernel(net)(X)`` on a NumPy
float32 X, ``net`` the module at its parameters as a one-point recorded path, timed by
``time.process_time`` on one torch thread, the two sides alternating. The tree side also
counts the copies and their bytes, and times them alone (``copy s``: their summed
process time inside the call).

Usage: ``THREADS=1 taskset -c 1 python -m benchmarks.bench_forward_copy_ab [REPS] [RESULTS]
[ARCHS]`` (REPS 3; RESULTS ``forward_copy_ab``; ARCHS ``cifar,resnet``, networks of
``benchmarks/_nets.py``). Writes ``benchmarks/results/RESULTS.md`` and ``.json``.
"""

import os
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from benchmarks import _nets
from benchmarks._ab import ab_provenance, ab_row, write_ab
from skpathkernel import PathRecorder, _device
from skpathkernel.kernels import TangentKernel

ROOT = Path(__file__).resolve().parent.parent
N = 1024


def _importers():
    """The package modules holding ``forward_input`` under that name."""
    return [m for name, m in sys.modules.items()
            if name.startswith("skpathkernel") and getattr(m, "forward_input", None)
            is _device.forward_input]


def main(reps="3", results="forward_copy_ab", archs="cifar,resnet"):
    reps = int(reps)
    torch.set_num_threads(int(os.environ.get("THREADS", "1")))
    warnings.simplefilter("ignore")
    copy, modules = _device.forward_input, _importers()
    stats = {"calls": 0, "bytes": 0, "time": 0.0}

    def counted(X):
        start = time.process_time()
        out = copy(X)
        stats["time"] += time.process_time() - start
        stats["calls"] += 1
        stats["bytes"] += X.numel() * X.element_size()
        return out

    sides = {"ref": lambda X: X, "tree": counted}
    rows = []
    try:
        for arch in archs.split(","):
            torch.manual_seed(0)
            module = _nets.build(arch)
            X = _nets.inputs(arch, N).numpy()
            est = PathRecorder(module, torch.optim.SGD(module.parameters(), lr=0.0)).as_estimator()
            times, grams = {"ref": [], "tree": []}, {}
            for _ in range(reps):
                for side, fn in sides.items():
                    for m in modules:
                        m.forward_input = fn
                    stats.update(calls=0, bytes=0, time=0.0)
                    mine = X.copy()
                    start = time.process_time()
                    grams[side] = TangentKernel(est)(mine)
                    times[side].append(time.process_time() - start)
                    assert np.array_equal(mine, X)
            diff = float(np.abs(grams["ref"] - grams["tree"]).max() / np.abs(grams["ref"]).max())
            rows.append(ab_row(f"{arch}, N={N}, TangentKernel(net)(X)", times,
                               os.getloadavg()[0], max_rel_diff=diff,
                               copies=stats["calls"], copied_MiB=round(stats["bytes"] / 2**20, 1),
                               copy_s=round(stats["time"], 4)))
            print(rows[-1]["case"], f"{rows[-1]['ratio_median']:.3f}", stats, flush=True)
    finally:
        for m in modules:
            m.forward_input = copy
    prov = ab_provenance(ROOT, "bench_forward_copy_ab",
                         ["skpathkernel", "benchmarks/bench_forward_copy_ab.py"],
                         "forward_input patched to the identity", reps)
    write_ab(ROOT / "benchmarks" / "results" / results,
             "Each forward pass's copy of its rows: ref (the rows themselves) vs tree",
             "time.process_time", prov, rows, 3,
             columns=(("copies (tree, last call)", "copies"), ("copied MiB", "copied_MiB"),
                      ("copy s (tree, last call)", "copy_s")), machine=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
