"""Where a GPU's time goes in the image networks' Grams: a torch.profiler trace of
``tangent_gram`` (trace over the outputs) at N = 128, per network, written as tables of
the operators by count and by device time, and the Python phases' wall times.

The Gram rows (``results/gram_nets-quick-cuda.md``) found the engine's call bound by
launches on a GPU, several times torch.func's vmap recipe; this says which phase and
which operators take the calls. Usage: ``python -m benchmarks.profile_gpu_gram
[--device cuda] [--out DIR] [--n 128]``; writes ``DIR/profile_gpu_gram.txt``.
"""

import argparse
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from benchmarks import _worker
from skpathkernel._tangent import _gram, tangent_gram


def _phases(module, params, X, sync):
    """Wall time of the call's phases: the probe and autograd check, then the rest."""
    sync()
    t0 = time.perf_counter()
    _gram._prepare(module, params, X, "trace", _gram.DEFAULT_MEMORY_BUDGET)
    sync()
    t1 = time.perf_counter()
    tangent_gram(module, params, X)
    sync()
    t2 = time.perf_counter()
    return t1 - t0, t2 - t1


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=".")
    parser.add_argument("--n", type=int, default=128)
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    lines = []
    for arch in ("cnn8", "cifar", "resnet", "vit"):
        module, params, X = _worker.gram_problem(
            {"arch": arch, "n": args.n, "dtype": "float32"}, torch.device(args.device))
        tangent_gram(module, params, X)  # warm-up
        prepare, call = _phases(module, params, X, sync)
        with profile(activities=activities) as prof:
            tangent_gram(module, params, X)
            sync()
        events = prof.key_averages()
        launches = sum(e.count for e in events if e.key.startswith("cudaLaunchKernel"))
        ops = sum(e.count for e in events if e.key.startswith("aten::"))
        lines += [f"## {arch}, N = {args.n}: prepare (probe + autograd check) {prepare:.4f} s, "
                  f"whole call {call:.4f} s; aten ops {ops}, kernel launches {launches}", "",
                  events.table(sort_by="count", row_limit=30), "",
                  events.table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total",
                               row_limit=20), ""]
        print(lines[0 - 6], flush=True)
    out = Path(args.out) / "profile_gpu_gram.txt"
    out.write_text("\n".join(lines))
    print("wrote", out)


if __name__ == "__main__":
    main()
