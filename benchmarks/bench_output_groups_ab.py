"""One process A/B of the tangent Gram's output groups (issue 31).

Two questions, one mode each (``benchmarks/results/output_groups_ab-<mode>.md``):

``widths``: can the ten-output ResNet (``benchmarks/_nets.py``, N = 1024, 1 GiB budget)
run in fewer output groups, each a forward pass per capture chunk? "ref" is the plan's
five groups of two outputs (16-row chunks); "tree" four groups of 3, 3, 2 and 2 outputs
(the wider first), the three-output groups captured ``CHUNK`` rows at a time (default 8:
what their formed blocks, 951 MB, leave of the budget at the plan's estimate of a
chunk's bytes; 16 is beyond that estimate), both set by patching
``_gram._output_groups`` and ``_gram._dense_shares``.

``scratch``: ``_gram._Scratch`` growing a buffer only after the smaller one is dropped
("tree") against growing it while the smaller one is still held ("ref", the code before:
output groups of unequal widths held the narrower group's blocks beside the wider's),
on ``resnet``, ``cifar``, ``cnn8`` and the 64-128-128-10 MLP.

Each case runs once per side (warm-up), then ``tangent_gram(net, params, X)`` at the
default budget, the two sides alternating (the order reversed every round), ``REPS``
rounds (default 3), ``time.thread_time`` on one torch thread; then the peak of torch's
CPU allocations of one more call per side (profiler memory events, as the tests of
``memory_budget``), less K.

Usage: ``OMP_NUM_THREADS=1 taskset -c 1 python -m benchmarks.bench_output_groups_ab MODE
[CASES]``.
"""

import math
import os
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from unittest import mock

import torch

from benchmarks._ab import ab_provenance, outputs_row, write_ab
from benchmarks.bench_conv_formed_ab import _case
from benchmarks.bench_gpu_choices import cpu_peak_bytes
from skpathkernel._tangent import _gram, tangent_gram

ROOT = Path(__file__).resolve().parent.parent
REAL_SHARES = _gram._dense_shares


def _held_get(self, shape, like):
    """``_Scratch.get`` before: the larger buffer taken while the smaller is held."""
    numel = math.prod(shape)
    buf = self._buffer
    if buf is None or buf.numel() < numel:
        buf = self._buffer = like.new_empty(numel)
    return buf[:numel].view(shape)


def _side(mode, side, chunk):
    stack = ExitStack()
    if mode == "scratch" and side == "ref":
        stack.enter_context(mock.patch.object(_gram._Scratch, "get", _held_get))
    if mode == "widths" and side == "tree":
        def groups(probe, *args):
            return [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9]]

        def shares(probe, kept, budget):
            rows, share = REAL_SHARES(probe, kept, budget)
            # The three-output groups: every block kept, captured ``chunk`` rows at a time.
            return (chunk, budget) if kept * 1024 > share else (rows, share)

        stack.enter_context(mock.patch.object(_gram, "_output_groups", groups))
        stack.enter_context(mock.patch.object(_gram, "_dense_shares", shares))
    return stack


def main(mode, cases, reps, chunk):
    torch.set_num_threads(1)
    rows = []
    for case in cases:
        net, X = _case(case)
        params = {k: v.detach() for k, v in net.named_parameters()}
        times, out = {"ref": [], "tree": []}, {}
        for side in ("ref", "tree"):  # warm-up: first-call costs, the allocator's pools
            with _side(mode, side, chunk):
                tangent_gram(net, params, X)
        for r in range(reps):
            for side in ("ref", "tree") if r % 2 == 0 else ("tree", "ref"):
                with _side(mode, side, chunk):
                    start = time.thread_time()
                    K = tangent_gram(net, params, X)
                    times[side].append(time.thread_time() - start)
                out[side] = K.double().numpy()
                print(f"  {case} {side}: {times[side][-1]:.2f} s", flush=True)
        row = outputs_row(case, times, out)
        for side in ("ref", "tree"):
            with _side(mode, side, chunk):
                K, peak = cpu_peak_bytes(lambda: tangent_gram(net, params, X))  # noqa: B023
            row[f"{side}_torch_mib"] = f"{(peak - K.nbytes) / 2**20:.1f}"
            row[f"{side}_rounds"] = ", ".join(f"{t:.2f}" for t in times[side])
        print("  peak of torch's allocations less K (MiB): ref {ref_torch_mib}, tree "
              "{tree_torch_mib}".format(**row), flush=True)
        rows.append(row)
    return rows


if __name__ == "__main__":
    mode = sys.argv[1]
    default = "resnet" if mode == "widths" else "resnet,cifar,cnn8,mlp"
    cases = (sys.argv[2] if len(sys.argv) > 2 else default).split(",")
    reps, chunk = int(os.environ.get("REPS", 3)), int(os.environ.get("CHUNK", 8))
    load_start = os.getloadavg()[0]
    rows = main(mode, cases, reps, chunk)
    ref = {"widths": "the plan's five groups of two outputs",
           "scratch": "_Scratch.get growing while the smaller buffer is held"}[mode]
    extra = {"chunk": chunk} if mode == "widths" else {}
    prov = ab_provenance(ROOT, "bench_output_groups_ab",
                         ["skpathkernel/_tangent/_gram.py",
                          "benchmarks/bench_output_groups_ab.py"],
                         ref, reps, N=1024, load_start=f"{load_start:.2f}", **extra)
    write_ab(ROOT / f"benchmarks/results/output_groups_ab-{mode}",
             f"Output groups of the tangent Gram: A/B, {mode} (issue 31)", "time.thread_time",
             prov, rows, 3,
             columns=(("ref peak of torch's allocations less K (MiB)", "ref_torch_mib"),
                      ("tree peak less K (MiB)", "tree_torch_mib"),
                      ("ref rounds (s)", "ref_rounds"), ("tree rounds (s)", "tree_rounds")),
             machine=True)
