"""The capture's private copy of its rows in the memory plans, before and after: peak of
torch's CPU allocations above the returned Gram, against ``memory_budget``.

Every capture runs the user's network on a copy of its chunk's rows
(``_device.forward_input``), alive for the whole capture. The block and chunk plans
counted four times a row's factors (``Capture.capture_bytes``) but not that copy, which
on a network with a wide input and narrow factors (an 8x8 average pool before the first
Linear: 48 KiB of input per row, 0.8 KiB of factors) is most of what a capture holds.
"Before" replaces ``Capture.capture_bytes`` by the former estimate in the same process;
the peaks are deterministic (no timing). Usage: ``python -m benchmarks.bench_input_copy_bytes
[--out PATH]`` (default ``benchmarks/results/input_copy_bytes-s47``), writes ``PATH.md``.
"""

import argparse
import os
from pathlib import Path

import torch
from torch import nn

from benchmarks.bench_gpu_choices import cpu_peak_bytes
from skpathkernel._tangent import _capture, tangent_features, tangent_gram

ROOT = Path(__file__).resolve().parent.parent


def _networks():
    torch.manual_seed(0)
    yield "pool, Linear(192, 10)", nn.Sequential(nn.AvgPool2d(8), nn.Flatten(),
                                                 nn.Linear(192, 10))
    torch.manual_seed(0)
    yield "pool, Linear, Tanh, Linear", nn.Sequential(
        nn.AvgPool2d(8), nn.Flatten(), nn.Linear(192, 16), nn.Tanh(), nn.Linear(16, 10))


def _peaks(module, X, budget):
    params = {k: v.detach() for k, v in module.named_parameters()}
    calls = {"K(X, X)": lambda: tangent_gram(module, params, X, memory_budget=budget),
             "K(X, Y)": lambda: tangent_gram(module, params, X, X[:100],
                                             memory_budget=budget),
             # One output: the features are a view of the Jacobian (a trace of several
             # returns a scaled copy beside it, which the budget does not cover).
             "features, output=0": lambda: tangent_features(module, params, X, output=0,
                                                            memory_budget=budget)}
    tangent_gram(module, params, X[:2], memory_budget=budget)  # one-time allocations
    out = {}
    for name, call in calls.items():
        result, peak = cpu_peak_bytes(call)
        out[name] = (peak - result.nbytes) / budget
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"
                                             / "input_copy_bytes-s47"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    X = torch.randn(256, 3, 64, 64)
    new = _capture.Capture.capture_bytes
    lines = ["# The capture's copy of its rows in the memory plans (s47)", "",
             "Peak of torch's CPU allocations above the result, over `memory_budget`, of "
             "`tangent_gram` / `tangent_features` on N = 256 float32 images 3x64x64 (48 KiB "
             "per row); before: the plans without the copy (`Capture.capture_bytes` as "
             "`4 * nbytes()`), after: with it. Deterministic (no timing); "
             f"`python -m benchmarks.bench_input_copy_bytes`, torch {torch.__version__}, "
             f"load {os.getloadavg()[0]:.1f}.", "",
             "| network | budget | call | before | after |", "|---|---|---|---|---|"]
    for label, module in _networks():
        for budget in (2**20, 2**22):
            _capture.Capture.capture_bytes = lambda self: 4 * self.nbytes()
            try:
                before = _peaks(module, X, budget)
            finally:
                _capture.Capture.capture_bytes = new
            after = _peaks(module, X, budget)
            for call in before:
                lines.append(f"| {label} | {budget // 2**20} MiB | {call} | "
                             f"{before[call]:.2f} | {after[call]:.2f} |")
    Path(args.out + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
