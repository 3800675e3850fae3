"""``python -m benchmarks [--quick] [--out DIR] [--only A,B] [--threads N] [--device D]
[--peers P,Q] [--nets A,B] [--net-n N]``.

The side-by-side picture: tangent Gram against its peers, GEMM roofline, path kernel,
every estimator at its defaults against MLPClassifier / MLPRegressor at theirs, training
with recording against plain torch / skorch / MLPRegressor, decomposition against
training and its FLOP floor, decomposition against ExPLAIND, tangent-feature SVMs against
RBF SVC / MLPClassifier, OOD AUROC.

Gram and path-kernel cases run in their own processes (servers, :mod:`benchmarks._serve`)
and the repeats of all methods of one problem are interleaved, so that each ratio is
measured under the same background load. Every row reports the median, min and max of
its repeats and its peak memory. Every group is written to its own pair of files as soon
as it finishes, ``DIR/<group>[-quick][-<device>].md`` (provenance: mode, command, commit,
date, machine, load, threads; then the tables) and ``.json`` (the same provenance and the
raw numbers), DIR ``benchmarks/results`` by default: a rerun of a group in the same mode
on the same device replaces its files; ``--nets`` / ``--net-n`` (part of the image and
token networks, or another N) add ``-<net>...-n<N>`` to the gram_nets file's name.

Gram peers: (a) the PyTorch tutorial recipe, ``torch.func.vmap(grad)`` per-sample
gradients then ``J J^T``; (b) a per-sample autograd loop (small N only: nothing is
extrapolated); (c) neural-tangents ``empirical_ntk_fn`` (STRUCTURED_DERIVATIVES,
jit-compiled) on the network written in its ``stax``; (d) nngeometry's ``GramMatrix``
(PyTorch hooks). (c) and (d) run in the peers virtualenv made by
``benchmarks/setup_peers.sh`` (JAX needs a NumPy that must not enter the main
environment); without it their rows say "skipped". Both check their K against
skpathkernel's before any timing, and their row fails if it differs.

With ``--threads N`` every case process of the Gram and path groups is pinned to the same
N cores (the first N this process may use): XLA's thread flags alone still let it spread
over a second core.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from benchmarks._serve import Server

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"

# Table groups: a module with ``run(quick) -> list[dict]`` (one row each, ratios measured in
# the same run; ``device=`` passed when its run accepts it) and its section title.
TABLES = {
    "defaults": ("benchmarks.bench_defaults",
                 "Defaults against MLPClassifier() / MLPRegressor() on scikit-learn's data sets"),
    "training": ("benchmarks.bench_training",
                 "Training with path recording versus the same plain torch loop"),
    "peers_training": ("benchmarks.bench_peers_training",
                       "Training: skpathkernel versus plain torch, skorch and MLPRegressor"),
    "decomposition": ("benchmarks.bench_interpolation",
                      "Exact decomposition of 100 queries versus the training time"),
    "explaind": ("benchmarks.bench_explaind",
                 "Exact decomposition: skpathkernel versus ExPLAIND on its circle task"),
    "svm": ("benchmarks.bench_svm",
            "Tangent-feature SVM versus RBF SVC and MLPClassifier"),
    "ood": ("benchmarks.bench_ood",
            "OOD detection at the defaults against the best peer, every split"),
    "long_path": ("benchmarks.bench_long_path",
                  "Long paths: an on-disk trajectory versus the in-memory one"),
    "attribution": ("benchmarks.bench_attribution",
                    "Training-data attribution: LDS against TracIn, TRAK and influence "
                    "functions"),
    "attribute_cost": ("benchmarks.bench_attribute_cost",
                       "attribute against decompose on a 10-class network"),
    "verbs_floor": ("benchmarks.bench_verbs_floor",
                    "The default estimator's decompose / attribute / explain against their "
                    "FLOP floors"),
    "distributed": ("benchmarks.bench_distributed",
                    "Recording a DDP run, and decompose on joblib workers"),
}
GROUPS = ["gram", "gram_nets", "path", *TABLES]

SMALL = [2, 64, 64, 1]
BIG = [64, 512, 512, 1]
DEEP = [64, 512, 512, 512, 1]
# The issue's goal: >= 1.5x faster than neural-tangents at N = 2048 on 64-512x3-1.
GOAL = (DEEP, 2048, 1.5)
LARGE_N = 20000
BUDGET = 2**30  # tangent_gram's default memory_budget
# Issue 18's image and token networks (benchmarks/_nets.py), and its goals at N = 1024:
# speedup over neural-tangents and over the torch.func recipe, float32 agreement, and the
# share of the roofline (full products at GEMM speed over the measured time).
NETS = ("cnn8", "cifar", "transformer", "resnet", "vit")
NET_LABELS = {"cnn8": "(a) CNN conv32-conv64-Linear10 on (n, 1, 8, 8)",
              "cifar": "(b) CNN conv32-pool-conv64-pool-Linear10 on (n, 3, 32, 32)",
              "transformer": "(c) transformer, 2 layers, d 64, on (n, 16) token ids",
              "resnet": "(d) ResNet, stem and 3 residual blocks (16-32-64, BatchNorm in eval "
                        "mode), global average pooling, Linear10, on (n, 3, 32, 32)",
              "vit": "(e) ViT, 4x4 patches, class token and position embedding as raw "
                     "nn.Parameter, 2 pre-norm layers, d 64, Linear10, on (n, 3, 32, 32)"}
# Issue 31's goal: 1.5x the fastest peer of every row, and the roofline ratio >= 0.8.
NET_GOALS = {"cnn8": dict(peers=1.5, rtol=1e-5, roofline=0.8),
             "cifar": dict(peers=1.5, rtol=1e-5, roofline=0.8),
             "transformer": dict(peers=1.5, rtol=1e-5),
             "resnet": dict(peers=1.5, rtol=1e-5, roofline=0.8),
             "vit": dict(peers=1.5, rtol=1e-5)}
# nngeometry 0.4's LayerCollection has rules for Linear, Conv2d, BatchNorm and LayerNorm,
# not for nn.Embedding or nn.MultiheadAttention (whose out_proj is its own Linear
# subclass): it raises on those networks. On several outputs it forms every C x C block
# with C^2 backward passes of the batch, so it is timed on one-output rows (output 0),
# the setting the issue measured it in.
NNG_ARCHS = ("cnn8", "cifar", "resnet")
PEER_KINDS = {"neural_tangents": "nt_gram", "nngeometry": "nng_gram"}


# The two rows of skpathkernel in every Gram problem: the public call (the headline,
# what the peers are compared with) and the private engine under it.
OURS = ("skpathkernel", "skpathkernel_engine")
METHOD_LABELS = {"skpathkernel": "skpathkernel: TangentKernel(net)(X)",
                 "skpathkernel_engine": "engine: tangent_gram (private)"}


def peers_python() -> str | None:
    """The interpreter of the peers venv (JAX, neural-tangents, skorch), if there is one."""
    exe = os.environ.get("SKPATHKERNEL_PEERS_PYTHON") or str(ROOT / ".venv-peers/bin/python")
    return exe if Path(exe).exists() else None


def _plan(quick: bool, device: str, baseline: str | None = None,
          archs: tuple[str, ...] | None = None, net_n: int | None = None):
    """Gram problems (each a list of interleaved specs) and path-kernel cases.

    ``baseline``: a source tree of skpathkernel whose engine runs the MLP Gram rows
    too, interleaved with this one (a regression check across versions). ``archs`` and
    ``net_n``: the networks of the image / token rows and their one N (default: all,
    at the mode's sizes).
    """
    reps = 3 if quick else 5
    peer_reps = 2 if quick else 3
    if quick:
        problems = [
            (SMALL, 1024, ("vmap_grad", "neural_tangents", "nngeometry")),
            (BIG, 512, ("vmap_grad", "nngeometry")),
            (BIG, 1024, ("vmap_grad", "neural_tangents", "nngeometry")),
            (DEEP, 2048, ("neural_tangents", "nngeometry")),  # the goal row
        ]
    else:
        problems = []
        for sizes in (SMALL, BIG, DEEP):
            for n in (512, 1024, 2048, 4096):
                # vmap's J is N x P floats (2.4 GB at N = 2048 on 64-512-512-1) and takes
                # 15-30 s per call on one core there: measured up to N = 1024 only.
                vmap = sizes == SMALL or n <= 1024
                problems.append((sizes, n, ("vmap_grad",) * vmap
                                 + ("neural_tangents", "nngeometry")))
    gram = []
    for sizes, n, peers in problems:
        # The headline row is the public call; the engine's row follows, interleaved.
        group = [dict(kind="gram", method=m, sizes=sizes, n=n, dtype="float32", repeats=reps,
                      roofline=m == "skpathkernel" and sizes != SMALL) for m in OURS]
        if baseline:
            group.append(dict(kind="gram", method="skpathkernel", sizes=sizes, n=n,
                              dtype="float32", repeats=reps, baseline=baseline))
        for peer in peers:
            group.append(dict(kind=PEER_KINDS.get(peer, "gram"), method=peer, sizes=sizes,
                              n=n, dtype="float32", repeats=peer_reps))
        gram.append(group)
    for sizes in (SMALL, BIG):
        gram.append([dict(kind="gram", method=m, sizes=sizes, n=128, dtype="float32",
                          repeats=reps if m in OURS else peer_reps)
                     for m in (*OURS, "autograd_loop")])
    # The memory goal: a Gram on N = 20000 keeps the engine's intermediates under the
    # budget (the engine's call: the public one adds the float64 K it returns).
    gram.append([dict(kind="gram", method="skpathkernel_engine", sizes=SMALL if quick else BIG,
                      n=LARGE_N, dtype="float32", repeats=1, large=True)])
    # Quick: N = 128 on every network, where the slowest peers take tens of seconds per
    # call on one core; the full plan adds N = 1024, the goals' size.
    net_ns = (net_n,) if net_n else (128,) if quick else (256, 1024)
    archs = archs or NETS
    nets = [_net_group(arch, n, "trace", reps) for arch in archs for n in net_ns]
    # One output: the rows where nngeometry is timed (see NNG_ARCHS).
    nets += [_net_group(arch, net_ns[-1], 0, reps) for arch in NNG_ARCHS if arch in archs]
    if not quick and "cnn8" in archs:
        # The memory goal on (a): its intermediates stay under the budget at N = 20000
        # (one output: the ten-output trace takes ~10x the time for the same blocks'
        # structure). Minutes on its own: the full plan only.
        nets.append([dict(kind="gram", method="skpathkernel_engine", arch="cnn8",
                          n=LARGE_N, dtype="float32", repeats=1, large=True, output=0)])
    path = [[dict(kind="path", sizes=SMALL, n=256, T=T, dtype="float32",
                  repeats=1 if T == 1000 else (2 if quick else 3))]
            for T in (10, 100, 1000)]
    # The path kernel of the CNN (a): SGD, and Adam's D on every step kernel.
    path += [[dict(kind="path", arch="cnn8", n=256, T=10, solver=solver, dtype="float32",
                   repeats=2 if quick else 3)] for solver in ("sgd", "adam")]
    # The ResNet (d) and the ViT (e), SGD.
    path += [[dict(kind="path", arch=arch, n=64 if quick else 256, T=10, solver="sgd",
                   dtype="float32", repeats=1 if quick else 2)] for arch in ("resnet", "vit")]
    # The default estimator on digits (issue 35's table): its T is its own training's.
    path += [[dict(kind="path", arch="digits", n=n, T=0, solver=solver, dtype="float32",
                   repeats=1 if quick or n == 1000 else 3)]
             for solver in ("sgd", "adam") for n in (100, 1000)]
    for groups in (gram, nets, path):
        for group in groups:
            for spec in group:
                spec["device"] = device
    return {"gram": gram, "gram_nets": nets, "path": path}


def _net_group(arch, n, output, reps):
    """One interleaved problem of the image / token networks: skpathkernel's two rows and
    the peers; ``output`` "trace" (over the C outputs) or an output's index."""
    one = {} if output == "trace" else {"output": output}
    group = [dict(kind="gram", method=m, arch=arch, n=n, dtype="float32", repeats=reps,
                  roofline=m == "skpathkernel", **one) for m in OURS]
    peers = ("vmap_grad", "neural_tangents") + (("nngeometry",) if output != "trace" else ())
    # Two timed calls per peer: a peer takes minutes per call on some rows at N = 1024.
    group += [dict(kind=PEER_KINDS.get(peer, "gram"), method=peer, arch=arch, n=n,
                   dtype="float32", repeats=2, **one) for peer in peers]
    return group


def _skip_reason(spec):
    if spec["kind"] in ("nt_gram", "nng_gram"):
        if spec["device"] != "cpu":
            return ("the peers venv holds a CPU-only jaxlib and torch; neural-tangents and "
                    "nngeometry are measured on the CPU run")
        if peers_python() is None:
            return "no peers venv (run `bash benchmarks/setup_peers.sh`)"
    return None


def _env(threads):
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    return env


def _failure_cell(exc) -> str:
    """A failed case's message as one table cell: the tail of it (where the exit status
    is), on one line."""
    return "failed: " + " ".join(str(exc)[-500:].split())


def pinned_cores(threads):
    """The cores every case process of a comparison is pinned to: the first ``threads`` of
    this process's own, or None (no pinning) without a thread limit."""
    if not threads or not hasattr(os, "sched_getaffinity"):
        return None
    return sorted(os.sched_getaffinity(0))[:threads]


def start_server(spec, threads):
    """One case process: torch cases under this interpreter, peers under the venv's; all
    pinned to the same cores when the threads are limited."""
    spec = {**spec, "threads": threads}
    if spec["kind"] in ("nt_gram", "nng_gram", "skorch_training"):
        cmd = [peers_python(), "-m", "benchmarks._peers_worker", json.dumps(spec)]
    elif spec.get("baseline"):
        # The baseline tree's own worker and package, first on the path.
        cmd = [sys.executable, "-c", "import runpy, sys; sys.path.insert(0, sys.argv[2]); "
               "runpy.run_module('benchmarks._worker', run_name='__main__')",
               json.dumps(spec), spec["baseline"]]
    else:
        cmd = [sys.executable, "-m", "benchmarks._worker", json.dumps(spec)]
    return Server(cmd, cwd=ROOT, env=_env(threads), cores=pinned_cores(threads))


def _run_group(specs, threads):
    """Set up every case of one problem, then alternate their timed calls."""
    results, servers = [], []
    try:
        for spec in specs:
            reason = _skip_reason(spec)
            if reason:
                results.append({"spec": spec, "skipped": reason})
                continue
            try:
                # Started one at a time: a JIT compilation is timed, and must not share
                # the cores with another case's imports.
                server = start_server(spec, threads)
            except RuntimeError as exc:
                if spec["method"] == "skpathkernel":
                    raise
                results.append({"spec": spec, "skipped": _failure_cell(exc)})
                continue
            res = {"spec": spec, **server.info, "times": []}
            res.pop("ready")
            res["peak_bytes"] = server.ask("mem")["peak_bytes"]
            results.append(res)
            servers.append((server, res))
        for rnd in range(max(s["repeats"] for s in specs)):
            for server, res in servers:
                if rnd < res["spec"]["repeats"]:
                    reply = server.ask("time")
                    res["times"].append(reply["t"])
                    if "cpu" in reply:  # not from a --baseline tree's older worker
                        res.setdefault("cpu_times", []).append(reply["cpu"])
                    for t, cpu in reply.get("probe", ()):
                        res.setdefault("probe_times", []).append(t)
                        res.setdefault("probe_cpu_times", []).append(cpu)
        for server, res in servers:
            res.update(server.close())
    finally:
        for server, _ in servers:
            server.kill()
    return results


def _machine(threads, device):
    import numpy
    import sklearn
    import torch

    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f
                       if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    gpu = ""
    if device.startswith("cuda"):
        gpu = f", GPU {torch.cuda.get_device_name(torch.device(device))}"
    return (f"{cpu}, {os.cpu_count()} logical cores{gpu}, torch {torch.__version__} "
            f"({threads or torch.get_num_threads()} threads), numpy {numpy.__version__}, "
            f"scikit-learn {sklearn.__version__}, Python {platform.python_version()}")


def _stats(times):
    return statistics.median(times), min(times), max(times)


def roofline_ratios(r):
    """A roofline row's rates and ratios, from its GEMM probe timed beside its calls.

    ``cpu``: the probe's FLOPs over its median CPU time, and each bound (FLOPs at that
    rate) over the call's median CPU time: one torch thread, so CPU time is the compute
    time, which the waits for a core shared with other processes do not enter. ``wall``:
    the same by wall time, which counts those waits in both. On CUDA only ``wall``
    (synchronized; the host's CPU time says nothing of the device's work).
    """
    rf = r["roofline"]
    ratios = {}
    pairs = [("wall", "times", "probe_times")]
    if r["spec"].get("device", "cpu") == "cpu":
        pairs.insert(0, ("cpu", "cpu_times", "probe_cpu_times"))
    for kind, call, probe in pairs:
        if not (r.get(call) and r.get(probe)):
            continue
        rate = rf["probe_flops"] / statistics.median(r[probe])
        measured = statistics.median(r[call])
        ratios[kind] = {"rate": rate, "measured": measured,
                        "full": rf["flops"] / rate / measured,
                        "performed": rf["performed_flops"] / rate / measured}
    return ratios


def _roofline_cells(r):
    """The roofline table's cells of one row: the headline ratio (CPU time on the CPU,
    wall time on CUDA), then the wall time's beside it."""
    ratios = roofline_ratios(r)
    head = ratios.get("cpu") or ratios["wall"]
    wall = ratios["wall"]
    cells = [f"{head['rate'] / 1e9:.1f} GFLOP/s", f"{head['measured']:.4g} s",
             f"{head['full']:.2f}", f"{head['performed']:.2f}"]
    if "cpu" in ratios:
        cells += [f"{wall['rate'] / 1e9:.1f} GFLOP/s", f"{wall['measured']:.4g} s",
                  f"{wall['full']:.2f}", f"{wall['performed']:.2f}"]
    else:
        cells += ["(the same: wall time on CUDA)"] + [""] * 3
    return cells


_ROOFLINE_NOTE = (
    "Rate: torch.matmul on an N x width x N product (the Gram's GEMM shape) into one "
    "preallocated result, the *probe*, timed in the row's own process just before and just "
    "after each of its timed calls (so 2 probes per repeat, under the same conditions as "
    "the calls). On the CPU, with one torch thread, the headline ratio is by CPU time "
    "(`time.process_time`: the compute time, without the waits for a core that other "
    "processes share): rate = the probe's FLOPs / its median CPU time, bound = FLOPs / "
    "rate, ratio = bound / the call's median CPU time (1 = at roofline). The wall-time "
    "ratio beside it is the same with wall times for both; on a contended core it mixes "
    "in the waits. On CUDA both are wall times with synchronization. Before 2026-12-06 "
    "the ratio was the call's median wall time against the least wall time of 5 probes "
    "timed after all repeats, which on shared cores read far too low "
    "(`gram-quick-s44.md`).")

_ROOFLINE_HEADER = ("| rate (CPU) | measured (CPU) | ratio (full products, CPU) | "
                    "ratio (performed, CPU) | rate (wall) | measured (wall) | "
                    "ratio (full products, wall) | ratio (performed, wall) |")


_EXECUTED_NOTE = (
    "GFLOP executed: what the call runs, counted on one more call after the timed ones "
    "(`benchmarks/_flops.py`: torch's FlopCounterMode, GEMMs, convolutions and attention, "
    "with SciPy's SYRKs, CPU attention and grouped convolutions' weight gradients added by "
    "hand; element-wise work counts none): the forward and backward passes, forming the "
    "gradient blocks and the products performed. Executed-work efficiency = executed FLOPs "
    "/ (the call's median CPU time x the probe's CPU rate): how close the work the call "
    "does runs to GEMM speed, beside the roofline ratio, which counts only the full "
    "products and is not redefined by it.")


def _executed_cells(r):
    """The executed FLOPs of a row and their efficiency at its probe's rate (by CPU time
    on the CPU, wall time on CUDA), or dashes where they were not counted."""
    executed = r["roofline"].get("executed_flops")
    if executed is None:
        return ["-", "-"]
    ratios = roofline_ratios(r)
    head = ratios.get("cpu") or ratios["wall"]
    return [f"{executed / 1e9:.2f}", f"{executed / head['rate'] / head['measured']:.2f}"]


def _fmt_t(times):
    med, lo, hi = _stats(times)
    return f"{med:.4g} s ({lo:.3g}-{hi:.3g}, n={len(times)})"


def _mib(b):
    return f"{b / 2**20:.1f} MiB"


def _arch(sizes):
    return "-".join(map(str, sizes)) + " tanh"


def _label(spec):
    """The network of a case: an MLP's sizes, or the image / token network's name (and
    the output, when one output's Gram is timed)."""
    if not spec.get("arch"):
        return _arch(spec["sizes"])
    one = spec.get("output", "trace")
    return spec["arch"] + ("" if one == "trace" or spec.get("large") else f", output {one}")


def _method(spec):
    if spec.get("baseline"):
        # The baseline tree's own worker decides what its "skpathkernel" times (the
        # engine, in trees from before the public-call rows).
        return f"{spec['method']} of the baseline tree {spec['baseline']}"
    return METHOD_LABELS.get(spec["method"], spec["method"])


def _table(rows):
    if not rows:
        return ["(no rows)"]
    # Every row's columns, in first-seen order: rows of one table may measure different
    # things (cells a row lacks stay empty). Keys starting with "_" (raw numbers) go to
    # the .json only.
    keys = list(dict.fromkeys(k for r in rows for k in r if not k.startswith("_")))
    return (["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
            + ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rows])


_GRAM_NOTE = (
    "skpathkernel's headline row is the call users make, `TangentKernel(net)(X)` on a NumPy "
    "X, returning K as float64 NumPy, with `net` the module at its parameters as a "
    "one-point recorded path (`PathRecorder(module, optimizer).as_estimator()`, no "
    "training); the engine row times the private `tangent_gram` under it (float32 tensors "
    "in and out). Speedup of skpathkernel = the row's median / the public call's median, "
    "all rows of a problem measured interleaved in this run. Rel. diff = max |K - K_engine| "
    "/ max |K_engine| (float32 results compared in float64).")

_PEERS_NOTE = (
    "neural-tangents: `empirical_ntk_fn(f, trace_axes=(-1,), vmap_axes=0, "
    "implementation=STRUCTURED_DERIVATIVES)` under `jax.jit` (compilation reported apart), "
    "the network written in its `stax` as its documentation writes networks (`serial`, "
    "`Dense` and `Conv` in the standard parameterization on NHWC images, `Relu`, "
    "`FanOut`/`parallel`/`FanInSum` residuals, `GlobalAvgPool`, `LayerNorm`, "
    "`GlobalSelfAttention` with its scales set to torch's, `Index` for the class token's "
    "readout, one-hot tokens into a bias-free `Dense` for the token embedding), the torch "
    "weights copied in; a few custom layers where stax has none (max pooling, eval-mode "
    "BatchNorm, LayerNorm's gain and bias, the constant channel that carries the "
    "attention's query / key / value biases, the added position embeddings, the class "
    "token; see benchmarks/_peers_worker.py). "
    "nngeometry: `GramMatrix(model, loader)` on one batch of all N, its `(C, N, C, N)` "
    "result traced over the outputs; it has no rule for nn.Embedding or "
    "nn.MultiheadAttention, and takes C^2 backward passes on C outputs, so it runs on the "
    "one-output rows (`output 0`: the Gram of the first output alone, every method). "
    "Every peer's K is checked against skpathkernel's before its timings (max relative "
    "difference <= 1e-5, or the row fails; past it, both Ks are recomputed in float64 on "
    "the 64 samples whose rows differ most, and the row fails unless they agree to "
    "1e-10: the float32 difference is then a sample within float32 rounding of a ReLU or "
    "max-pool kink, whose side the two frameworks' float32 forwards choose differently). "
    "All processes of a problem are pinned to the same core(s). Time: wall time of the "
    "call; CPU: the process's CPU time of the same calls, which excludes the waits for a "
    "core that other processes share.")

_GRAM_HEADER = ["| network | N | P | method | time | peak memory | speedup of skpathkernel | "
                "rel. diff | speedup incl. compile |", "|---|---|---|---|---|---|---|---|---|"]


def _group_rows(group):
    """Table rows of one interleaved Gram problem: skpathkernel first, then the others."""
    mine = group[0]
    assert mine["spec"]["method"] == "skpathkernel"
    ours = _stats(mine["times"])[0]
    lines = []
    for r in group:
        s = r["spec"]
        head = f"| {_label(s)} | {s['n']} | {r.get('n_params', '-')} | {_method(s)}"
        if "skipped" in r:
            lines.append(f"{head} | skipped: {r['skipped']} | | | | |")
            continue
        med = _stats(r["times"])[0]
        speed = "1 (itself)" if r is mine else f"{med / ours:.2f}x" + _cpu_ratio(r, mine)
        diff = f"{r['rel_diff_vs_skpathkernel']:.1e}" if "rel_diff_vs_skpathkernel" in r \
            else "-"
        if "float64_recheck" in r:
            rc = r["float64_recheck"]
            diff += (f" (float64 on the {rc['n']} samples differing most: "
                     f"{rc['rel_diff']:.1e}; kink samples {rc['samples']})")
        incl = "-"
        if "compile_s" in r:
            head += f" (compile {r['compile_s']:.2f} s)"
            incl = f"{(med + r['compile_s']) / ours:.2f}x"
        cpu = f"; CPU {_stats(r['cpu_times'])[0]:.4g} s" if r.get("cpu_times") else ""
        lines.append(f"{head} | {_fmt_t(r['times'])}{cpu} | {_mib(r['peak_bytes'])} | "
                     f"{speed} | {diff} | {incl} |")
    return lines


def _gram_lines(results, device):
    lines = [f"## Tangent-kernel Gram K(X, X), float32, {device}", "",
             _GRAM_NOTE + " " + _PEERS_NOTE + " The jit compilation (one per shape) is "
             "excluded from neural-tangents' time; the last column adds it back.", "",
             *_GRAM_HEADER]
    goal = None
    versions = None
    large = [g[0] for g in results["gram"] if g[0]["spec"].get("large")]
    for group in results["gram"]:
        mine = group[0]
        if mine["spec"].get("large"):
            continue
        lines += _group_rows(group)
        for r in group[1:]:
            s = r["spec"]
            if "compile_s" in r and "times" in r:
                versions = r.get("versions")
                if s["sizes"] == GOAL[0] and s["n"] == GOAL[1]:
                    med = _stats(r["times"])[0]
                    goal = (med / _stats(mine["times"])[0], _stats(r["times"]),
                            _stats(mine["times"]))
    lines += _overhead_lines(results["gram"])
    if versions:
        lines += ["", f"Peer versions (peers venv): {versions}, XLA on the CPU with the same "
                  "thread limit as torch."]
    fastest = [f"- {_arch(g[0]['spec']['sizes'])}, N = {g[0]['spec']['n']}: "
               + _peers_goal(g, 1.5) for g in results["gram"]
               if not g[0]["spec"].get("large") and g[0]["spec"]["n"] == 1024]
    if fastest:
        lines += ["", "**Goal** (issue 31: at least 1.5x the fastest of neural-tangents, "
                  "nngeometry and torch.func at N = 1024):", "", *fastest]
    if goal:
        ratio, (nm, nlo, nhi), (om, olo, ohi) = goal
        met = "met" if ratio >= GOAL[2] else "NOT met"
        lines += ["", f"**Goal** (>= {GOAL[2]}x faster than neural-tangents at N = {GOAL[1]} "
                  f"on {_arch(GOAL[0])}): {ratio:.2f}x, {met}. neural-tangents "
                  f"{nm:.3f} s ({nlo:.3f}-{nhi:.3f}), skpathkernel {om:.3f} s "
                  f"({olo:.3f}-{ohi:.3f}); ratio of the best runs {nlo / olo:.2f}x."]
    if large:
        lines += ["", f"## Memory of a Gram on N = {LARGE_N}", "",
                  "The engine's call (`tangent_gram`; the public call returns K as float64 "
                  "besides). The returned K (N^2 float32) is the caller's; the budget "
                  f"(memory_budget, default {BUDGET / 2**30:.0f} GiB) bounds everything else.",
                  "", "| network | N | time | peak memory of the call | K itself | "
                  "peak - K | budget | under budget |", "|---|---|---|---|---|---|---|---|"]
        for r in large:
            s = r["spec"]
            k_bytes = 4 * s["n"] ** 2
            extra = r["peak_bytes"] - k_bytes
            lines.append(f"| {_arch(s['sizes'])} | {s['n']} | {_fmt_t(r['times'])} | "
                         f"{_mib(r['peak_bytes'])} | {_mib(k_bytes)} | {_mib(extra)} | "
                         f"{_mib(BUDGET)} | {'yes' if extra <= BUDGET else 'NO'} |")
    lines += ["", "## GEMM roofline of the structured Gram", "",
              "Bounds are FLOPs divided by the measured torch.matmul rate: the time at GEMM "
              "speed. *Full products*: every factor product "
              "(A A^T and Delta Delta^T per Linear layer, plus the Hadamard products) in "
              "full, the issue's definition; the engine beats it by skipping the panels "
              "below the diagonal of the symmetric K(X, X). *Performed*: what the engine "
              "actually computes, the upper panels' products plus the forward and backward "
              "passes that produce the factors. " + _ROOFLINE_NOTE, "",
              "| network | N | GFLOP full products | GFLOP performed | width " + _ROOFLINE_HEADER,
              "|---|---|---|---|---|" + "---|" * 8]
    for group in results["gram"]:
        for r in group:
            if "roofline" in r:
                rf, s = r["roofline"], r["spec"]
                lines.append(f"| {_arch(s['sizes'])} | {s['n']} | {rf['flops'] / 1e9:.3f} | "
                             f"{rf['performed_flops'] / 1e9:.3f} | {rf['probe_width']} | "
                             + " | ".join(_roofline_cells(r)) + " |")
    return lines


def _nets_lines(groups, device):
    """The image / token Gram rows: peers, goals, roofline, and the large-N memory row."""
    lines = ["", f"## Tangent-kernel Gram on image and token networks, float32, {device}", "",
             "The networks of issues 18 and 31 (benchmarks/_nets.py): "
             + "; ".join(f"{k}: {v}" for k, v in NET_LABELS.items())
             + ". Trace over the outputs (divided by C, as neural-tangents' trace_axes). "
             "torch.func: the tutorial recipes, vmap(jacrev) per-sample Jacobians (vmap(grad) "
             "for one output) then J J^T. " + _PEERS_NOTE + " " + _GRAM_NOTE, "",
             *_GRAM_HEADER]
    goals, roof, large = [], [], []
    for group in groups:
        mine = group[0]
        if mine["spec"].get("large"):
            large.append(mine)
            continue
        lines += _group_rows(group)
        ours = _stats(mine["times"])[0]
        ratios = {r["spec"]["method"]: (_stats(r["times"])[0] / ours,
                                        r.get("rel_diff_vs_skpathkernel"), r["peak_bytes"])
                  for r in group[1:] if "times" in r}
        if "roofline" in mine:
            rf = mine["roofline"]
            roof.append(f"| {_label(mine['spec'])} | {mine['spec']['n']} | "
                        f"{rf['flops'] / 1e9:.2f} | {rf['performed_flops'] / 1e9:.2f} | "
                        f"{rf['width']} | {rf['probe_width']} | "
                        + " | ".join(_roofline_cells(mine) + _executed_cells(mine)) + " |")
        arch, n = mine["spec"]["arch"], mine["spec"]["n"]
        if arch in NET_GOALS:
            goals.append(_net_goal(f"{_label(mine['spec'])}, N = {n}", NET_GOALS[arch],
                                   group, ratios, mine))
    lines += _overhead_lines(groups)
    lines += ["", "**Goals** (issue 31: every row at least 1.5x the fastest of "
              "neural-tangents, nngeometry and torch.func, at N = 1024 in the full run; the "
              "same K to float32 precision; the roofline ratio beside it, goal >= 0.8):",
              ""] + goals
    lines += ["", "### GEMM roofline of the structured Gram on these networks", "",
              "Full products: every term's Gram products in full, the issue's floor "
              "(gradient blocks 2 N^2 C p q for a convolution, rank-one 2 N^2 (q + C p) for "
              "the dense head; C = 1 on the one-output rows); performed: the share of them "
              "the symmetric panels compute (the upper triangle for the gradient blocks' "
              "rows where a BLAS SYRK takes them: on the CPU with one torch thread, its "
              "buffers within an eighth of the budget, the Gram assumed one block of all "
              "N rows, or one per output group) plus "
              "forming the blocks (2 N S C p q), forward "
              "and backward passes not counted. Width: the widest block row; the probe's "
              "is capped at 65536. " + _ROOFLINE_NOTE
              + " Ratio > 1: faster than full products, by the symmetry. " + _EXECUTED_NOTE,
              "", "| network | N | GFLOP full products | GFLOP performed | width | probe width "
              + _ROOFLINE_HEADER + " GFLOP executed | executed-work efficiency (CPU) |",
              "|---|---|---|---|---|---|" + "---|" * 10] + roof
    if large:
        lines += ["", f"### Memory of a Gram on N = {LARGE_N}", "",
                  "The engine's call (`tangent_gram`; the public call returns K as float64 "
                  "besides). The returned K (N^2 float32) is the caller's; the budget bounds "
                  "the rest.",
                  "", "| network | N | output | time | peak memory of the call | K itself | "
                  "peak - K | budget | under budget |", "|---|---|---|---|---|---|---|---|---|"]
        for r in large:
            s = r["spec"]
            extra = r["peak_bytes"] - 4 * s["n"] ** 2
            lines.append(f"| {s['arch']} | {s['n']} | {s.get('output', 'trace')} | "
                         f"{_fmt_t(r['times'])} | {_mib(r['peak_bytes'])} | "
                         f"{_mib(4 * s['n'] ** 2)} | {_mib(extra)} | {_mib(BUDGET)} | "
                         f"{'yes' if extra <= BUDGET else 'NO'} |")
    return lines


def _ratio_cell(a, b):
    """Per-round ratios of two interleaved rows' times: median (min-max)."""
    ratios = [x / y for x, y in zip(a["times"], b["times"])]
    return f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"


def _overhead_lines(groups):
    """What the public call costs over the engine (and over a --baseline tree's call),
    from their interleaved repeats."""
    rows = []
    for group in groups:
        by = {r["spec"]["method"]: r for r in group
              if "times" in r and not r["spec"].get("baseline")}
        base = next((r for r in group if "times" in r and r["spec"].get("baseline")), None)
        if set(OURS) <= set(by):
            rows.append((by[OURS[0]], by[OURS[1]], base))
    with_base = any(base for *_, base in rows)
    lines = ["", "### Public call over the engine", "",
             "Time of `TangentKernel(net)(X)` (NumPy in, float64 NumPy out) over the private "
             "`tangent_gram` (float32 tensors in and out) it calls, per round of the "
             "interleaved repeats: median (min-max). 1.00 = no overhead."
             + (" The baseline columns divide by the time of the --baseline tree's call, "
                "interleaved in the same rounds." if with_base else ""), "",
             "| network | N | public / engine |" + (" public / baseline | engine / baseline |"
                                                   if with_base else ""),
             "|---|---|---|" + ("---|---|" if with_base else "")]
    for public, engine, base in rows:
        s = public["spec"]
        cells = [_label(s), str(s["n"]), _ratio_cell(public, engine)]
        if with_base:
            cells += ([_ratio_cell(public, base), _ratio_cell(engine, base)] if base
                      else ["-", "-"])
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _cpu_ratio(r, mine):
    """`` (CPU 1.23x)``: the medians' ratio of the process CPU times, or "" without them.
    On cores other processes share, the wall time of a pinned case includes its waits for
    the core; its CPU time does not."""
    if not (r.get("cpu_times") and mine.get("cpu_times")):
        return ""
    return f" (CPU {_stats(r['cpu_times'])[0] / _stats(mine['cpu_times'])[0]:.2f}x)"


def _fastest_peer(group):
    """The fastest peer of an interleaved problem that ran (the baseline tree and
    skpathkernel's own rows are not peers): ``(method, its median / ours)`` or None."""
    ours = _stats(group[0]["times"])[0]
    peers = [(_stats(r["times"])[0] / ours, r["spec"]["method"]) for r in group
             if "times" in r and r["spec"]["method"] not in OURS
             and not r["spec"].get("baseline")]
    return min(peers)[::-1] if peers else None


def _peers_goal(group, target):
    """The issue's goal on one problem: at least ``target`` times the fastest peer."""
    fastest = _fastest_peer(group)
    if fastest is None:
        return "no peer ran"
    peer, ratio = fastest
    row = next(r for r in group if r["spec"]["method"] == peer)
    return (f">= {target}x the fastest peer ({peer}): {ratio:.2f}x"
            f"{_cpu_ratio(row, group[0])}, {'met' if ratio >= target else 'NOT met'}")


def _net_goal(label, goal, group, ratios, mine):
    """One goal line: each target with its measured value, met or NOT met."""
    parts = [_peers_goal(group, goal["peers"])]
    diffs = [d for _, d, _ in ratios.values() if d is not None]
    if diffs:
        worst = max(diffs)
        text = (f"agreement <= {goal['rtol']:.0e}: {worst:.1e}, "
                f"{'met' if worst <= goal['rtol'] else 'NOT met'}")
        for r in group[1:]:
            if "float64_recheck" in r:
                rc = r["float64_recheck"]
                text += (f" ({r['spec']['method']}'s float32 K differs at the samples "
                         f"{rc['samples']}, within float32 rounding of a kink; in float64 "
                         f"on the {rc['n']} samples differing most: {rc['rel_diff']:.1e})")
        parts.append(text)
    if "roofline" in goal and "roofline" in mine:
        ratios = roofline_ratios(mine)
        kind = "cpu" if "cpu" in ratios else "wall"
        share = ratios[kind]["full"]
        wall = (f" (wall time {ratios['wall']['full']:.2f})" if kind == "cpu" else
                " (wall time)")
        parts.append(f"roofline ratio (full products) >= {goal['roofline']:.2f}: "
                     f"{share:.2f}{wall}, {'met' if share >= goal['roofline'] else 'NOT met'}")
    if "vmap_grad" in ratios:
        parts.append(f"peak memory {_mib(mine['peak_bytes'])} against torch.func's "
                     f"{_mib(ratios['vmap_grad'][2])}")
    return f"- {label}: " + "; ".join(parts) + "."


TITLES = {"gram": "Tangent-kernel Gram K(X, X) of MLPs against its peers",
          "gram_nets": "Tangent-kernel Gram of image and token networks against its peers",
          "path": "Path kernel K(X, X) over T recorded steps",
          **{name: title for name, (_, title) in TABLES.items()}}


def results_stem(group: str, quick: bool, device: str) -> str:
    """The file name of a group's results, without .md / .json: one per (group, mode,
    device), so that a rerun replaces its file and nothing else."""
    return (group + ("-quick" if quick else "")
            + ("" if device == "cpu" else "-" + device.replace(":", "")))


ENV_READ = ("SKPATHKERNEL_PEERS_PYTHON", "SKPATHKERNEL_OOD_PEERS_PYTHON",
            "SKPATHKERNEL_BENCH_DEVICE", "SKPATHKERNEL_BENCH_ATTRIBUTION",
            "SKPATHKERNEL_BENCH_ATTRIBUTION_SETTINGS",
            "SKPATHKERNEL_BENCH_ESTIMATORS", "SKPATHKERNEL_BENCH_MEMORY_BUDGET",
            "OMP_NUM_THREADS",
            "MKL_NUM_THREADS")


def _git(*cmd):
    import subprocess

    try:
        return subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def _provenance(args, command, machine):
    """Where a run's numbers come from; read once, before any results file is written."""
    commit = _git("rev-parse", "--short=10", "HEAD")
    changed = _git("status", "--porcelain", "--untracked-files=no")
    # The environment variables the benchmarks read, where set.
    env = " ".join(f"{k}={os.environ[k]}" for k in ENV_READ if k in os.environ)
    return {"mode": "quick" if args.quick else "full", "command": command, "env": env,
            "commit": commit or "unknown (not a git checkout)",
            "dirty": None if changed is None else bool(changed),
            "machine": machine, "device": args.device,
            "threads": (f"{args.threads} per case (--threads {args.threads}), the Gram and "
                        f"path cases pinned to core(s) {pinned_cores(args.threads)}"
                        if args.threads else "the libraries' default per case")}


def _provenance_lines(prov):
    dirty = {None: "unknown", True: "yes, uncommitted changes to tracked files",
             False: "no"}[prov["dirty"]]
    load = prov["loadavg"]
    return ["Provenance, written by the run:", "",
            f"- Mode: {prov['mode']}",
            f"- Command: `{prov['command']}`"
            + (f", with `{prov['env']}` in the environment" if prov["env"] else ""),
            f"- Commit: {prov['commit']} (tree dirty: {dirty})",
            f"- Date: {prov['date']}; this group's wall time {prov['elapsed_s']:.0f} s",
            f"- Machine: {prov['machine']}",
            f"- Load average (1 min) before / after this group: {load[0]:.2f} / "
            f"{load[1]:.2f} (cores shared with other processes add noise; the min column is "
            "the least disturbed repeat)",
            f"- Threads: {prov['threads']}; device {prov['device']}"]


def _report(group, result, args, prov):
    """A group's results file: provenance first, then its tables."""
    lines = [f"# {TITLES[group]}", "", *_provenance_lines(prov), ""]
    if args.threads == 1:
        lines += ["With `--threads 1` every method runs on one core: on cores shared with "
                  "other processes, torch's OpenMP threads stall whenever the other core is "
                  "busy, which made two-thread medians vary 5-10x between runs of the same "
                  "case.", ""]
    if group in ("gram", "gram_nets", "path"):
        probe = ("torch.cuda.max_memory_allocated above the allocation at entry" if
                 args.device != "cpu" else "the peak extra resident memory of that call, "
                 "sampled every millisecond, in a fresh process per case")
        lines += ["Times are the median (min-max, number of repeats) of separate calls, "
                  f"after a first call that measures the peak memory (and warms up): {probe}.",
                  ""]
    if group == "gram":
        lines += _gram_lines({"gram": result}, args.device)
    elif group == "gram_nets":
        lines += _nets_lines(result, args.device)
    elif group == "path":
        lines += [f"## Path kernel K(X, X) over T recorded steps (full batch), "
                  f"float32, {args.device}", "",
                  "SGD unless the network names its solver; the CNN is (a) of the image "
                  "Gram section, 10 outputs (trace), on (n, 1, 8, 8) inputs.", "",
                  "Memory must not grow with T: step Grams are accumulated one at a time "
                  "(the trajectory itself, stored before the call, is listed separately).", "",
                  "| network | N | T | time | time / step | peak memory of the call | "
                  "trajectory size |", "|---|---|---|---|---|---|---|"]
        floors = []
        for (r,) in result:
            s = r["spec"]
            med = _stats(r["times"])[0]
            T = s["T"] or r["n_points"] - 1
            net = _label(s) + (f", {s['solver']}" if s.get("solver") else "")
            lines.append(f"| {net} | {s['n']} | {T} | "
                         f"{_fmt_t(r['times'])} | {med / T * 1e3:.2f} ms | "
                         f"{_mib(r['peak_bytes'])} | {_mib(r['trajectory_bytes'])} |")
            if "floor_s" in r:
                floors.append(f"| {net} | {s['n']} | {T} | {r['floor_flops'] / 1e9:.1f} | "
                              f"{r['matmul_flops_per_s'] / 1e9:.0f} | {r['floor_s']:.3g} s | "
                              f"{med / r['floor_s']:.2f} |")
        if floors:
            lines += ["", "### The default estimator on digits against its FLOP floor", "",
                      "`PathKernelClassifier(random_state=0)` (Adam) or `solver=\"sgd\", "
                      "learning_rate_init=0.1` on 1000 standardised digits (P = 8970, ten "
                      "outputs), `path_kernel_(X[:N])`. Floor per point and layer "
                      "(`_tangent/_stacked.py`, `path_flops`): SGD `2 N^2 (q + C p)`, "
                      "Adam `2 N^2 p (q + C)` (the units route), `q = d_in + 1`, `p = d_out`, "
                      "halved by the Gram's symmetry, at torch.matmul's rate on an "
                      "N x 64 x N product.", "",
                      "| network | N | points | floor GFLOP | GEMM GFLOP/s | floor time | "
                      "time / floor |", "|---|---|---|---|---|---|---|", *floors]
    else:
        module = importlib.import_module(TABLES[group][0])
        lines += [f"From `{TABLES[group][0].replace('.', '/')}.py`. "
                  + " ".join((module.__doc__ or "").split("\n\n")[0].split()), ""]
        lines += _table(result)
        # Further tables of the same run (a module's EXTRA_TABLES: title, text, rows).
        for title, text, rows in getattr(module, "EXTRA_TABLES", []):
            lines += ["", f"## {title}", "", text, "", *_table(rows)]
        if getattr(module, "NOTES", None):
            lines += ["", module.NOTES]
    return "\n".join(lines) + "\n"


def _run_table(name, args):
    """One table group: its module's ``run``, under the run's thread limits."""
    import torch
    from threadpoolctl import threadpool_limits

    if args.threads:
        torch.set_num_threads(args.threads)
    run = importlib.import_module(TABLES[name][0]).run
    kwargs = {"quick": args.quick}
    if "device" in inspect.signature(run).parameters:
        kwargs["device"] = args.device
    if "threads" in inspect.signature(run).parameters:
        kwargs["threads"] = args.threads
    # numpy's BLAS pool too (MLPRegressor, SVC): the same stalls as torch's threads.
    with threadpool_limits(args.threads):
        return run(**kwargs)


def _run_cases(name, plan, threads):
    """A Gram or path group: its problems, each set of cases interleaved in processes."""
    result = []
    for specs in plan[name]:
        rows = _run_group(specs, threads)
        for r in rows:
            s = r["spec"]
            what = (f"skipped ({r['skipped'][:80]})" if "skipped" in r else
                    f"{_stats(r['times'])[0]:.4g} s, {_mib(r['peak_bytes'])}")
            print(f"{name}: {_method(s) if 'method' in s else ''} {_label(s)} n={s['n']} "
                  f"{'T=' + str(s['T']) if 'T' in s else ''}: {what}", flush=True)
        result.append(rows)
    return result


def _groups(text):
    names = [g.strip() for g in text.split(",") if g.strip()]
    unknown = sorted(set(names) - set(GROUPS))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown group(s) {unknown}; choose from {GROUPS}")
    return names


def _net_item(item):
    """``(arch, output, n)`` of a ``--nets`` item ``ARCH``, ``ARCH@N`` or
    ``ARCH/OUTPUT@N`` (``output`` "trace" and ``n`` None where not given), None if bad."""
    head, _, n = item.partition("@")
    arch, _, output = head.partition("/")
    if arch not in NETS or "@" in item and not n.isdigit() or output and not output.isdigit():
        return None
    return arch, int(output) if output else "trace", int(n) if n else None


def _nets_arg(text):
    items = tuple(a.strip() for a in text.split(",") if a.strip())
    bad = [item for item in items if _net_item(item) is None]
    if bad or not items:
        raise argparse.ArgumentTypeError(
            f"unknown network(s) or bad item(s) {bad}: ARCH, ARCH@N or ARCH/OUTPUT@N, "
            f"ARCH of {NETS}")
    return items


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer cases and repeats")
    parser.add_argument("--out", default=str(RESULTS),
                        help="folder of the results files: one per group, "
                             "<group>[-quick][-<device>].md with its .json, replaced by a "
                             "rerun of the same group, mode and device")
    parser.add_argument("--only", type=_groups, default=None,
                        help=f"comma-separated groups to run, of {', '.join(GROUPS)}")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch / XLA threads per case (default: the libraries' own "
                             "choice); 1 keeps cores shared with other processes from "
                             "stalling parallel ops")
    parser.add_argument("--peers", default=None,
                        help="comma-separated peers the Gram groups keep (vmap_grad, "
                             "neural_tangents, nngeometry, autograd_loop), or 'none': "
                             "skpathkernel (and "
                             "--baseline) only; default: all")
    parser.add_argument("--baseline", default=None,
                        help="a source tree of skpathkernel (e.g. a checkout of main) whose "
                             "engine also runs the MLP Gram rows, interleaved: a regression "
                             "check")
    parser.add_argument("--nets", type=_nets_arg, default=None,
                        help=f"comma-separated gram_nets problems to run instead of the "
                             f"plan's: ARCH (its rows at --net-n), ARCH@N (the trace) or "
                             f"ARCH/OUTPUT@N (one output, e.g. resnet/0@1024), ARCH of "
                             f"{', '.join(NETS)}; the results file is then named apart")
    parser.add_argument("--net-n", type=int, default=None,
                        help="the one N of the gram_nets rows (default: 128 with --quick, "
                             "256 and 1024 without); the results file is then named apart")
    parser.add_argument("--device", default=os.environ.get("SKPATHKERNEL_BENCH_DEVICE", "cpu"),
                        help="torch device of the skpathkernel / torch cases: cpu or cuda "
                             "(peers that cannot run there are skipped and say so)")
    args = parser.parse_args(argv)
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: torch sees no CUDA device here")
    groups = args.only or GROUPS
    plain = tuple(item for item in args.nets or () if "@" not in item and "/" not in item)
    plan = _plan(args.quick, args.device, args.baseline, plain or None, args.net_n)
    explicit = [_net_item(item) for item in args.nets or () if item not in plain]
    if explicit:
        # Problems named one by one (e.g. the goals' N = 1024 rows, one at a time).
        default_n = args.net_n or (128 if args.quick else 1024)
        extra = [_net_group(arch, n or default_n, output, 3 if args.quick else 5)
                 for arch, output, n in explicit]
        for group in extra:
            for spec in group:
                spec["device"] = args.device
        plan["gram_nets"] = (plan["gram_nets"] if plain else []) + extra
    if args.peers is not None:
        keep = {*OURS, *args.peers.split(",")}
        for name in ("gram", "gram_nets"):
            plan[name] = [[s for s in group if s["method"] in keep] for group in plan[name]]
    machine = _machine(args.threads, args.device)
    command = " ".join(["python -m benchmarks", *(argv if argv is not None else sys.argv[1:])])
    prov = _provenance(args, command, machine)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for group in groups:
        load = [os.getloadavg()[0]]
        date = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        start = time.perf_counter()
        result = (_run_cases(group, plan, args.threads) if group in plan
                  else _run_table(group, args))
        elapsed = time.perf_counter() - start
        load.append(os.getloadavg()[0])
        print(f"{group}: done in {elapsed:.0f} s", flush=True)
        # Each group's file is written as soon as it is measured: a later group that
        # fails leaves the earlier ones' files in place.
        prov_group = {**prov, "date": date, "elapsed_s": elapsed, "loadavg": load}
        module = importlib.import_module(TABLES[group][0]) if group in TABLES else None
        # A table module may name its run's file apart (a run on part of its cases).
        suffix = module.results_suffix(args.quick) if hasattr(module, "results_suffix") \
            else ""
        if group == "gram_nets":
            # A run on part of the networks or at another N leaves the whole group's file.
            suffix += "".join("-" + item.replace("/", "-o").replace("@", "-")
                              for item in args.nets or ())
            suffix += f"-n{args.net_n}" if args.net_n else ""
        stem = out / (results_stem(group, args.quick, args.device) + suffix)
        extra = [{"title": title, "text": text, "rows": rows}
                 for title, text, rows in getattr(module, "EXTRA_TABLES", [])]
        stem.with_suffix(".json").write_text(json.dumps(
            {"group": group, "provenance": prov_group, "quick": args.quick,
             "device": args.device, "results": result,
             **({"extra_tables": extra} if extra else {})}, indent=1) + "\n")
        stem.with_suffix(".md").write_text(_report(group, result, args, prov_group))
        print(f"wrote {stem}.md", flush=True)


if __name__ == "__main__":
    main()
