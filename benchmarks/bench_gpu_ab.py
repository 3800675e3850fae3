"""GPU A/B of the engine's launch-bound choices, for a session lent a GPU.

The first GPU run (``results/*-quick-cuda.md``) found the engine's small calls bound by
kernel launches, not arithmetic: the default classifier's Adam path kernel at N = 1000
took 16 ms per recorded point, 9.5 times its FLOP floor, where its route issues about
1600 torch calls per point; the image networks' Grams at N = 128 took 2-11 times
torch.func's ``vmap`` recipe. Two remedies, each timed against what it replaces, in one
process, the two sides alternating (wall time, the device synchronised around each call):

- ``path``: the default estimator's ``path_kernel_(X[:N])`` on 1000 standardised digits
  (Adam, and SGD at lr 0.1), with the CPU's cache tiling of the stacked route (ref:
  ``_stacked._launch_bound`` made False) against the launch-bound tiling the engine now
  takes on a GPU (tree: whole panels, strips of a quarter of the rows, chunks as large as
  the budget allows).
- ``backprops``: ``tangent_gram`` (the trace over 10 outputs) of the benchmark's image
  networks at N = 128, with the backprops of one backward pass per output (ref: the
  engine's) against one batched backward pass over all outputs (tree: a prototype defined
  here, ``torch.autograd.grad(..., is_grads_batched=True)``; on one CPU core it was
  5-15% slower, so the engine does not take it: this row decides whether a GPU should;
  its last column names the backward operations that have no batching rule, which the
  batched pass runs as a loop over the outputs).
- ``transfer``: the public kernels' float64 Gram copied from the device into NumPy, as
  ``to_numpy`` does (ref), against copying the float32 Gram and widening it on the host,
  and against copies through pinned host memory (:func:`transfer_rows`).

Usage: ``python -m benchmarks.bench_gpu_ab [--device cuda] [--out PATH] [--small]``
(``--small``: N and repeats cut down, to try it on a CPU). Writes ``PATH.md`` and
``.json`` (default ``benchmarks/results/gpu_ab``); ``benchmarks/device_check.sh`` runs it
first after the CUDA tests.
"""

import argparse
import os
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from benchmarks import _worker
from benchmarks._ab import ab_provenance, ab_row, write_ab
from skpathkernel._tangent import _capture, _stacked, tangent_gram

ROOT = Path(__file__).resolve().parent.parent


def batched_backprops(seeds, zs, scratch=None):
    """The engine's ``_capture._backprops`` by one batched backward pass over the seeds."""
    if len(seeds) == 1:
        return ENGINE_BACKPROPS(seeds, zs, scratch)
    s = torch.stack(seeds)
    eye = torch.eye(len(seeds), dtype=s.dtype, device=s.device)
    grads = list(torch.autograd.grad(s, zs, eye, is_grads_batched=True, allow_unused=True))
    out = []
    for j, z in enumerate(zs):
        buf = _capture._buffer(scratch, j, (z.shape[0], len(seeds), *z.shape[1:]), z)
        if grads[j] is None:
            buf.zero_()
        else:
            buf.copy_(grads[j].transpose(0, 1))
        grads[j] = None  # one side's memory at a time
        out.append(buf)
    return out


ENGINE_BACKPROPS = _capture._backprops


def _timed(call, sync):
    sync()
    start = time.perf_counter()
    result = call()
    sync()
    return time.perf_counter() - start, result


def _alternate(sides, call, reps, sync):
    """Times and last results of ``call`` under each side's patch, alternating."""
    times, results = {k: [] for k in sides}, {}
    for rep in range(reps + 1):
        for side, patch in sides.items():
            patch()
            t, results[side] = _timed(call, sync)
            if rep:  # the first round warms up
                times[side].append(t)
    return times, results


