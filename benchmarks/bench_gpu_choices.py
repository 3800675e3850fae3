"""The engine's GPU choices that are off by default, measured on the CPU: torch calls,
captures and peak memory of ``tangent_gram``, with each choice forced.

The GPU runs (``results/gram_nets-quick-cuda.md``) found the image networks' Grams bound
by the host issuing torch calls. Two choices cut the calls (``_capture._batches_backprops``:
one batched backward pass over the outputs; ``_gram._wide_chunks``: capture chunks as
large as the kept blocks leave room for), but both hold more than the chunk plan counts.
This counts the calls (every torch operator dispatched, a device-independent proxy of a
GPU's launches) and measures the peak of torch's CPU allocations above the returned Gram
(the profiler's memory events) against ``memory_budget``, on the benchmark's image
networks at N = 128 (default 1 GiB budget) and on a long-sequence attention network
whose backward's largest tensors belong to no parameter (16 MiB budget). K is compared
with the default's. Usage: ``python -m benchmarks.bench_gpu_choices [--out PATH]``
(default ``benchmarks/results/gpu_choices_cpu``), writes ``PATH.md`` and ``.json``.
"""

import argparse
import json
import math
import platform
import subprocess
from pathlib import Path

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from benchmarks import _worker
from benchmarks.bench_ops_ab import _Count
from skpathkernel._tangent import _capture, _gram, tangent_gram

ROOT = Path(__file__).resolve().parent.parent
CHOICES = {"default": (False, False), "batched": (True, False), "wide chunks": (False, True),
           "both": (True, True)}


class LongAttention(nn.Module):
    """Single-head attention over 128 positions, a mean and a head of ``n_out``: the
    backward's largest tensors, the scores and their softmax, belong to no parameter, so
    the capture's factors (which size its chunks) do not see them."""

    def __init__(self, d=8, n_out=10):
        super().__init__()
        self.qkv, self.out, self.head = nn.Linear(d, 3 * d), nn.Linear(d, d), nn.Linear(d, n_out)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1)
        return self.head(self.out(a @ v).mean(1))


def cpu_peak_bytes(fn):
    """``fn()`` and the peak of torch's CPU allocations during it above where it started,
    from the profiler's memory events."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    events = sorted((e for e in prof.profiler.kineto_results.events()
                     if e.name() == "[memory]"), key=lambda e: e.start_ns())
    current = peak = 0
    for e in events:
        current += e.nbytes()
        peak = max(peak, current)
    return out, peak


def _problems():
    for arch in ("cnn8", "cifar", "resnet", "vit"):
        module, params, X = _worker.gram_problem({"arch": arch, "n": 128, "dtype": "float32"})
        yield f"{arch}, N = 128", module, params, X, 2**30
    torch.manual_seed(0)
    module = LongAttention()
    params = {k: v.detach() for k, v in module.named_parameters()}
    yield "long attention (128 positions), N = 48", module, params, torch.randn(48, 128, 8), \
        2**24


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gpu_choices_cpu"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    real = _capture._batches_backprops, _gram._wide_chunks
    captures = []
    real_capture = _gram.capture
    _gram.capture = lambda *a, **k: captures.append(a[2].shape[0]) or real_capture(*a, **k)
    rows = []
    try:
        for name, module, params, X, budget in _problems():
            ref = None
            for choice, (batched, wide) in CHOICES.items():
                _capture._batches_backprops = lambda d, b=batched: b
                _gram._wide_chunks = lambda d, w=wide: w
                tangent_gram(module, params, X[:2], memory_budget=budget)  # one-time
                captures.clear()
                with _Count() as calls:
                    K = tangent_gram(module, params, X, memory_budget=budget)
                n_captures = len(captures) - 1  # not the probe
                _, peak = cpu_peak_bytes(lambda m=module, p=params, x=X, b=budget:
                                         tangent_gram(m, p, x, memory_budget=b))
                ref = K if ref is None else ref
                rows.append(dict(problem=name, choice=choice, calls=calls.ops,
                                 captures=n_captures,
                                 peak_mib=(peak - K.nbytes) / 2**20, budget_mib=budget / 2**20,
                                 rel_diff=float((K - ref).abs().max() / ref.abs().max())))
                print(rows[-1], flush=True)
    finally:
        _capture._batches_backprops, _gram._wide_chunks = real
        _gram.capture = real_capture
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=ROOT).stdout.strip()
    prov = dict(command="python -m benchmarks.bench_gpu_choices", commit=commit,
                machine=f"{platform.machine()}, {platform.processor() or platform.system()}",
                torch=torch.__version__, threads=1)
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(dict(provenance=prov, rows=rows), indent=1))
    lines = ["# The engine's GPU choices, off by default, measured on the CPU", "",
             *(f"- {k}: {v}" for k, v in prov.items()), "",
             "torch calls: operators dispatched by one `tangent_gram` call (trace over the "
             "outputs); captures: the row chunks captured after the probe; peak: torch's CPU "
             "allocations above the returned Gram (profiler memory events); rel. diff: max "
             "|K - K_default| / max |K_default|.", "",
             "| problem | choice | torch calls | captures | peak MiB | budget MiB | "
             "within budget | rel. diff |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['problem']} | {r['choice']} | {r['calls']} | {r['captures']} | "
                     f"{r['peak_mib']:.1f} | {r['budget_mib']:.0f} | "
                     f"{'yes' if r['peak_mib'] <= r['budget_mib'] else 'NO'} | "
                     f"{r['rel_diff']:.1e} |")
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("wrote", out.with_suffix(".md"))


if __name__ == "__main__":
    main()
