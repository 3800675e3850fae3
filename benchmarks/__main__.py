"""``python -m benchmarks [--quick] [--out DIR] [--only NAME]``: Gram, path kernel, roofline.

Every case runs in its own process (:mod:`benchmarks._worker`) and reports the median,
min and max of its repeats and its peak extra resident memory. Results go to
``DIR/results.md`` (tables, with the machine line) and ``DIR/results.json`` (raw numbers).

Peers: (a) the PyTorch tutorial recipe, ``torch.func.vmap(grad)`` per-sample gradients
then ``J J^T``; (b) a per-sample autograd loop (small N only: nothing is extrapolated).
JAX / neural-tangents is a pending peer (not installed in this environment).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

# Table groups: a module with ``run(quick) -> list[dict]`` (one row each, ratios measured in
# the same run) and the title of its section in results.md.
TABLES = {
    "training": ("benchmarks.bench_training",
                 "Training with path recording versus the same plain torch loop"),
    "decomposition": ("benchmarks.bench_interpolation",
                      "Exact decomposition of 100 queries versus the training time"),
}

BIG = [64, 512, 512, 1]
SMALL = [2, 64, 64, 1]


def _plan(quick: bool):
    reps = 3 if quick else 5
    peer_reps = 2 if quick else 3
    gram = []
    sizes_n = [(SMALL, 1024), (BIG, 1024)] + ([] if quick else [(BIG, 256), (BIG, 2048)])
    for sizes, n in sizes_n:
        gram.append(dict(kind="gram", method="skpathkernel", sizes=sizes, n=n, dtype="float32",
                         repeats=reps, roofline=sizes == BIG))
        gram.append(dict(kind="gram", method="vmap_grad", sizes=sizes, n=n, dtype="float32",
                         repeats=peer_reps))
    for sizes in (SMALL, BIG):
        for method in ("skpathkernel", "autograd_loop"):
            gram.append(dict(kind="gram", method=method, sizes=sizes, n=128, dtype="float32",
                             repeats=peer_reps if method != "skpathkernel" else reps))
    path = [dict(kind="path", sizes=[2, 64, 64, 1], n=256, T=T, dtype="float32",
                 repeats=1 if T == 1000 else (2 if quick else 3))
            for T in (10, 100, 1000)]
    return {"gram": gram, "path": path}


def _run(spec, root, threads):
    cmd = [sys.executable, "-m", "benchmarks._worker", json.dumps(spec)]
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(threads)
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, check=False,
                          env=env)
    if proc.returncode:
        raise RuntimeError(f"benchmark case {spec} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _machine(threads):
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
    return (f"{cpu}, {os.cpu_count()} logical cores, torch {torch.__version__} "
            f"({threads or torch.get_num_threads()} threads), numpy {numpy.__version__}, "
            f"scikit-learn {sklearn.__version__}, Python {platform.python_version()}")


def _stats(times):
    return statistics.median(times), min(times), max(times)


def _fmt_t(times):
    med, lo, hi = _stats(times)
    return f"{med:.4g} s ({lo:.3g}-{hi:.3g}, n={len(times)})"


def _mib(b):
    return f"{b / 2**20:.1f} MiB"


def _arch(sizes):
    return "-".join(map(str, sizes)) + " tanh"


def _report(results, machine, quick, elapsed, load, command):
    note = (" With `--threads 1` every method runs on one core: on cores shared with other "
            "processes, torch's OpenMP threads stall whenever the other core is busy, which "
            "made two-thread medians vary 5-10x between runs of the same case."
            if "--threads 1" in command else "")
    lines = ["# skpathkernel benchmarks", "", f"Command: `{command}`.{note}", "",
             f"Machine: {machine}. Load average (1 min) before / after the run: "
             f"{load[0]:.2f} / {load[1]:.2f} (the cores are shared: other processes add "
             "noise; the min column is the least disturbed run).", "",
             f"Mode: {'--quick' if quick else 'full'}; wall time {elapsed:.0f} s. Times are "
             "the median (min-max, number of repeats) of separate calls, after a first call "
             "that measures the peak memory (and warms up): the peak extra resident memory "
             "of that call, sampled every millisecond, in a fresh process per case. Relative "
             "difference: max |K - K_skpathkernel| / max |K_skpathkernel|, both float32.", "",
             "## Tangent-kernel Gram K(X, X), float32, CPU", "",
             "| network | N | P | method | time | peak memory | speedup of skpathkernel | "
             "rel. diff |", "|---|---|---|---|---|---|---|---|"]
    ours = {}
    for r in results["gram"]:
        s = r["spec"]
        if s["method"] == "skpathkernel":
            ours[(tuple(s["sizes"]), s["n"])] = r
    for r in results["gram"]:
        s = r["spec"]
        mine = ours[(tuple(s["sizes"]), s["n"])]
        speed = ("1 (itself)" if s["method"] == "skpathkernel" else
                 f"{_stats(r['times'])[0] / _stats(mine['times'])[0]:.1f}x")
        diff = f"{r['rel_diff_vs_skpathkernel']:.1e}" if "rel_diff_vs_skpathkernel" in r else "-"
        lines.append(f"| {_arch(s['sizes'])} | {s['n']} | {r['n_params']} | {s['method']} | "
                     f"{_fmt_t(r['times'])} | {_mib(r['peak_bytes'])} | {speed} | {diff} |")
    lines += ["", "## GEMM roofline of the structured Gram", "",
              "FLOPs of the factor products (A A^T and Delta Delta^T per Linear layer, plus "
              "the Hadamard products) divided by the measured torch.matmul rate on an "
              "N x width x N product: the time the Gram would take at GEMM speed. The ratio "
              "is that bound over the measured time (1 = at roofline; the forward and "
              "backward passes that produce the factors are not in the bound).", "",
              "| network | N | GFLOP | matmul rate | GEMM-bound time | measured | ratio |",
              "|---|---|---|---|---|---|---|"]
    for r in results["gram"]:
        if "roofline" in r:
            rf, s = r["roofline"], r["spec"]
            med = _stats(r["times"])[0]
            lines.append(f"| {_arch(s['sizes'])} | {s['n']} | {rf['flops'] / 1e9:.3f} | "
                         f"{rf['matmul_flops_per_s'] / 1e9:.1f} GFLOP/s | "
                         f"{rf['gemm_bound_s']:.4f} s | {med:.4f} s | "
                         f"{rf['gemm_bound_s'] / med:.2f} |")
    lines += ["", "## Path kernel K(X, X) over T recorded steps (SGD, full batch), float32",
              "", "Memory must not grow with T: step Grams are accumulated one at a time "
              "(the trajectory itself, stored before the call, is listed separately).", "",
              "| network | N | T | time | time / step | peak memory of the call | "
              "trajectory size |", "|---|---|---|---|---|---|---|"]
    for r in results["path"]:
        s = r["spec"]
        med = _stats(r["times"])[0]
        lines.append(f"| {_arch(s['sizes'])} | {s['n']} | {s['T']} | {_fmt_t(r['times'])} | "
                     f"{med / s['T'] * 1e3:.2f} ms | {_mib(r['peak_bytes'])} | "
                     f"{_mib(r['trajectory_bytes'])} |")
    for name, rows in results.get("tables", {}).items():
        lines += ["", f"## {TABLES[name][1]}", "", f"From `benchmarks/{name}`.", ""]
        if rows:
            keys = list(rows[0])
            lines += ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
            lines += ["| " + " | ".join(str(r[k]) for k in keys) + " |" for r in rows]
    lines += ["", "## Pending peers", "",
              "JAX / neural-tangents (`empirical_ntk_fn` with its structured implementation) "
              "is not installed in this environment; it is the next peer to add.", ""]
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="fewer cases and repeats")
    parser.add_argument("--out", default=str(Path(__file__).parent),
                        help="folder for results.md and results.json")
    parser.add_argument("--only", choices=["gram", "path", *TABLES], help="run one group only")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads per case (default: torch's own choice); 1 keeps "
                             "cores shared with other processes from stalling parallel ops")
    args = parser.parse_args(argv)
    root = Path(__file__).resolve().parent.parent
    plan = _plan(args.quick)
    tables = list(TABLES)
    if args.only:
        plan = {args.only: plan[args.only]} if args.only in plan else {}
        tables = [args.only] if args.only in TABLES else []
    load = [os.getloadavg()[0]]
    start = time.perf_counter()
    results = {"gram": [], "path": []}
    for group, specs in plan.items():
        for spec in specs:
            r = _run(spec, root, args.threads)
            print(f"{group}: {spec.get('method', '')} {spec['sizes']} n={spec['n']} "
                  f"{'T=' + str(spec['T']) if 'T' in spec else ''}: "
                  f"{_stats(r['times'])[0]:.4g} s, {_mib(r['peak_bytes'])}", flush=True)
            results[group].append(r)
    results["tables"] = {}
    for name in tables:
        import importlib

        import torch

        if args.threads:
            torch.set_num_threads(args.threads)
        results["tables"][name] = importlib.import_module(TABLES[name][0]).run(quick=args.quick)
        print(f"{name}: {len(results['tables'][name])} rows", flush=True)
    elapsed = time.perf_counter() - start
    load.append(os.getloadavg()[0])
    machine = _machine(args.threads)
    command = " ".join(["python -m benchmarks", *(argv if argv is not None else sys.argv[1:])])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(
        {"machine": machine, "quick": args.quick, "elapsed_s": elapsed, "loadavg": load,
         "command": command,
         **results}, indent=1))
    (out / "results.md").write_text(_report(results, machine, args.quick, elapsed, load,
                                                  command))
    print(f"wrote {out / 'results.md'} in {elapsed:.0f} s")


if __name__ == "__main__":
    main()