def _rel(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def path_rows(device, sizes, reps, sync, done):
    from sklearn.datasets import load_digits
    from sklearn.preprocessing import StandardScaler

    from skpathkernel import PathKernelClassifier

    X, y = load_digits(return_X_y=True)
    X = StandardScaler().fit_transform(X)[:1000]
    real = _stacked._launch_bound
    sides = {"ref": lambda: setattr(_stacked, "_launch_bound", lambda d: False),
             "tree": lambda: setattr(_stacked, "_launch_bound", real)}
    for solver in ("adam", "sgd"):
        kw = {} if solver == "adam" else dict(solver="sgd", learning_rate_init=0.1)
        est = PathKernelClassifier(random_state=0, device=device, **kw).fit(X, y[:1000])
        for n in sizes:
            times, res = _alternate(sides, lambda est=est, n=n: est.path_kernel_(X[:n]), reps,
                                    sync)
            done(ab_row(f"path_kernel_(X[:{n}]), {solver}, "
                        f"{len(est.trajectory_) - 1} points", times, os.getloadavg()[0],
                        max_rel_diff=_rel(res["tree"], res["ref"])))
        sides["tree"]()


def backprops_rows(device, n, reps, sync, done):
    sides = {"ref": lambda: setattr(_capture, "_backprops", ENGINE_BACKPROPS),
             "tree": lambda: setattr(_capture, "_backprops", batched_backprops)}
    for arch in ("cnn8", "cifar", "resnet", "vit"):
        module, params, X = _worker.gram_problem({"arch": arch, "n": n, "dtype": "float32"},
                                                 torch.device(device))
        # The batching rules' fallbacks (a loop over the outputs) warn only when asked.
        torch._C._debug_only_display_vmap_fallback_warnings(True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            times, res = _alternate(
                sides, lambda m=module, p=params, x=X: tangent_gram(m, p, x), reps, sync)
        sides["ref"]()
        torch._C._debug_only_display_vmap_fallback_warnings(False)
        slow = sorted({str(w.message)[:160] for w in caught
                       if "performance" in str(w.message)})
        done(ab_row(f"tangent_gram {arch}, N={n}, batched backprops", times,
                    os.getloadavg()[0], max_rel_diff=_rel(res["tree"].cpu(), res["ref"].cpu()),
                    vmap_fallbacks="; ".join(slow) or "none"))


def _to_host(route):
    """A float64 NumPy Gram from the device's: ``route`` names the copy (see
    :func:`transfer_rows`)."""
    def pinned(K):
        host = torch.empty(K.shape, dtype=K.dtype, pin_memory=True)
        return host.copy_(K).numpy()

    return {"ref": lambda K64, K32: K64.cpu().numpy(),
            "float32": lambda K64, K32: K32.cpu().numpy().astype(np.float64),
            "pinned": lambda K64, K32: pinned(K64),
            "pinned float32": lambda K64, K32: pinned(K32).astype(np.float64)}[route]


def _choose(slot: list, f):
    """A side's patch for :func:`_alternate`: ``f`` put where the timed call reads it."""
    return lambda: slot.__setitem__(0, f)


def transfer_rows(device, sizes, reps, sync, done):
    """The public kernels' last step: a Gram on the device to a float64 NumPy array.

    ``TangentKernel(net)(X)`` took 1.3-3.5 times its engine call on the GPU's MLP rows
    (``results/gram-quick-cuda.md``, N = 512-2048), growing with N^2: the engine writes K
    in float64 on the device and ``to_numpy`` copies it into fresh pageable host memory.
    Each row times that copy (ref) against one alternative: the float32 Gram copied and
    widened on the host (half the bytes over the bus; exact, as every float32 is a
    float64), and either copy through a freshly pinned host buffer.
    """
    for n in sizes:
        K32 = torch.randn(n, n, device=device)
        K64 = K32.double()
        # (Pinned memory needs an accelerator: a CPU run tries the first route only.)
        pinned = ("pinned", "pinned float32") if device == "cuda" else ()
        for route in ("float32", *pinned):
            # Each side "patches" in its copy; the call runs the one patched in.
            slot = [None]
            sides = {"ref": _choose(slot, _to_host("ref")),
                     "tree": _choose(slot, _to_host(route))}

            def call(slot=slot, a=K64, b=K32):
                return slot[0](a, b)

            times, res = _alternate(sides, call, reps, sync)
            done(ab_row(f"K ({n} x {n}) to float64 NumPy: {route}", times,
                        os.getloadavg()[0], max_rel_diff=_rel(res["tree"], res["ref"])))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu_ab"))
    parser.add_argument("--small", action="store_true")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench_gpu_ab: torch sees no CUDA device")
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    sizes, reps, n = ((100,), 1, 32) if args.small else ((100, 1000), 1, 128)
    prov = ab_provenance(ROOT, "bench_gpu_ab",
                         ["skpathkernel/_tangent/_stacked.py",
                          "skpathkernel/_tangent/_capture.py", "benchmarks/bench_gpu_ab.py"],
                         "the CPU's tiling / one backward pass per output", reps,
                         device=args.device + (f" ({torch.cuda.get_device_name()})"
                                               if args.device == "cuda" else ""))
    rows = []

    def done(row):
        # Written after every row: a run stopped at its time limit keeps the rows before.
        rows.append(row)
        print(row["case"], f"{row['ratio_least']:.2f}", flush=True)
        write_ab(Path(args.out), "The engine's launch-bound choices on a GPU: ref vs tree",
                 "time.perf_counter, the device synchronised", prov, rows, 4,
                 columns=[("vmap fallbacks", "vmap_fallbacks")])

    # The quick rows first: a run stopped at its limit loses the slowest (the CPU's
    # tiling at N = 1000 took 8 s a call on the first GPU run).
    backprops_rows(args.device, n, reps + 1, sync, done)
    transfer_rows(args.device, (256,) if args.small else (1024, 2048, 4096), 5, sync, done)
    path_rows(args.device, sizes, reps, sync, done)


if __name__ == "__main__":
    main()
