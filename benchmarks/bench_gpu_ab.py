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
  networks at N = 128 with the CPU's choices (ref: one backward pass per output, capture
  chunks in an eighth of the budget) against two choices the engine has but does not
  take until this measures them, with their peak memory (a review found both could
  exceed ``memory_budget``, which the default 1 GiB leaves room to see): one batched
  backward pass over all outputs (``_capture._batches_backprops``; its prototype ran
  1.33-2.1x faster on the run of 2026-12-04 18:32 UTC), then also chunks as large as
  the kept blocks leave room for (``_gram._wide_chunks``: 2-3.5x fewer torch calls,
  counted on the CPU). The batched row's last column names the backward operations
  that have no batching rule, which the batched pass runs as a loop over the outputs.
  Then the engine against torch.func's ``vmap`` recipe (ref: the recipe of
  ``benchmarks/_worker.py``), the Gram rows' peer.
- ``backprop routes``: the outputs' backprops alone (what a capture's backward passes
  compute) of the same networks by the batched pass (ref) against a prototype, one
  ordinary backward pass over the batch repeated once per output with output ``c``
  seeded on the ``c``-th copy (tree: every layer's backward runs batched natively, where
  the batched pass loops over the outputs for the backward ops without a batching rule:
  convolution, batch and layer norm, max-pool, attention, GELU; its forward runs over
  ``C n`` rows), and the batched pass against the loop.
- ``precision``: why the image networks' float32 K on the GPU differed from torch.func's
  by 7.9e-5 to 2.4e-3 (relative; below 1e-5 on the CPU) in both GPU runs. torch lets
  cuDNN's float32 convolutions run in TF32 by default (``torch.backends.cudnn.allow_tf32``;
  its matmuls stay IEEE). Each network's K, by the engine and by the vmap recipe, under
  the default (ref) and with cuDNN's TF32 off (tree), each against the engine's float64 K
  on the CPU: the engine promises float32's precision, so if TF32 is the cause it must
  either turn it off around its own calls or report the error it leaves.
- ``transfer``: the public kernels' float64 Gram copied from the device into NumPy as
  ``to_numpy`` does (ref: ``Tensor.cpu().numpy()``, into fresh pageable memory) against
  two prototypes: through page-locked memory of the array's own (``pinned``: 3-30x
  faster on the run of 2026-12-04, but every array the user keeps would hold locked
  memory), and through one reused 64 MiB page-locked buffer into pageable memory
  (``staged``: no more than that is ever locked), with torch's cache of page-locked
  blocks warm, and emptied before every call (cold: the first transfer of a process pays
  the page locking).

Usage: ``python -m benchmarks.bench_gpu_ab [--device cuda] [--out PATH] [--small]``
(``--small``: N and repeats cut down, to try it on a CPU). Writes ``PATH.md`` and
``.json`` (default ``benchmarks/results/gpu_ab``); ``benchmarks/device_check.sh`` runs it
first after the CUDA tests.
"""

import argparse
import copy
import os
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

from benchmarks import _worker
from benchmarks._ab import ab_provenance, ab_row, write_ab
from skpathkernel._device import to_numpy
from skpathkernel._tangent import _capture, _gram, _stacked, tangent_gram

ROOT = Path(__file__).resolve().parent.parent


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


def _peak_mib(patch, call, device):
    """Peak device memory of one call under ``patch``, above what it started with (MiB);
    None off a GPU."""
    if device != "cuda":
        return None
    patch()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.memory_allocated()
    out = call()
    torch.cuda.synchronize()
    return round((torch.cuda.max_memory_allocated() - start - out.nbytes) / 2**20, 1)


def backprops_rows(device, n, reps, sync, done):
    real_batched, real_wide = _capture._batches_backprops, _gram._wide_chunks

    def choose(batched, wide):
        def patch():
            _capture._batches_backprops = (lambda d: True) if batched else real_batched
            _gram._wide_chunks = (lambda d: True) if wide else real_wide
        return patch

    sides = {"ref": choose(False, False), "batched": choose(True, False),
             "tree": choose(True, True)}
    for arch in ("cnn8", "cifar", "resnet", "vit"):
        module, params, X = _worker.gram_problem({"arch": arch, "n": n, "dtype": "float32"},
                                                 torch.device(device))
        # The batching rules' fallbacks (a loop over the outputs) warn only when asked.
        torch._C._debug_only_display_vmap_fallback_warnings(True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            times, res = _alternate(
                sides, lambda m=module, p=params, x=X: tangent_gram(m, p, x), reps, sync)
        torch._C._debug_only_display_vmap_fallback_warnings(False)
        peaks = {side: _peak_mib(patch, lambda m=module, p=params, x=X: tangent_gram(m, p, x),
                                 device) for side, patch in sides.items()}
        sides["ref"]()
        slow = sorted({str(w.message)[:160] for w in caught
                       if "performance" in str(w.message)})
        done(ab_row(f"tangent_gram {arch}, N={n}, batched backprops",
                    {"ref": times["ref"], "tree": times["batched"]}, os.getloadavg()[0],
                    max_rel_diff=_rel(res["batched"].cpu(), res["ref"].cpu()),
                    peak_mib=f"{peaks['ref']} / {peaks['batched']}",
                    vmap_fallbacks="; ".join(slow) or "none"))
        done(ab_row(f"tangent_gram {arch}, N={n}, batched backprops and wide chunks",
                    {"ref": times["ref"], "tree": times["tree"]}, os.getloadavg()[0],
                    max_rel_diff=_rel(res["tree"].cpu(), res["ref"].cpu()),
                    peak_mib=f"{peaks['ref']} / {peaks['tree']}"))
        slot = [None]
        peer = {"ref": _choose(slot, lambda m, p, x: _worker._vmap_recipe(m, p, x)),
                "tree": _choose(slot, tangent_gram)}
        times, res = _alternate(peer, lambda m=module, p=params, x=X, s=slot: s[0](m, p, x),
                                reps, sync)
        done(ab_row(f"tangent_gram {arch}, N={n}, against torch.func's vmap recipe", times,
                    os.getloadavg()[0], max_rel_diff=_rel(res["tree"].cpu(), res["ref"].cpu())))


def _tf32(on):
    def patch():
        torch.backends.cudnn.allow_tf32 = on
    return patch


def precision_rows(device, n, reps, sync, done):
    sides = {"ref": _tf32(True), "tree": _tf32(False)}
    default = torch.backends.cudnn.allow_tf32
    for arch in ("cnn8", "cifar", "resnet", "vit"):
        module, params, X = _worker.gram_problem({"arch": arch, "n": n, "dtype": "float32"})
        # The same network and inputs, cast (drawn in float64 they would be others).
        wide = copy.deepcopy(module).double()
        exact = tangent_gram(wide, dict(wide.named_parameters()), X.double())
        module, X = module.to(device), X.to(device)
        params = {k: v.detach() for k, v in module.named_parameters()}
        for name, gram in (("engine", tangent_gram), ("vmap recipe", _worker._vmap_recipe)):
            times, res = _alternate(sides, lambda m=module, p=params, x=X, g=gram: g(m, p, x),
                                    reps, sync)
            done(ab_row(f"{name} {arch}, N={n}, cuDNN TF32 on (ref) / off (tree)", times,
                        os.getloadavg()[0], max_rel_diff=_rel(res["tree"].cpu(),
                                                              res["ref"].cpu()),
                        error=f"{_rel(res['ref'].cpu(), exact):.1e} / "
                              f"{_rel(res['tree'].cpu(), exact):.1e}"))
        torch.backends.cudnn.allow_tf32 = default


def _site_outputs(module, X):
    """The network's outputs ``f`` and the outputs of its parameterised leaf layers (the
    sites whose backprops a capture takes), by forward hooks."""
    sites = []
    hooks = [m.register_forward_hook(lambda m, a, out: sites.append(out))
             for m in module.modules() if next(m.parameters(recurse=False), None) is not None
             and not list(m.children())]
    try:
        f = module(X)
    finally:
        for h in hooks:
            h.remove()
    return f.reshape(X.shape[0], -1), [z for z in sites if isinstance(z, torch.Tensor)]


def _backprops_by(route, module, X):
    """Every output's backprop to every site, ``(n, C, ...)`` per site, by one of three
    routes: one backward pass per output (``loop``, the CPU's), one batched backward pass
    (``batched``, ``is_grads_batched``, the GPU's), or one ordinary backward pass over the
    batch repeated once per output, output ``c`` seeded on the ``c``-th copy
    (``replicated``, a prototype: no vmap fallbacks, a forward over ``C n`` rows)."""
    n = X.shape[0]
    if route == "replicated":
        C = _site_outputs(module, X[:1])[0].shape[1]
        f, zs = _site_outputs(module, X.repeat(C, *([1] * (X.ndim - 1))))
        seed = f.reshape(C, n, C).diagonal(dim1=0, dim2=2).sum()
        grads = torch.autograd.grad(seed, zs)
        return [g.reshape(C, n, *g.shape[1:]).transpose(0, 1) for g in grads]
    f, zs = _site_outputs(module, X)
    seeds = [f[:, c].sum() for c in range(f.shape[1])]
    if route == "batched":
        eye = torch.eye(len(seeds), dtype=f.dtype, device=f.device)
        grads = torch.autograd.grad(torch.stack(seeds), zs, eye, is_grads_batched=True)
        return [g.transpose(0, 1) for g in grads]
    per_output = [torch.autograd.grad(s, zs, retain_graph=True) for s in seeds]
    return [torch.stack(gs, 1) for gs in zip(*per_output)]


def backprop_route_rows(device, n, reps, sync, done):
    """The outputs' backprops alone (a capture's backward part), by each route."""
    slot = [None]
    sides = {"ref": _choose(slot, "batched"), "loop": _choose(slot, "loop"),
             "tree": _choose(slot, "replicated")}
    for arch in ("cnn8", "cifar", "resnet", "vit"):
        module, _, X = _worker.gram_problem({"arch": arch, "n": n, "dtype": "float32"},
                                            torch.device(device))
        times, res = _alternate(sides, lambda m=module, x=X: _backprops_by(slot[0], m, x),
                                reps, sync)
        diff = max(_rel(a.cpu(), b.cpu()) for a, b in zip(res["tree"], res["ref"]))
        done(ab_row(f"backprops of {arch}, N={n}: replicated batch vs batched pass",
                    {"ref": times["ref"], "tree": times["tree"]}, os.getloadavg()[0],
                    max_rel_diff=diff))
        diff = max(_rel(a.cpu(), b.cpu()) for a, b in zip(res["loop"], res["ref"]))
        done(ab_row(f"backprops of {arch}, N={n}: batched pass vs loop",
                    {"ref": times["loop"], "tree": times["ref"]}, os.getloadavg()[0],
                    max_rel_diff=diff))


def _choose(slot: list, f):
    """A side's patch for :func:`_alternate`: ``f`` put where the timed call reads it."""
    return lambda: slot.__setitem__(0, f)


def transfer_rows(device, sizes, reps, sync, done):
    """The public kernels' last step: a float64 Gram on the device to NumPy.

    ``TangentKernel(net)(X)`` took 1.3-3.5 times its engine call on the GPU's MLP rows
    (``results/gram-quick-cuda.md``, N = 512-2048), growing with N^2: ``to_numpy`` copies
    K into fresh pageable host memory (ref).
    """
    if device != "cuda":
        return  # page-locked memory needs an accelerator
    empty_cache = getattr(torch._C, "_host_emptyCache", None)
    for n in sizes:
        K = torch.randn(n, n, device=device, dtype=torch.float64)
        for cold in (False, True):
            if cold and empty_cache is None:
                continue
            slot = [None]
            sides = {"ref": _choose(slot, to_numpy), "pinned": _choose(slot, _pinned),
                     "staged": _choose(slot, _staged)}

            def call(slot=slot, K=K, cold=cold):
                if cold:
                    empty_cache()
                return slot[0](K)

            times, res = _alternate(sides, call, reps, sync)
            name = f"K ({n} x {n}) float64 to NumPy, host cache {'cold' if cold else 'warm'}"
            for proto in [k for k in sides if k != "ref"]:
                done(ab_row(f"{name}, {proto}", {"ref": times["ref"], "tree": times[proto]},
                            os.getloadavg()[0], max_rel_diff=_rel(res[proto], res["ref"])))


def _pinned(t):
    """A prototype for :func:`to_numpy`: copied into page-locked memory of its own."""
    return torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t).numpy()


_STAGE = {}


def _staged(t, stage_bytes=2**26):
    """A prototype for :func:`to_numpy`: copied through one reused page-locked buffer of
    ``stage_bytes`` (kept between calls) into pageable memory."""
    out = torch.empty(t.shape, dtype=t.dtype)
    src, dst = t.contiguous().view(-1), out.view(-1)
    if t.dtype not in _STAGE:
        _STAGE[t.dtype] = torch.empty(stage_bytes // t.element_size(), dtype=t.dtype,
                                      pin_memory=True)
    stage = _STAGE[t.dtype]
    for start in range(0, src.numel(), stage.numel()):
        n = min(stage.numel(), src.numel() - start)
        dst[start : start + n].copy_(stage[:n].copy_(src[start : start + n]))
    return out.numpy()


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
                          "skpathkernel/_tangent/_capture.py", "skpathkernel/_device.py",
                          "benchmarks/bench_gpu_ab.py"],
                         "the CPU's tiling / one backward pass per output / the vmap recipe / "
                         ".cpu()", reps,
                         device=args.device + (f" ({torch.cuda.get_device_name()})"
                                               if args.device == "cuda" else ""))
    rows = []

    def done(row):
        # Written after every row: a run stopped at its time limit keeps the rows before.
        rows.append(row)
        print(row["case"], f"{row['ratio_least']:.2f}", flush=True)
        write_ab(Path(args.out), "The engine's launch-bound choices on a GPU: ref vs tree",
                 "time.perf_counter, the device synchronised", prov, rows, 4,
                 columns=[("peak MiB ref / tree (budget 1024)", "peak_mib"),
                          ("vmap fallbacks", "vmap_fallbacks"),
                          ("rel. error vs CPU float64 ref / tree", "error")])

    # The quick rows first: a run stopped at its limit loses the slowest (the CPU's
    # tiling at N = 1000 took 8 s a call on the first GPU run).
    backprops_rows(args.device, n, reps + 1, sync, done)
    precision_rows(args.device, n, reps, sync, done)
    backprop_route_rows(args.device, n, reps + 2, sync, done)
    transfer_rows(args.device, (256,) if args.small else (1024, 2048, 4096, 8192), 5, sync,
                  done)
    path_rows(args.device, sizes, reps, sync, done)


if __name__ == "__main__":
    main()
