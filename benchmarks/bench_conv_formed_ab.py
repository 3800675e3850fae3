"""One process A/B of the convolutions' formed weight gradients (issue 31): the
tangent-kernel Gram with a 2-D convolution's per-sample weight gradients formed by one
grouped convolution backward (``skpathkernel/_tangent/_layers.py``: ``_conv_formed``,
"tree") against the patches' copy and one GEMM per sample ("ref", the route before it,
taken by patching ``formed_terms`` to decline every layer).

Each case runs once per side (warm-up), then ``tangent_gram(net, params, X)`` at the
default memory budget, the two sides alternating (the order reversed every round),
``REPS`` rounds each (default 3), timed by ``time.thread_time`` on one torch thread. Peak
memory: the largest resident memory over the call, sampled every 2 ms by a second thread,
less the resident memory before it (the process's high-water mark cannot be reset between
sides; what the allocator kept from the call before makes it vary by 100 MiB and more),
and the peak of torch's CPU allocations over one more call per side, from the profiler's
memory events (``bench_gpu_choices.cpu_peak_bytes``, as the tests of ``memory_budget``).

Cases (``benchmarks/_nets.py``, N = 1024, trace of the outputs): ``resnet``, ``cifar``,
``cnn8``, and ``mlp``, a 64-128-128-10 ReLU network on 64 features.

Usage: ``OMP_NUM_THREADS=1 taskset -c 1 python -m benchmarks.bench_conv_formed_ab [CASES]``
(CASES ``resnet,cifar,cnn8,mlp``). Writes ``benchmarks/results/conv_formed_ab.md`` and
``.json``. With CASES ``kernels``: the two ways of forming one chunk's blocks alone (16
samples; the patches' padding, copy and batched GEMM against the grouped convolution
backward), on the shapes of those networks and a few more, median of 15 calls each, a
64 MiB buffer rewritten before every call so that the operands come from memory as in
a Gram; writes ``benchmarks/results/conv_formed_kernels.md``.
"""

import os
import sys
import threading
import time
from pathlib import Path
from unittest import mock

import torch
from torch import nn
from torch.nn import functional as F

import skpathkernel._tangent._capture as capture_module
from benchmarks import _nets
from benchmarks._ab import ab_provenance, outputs_row, write_ab
from benchmarks.bench_gpu_choices import cpu_peak_bytes
from skpathkernel._tangent import tangent_gram
from skpathkernel._tangent._layers import _unfold

ROOT = Path(__file__).resolve().parent.parent
N = 1024


def _case(name):
    torch.manual_seed(0)
    if name == "mlp":
        net = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                            nn.Linear(128, 10))
        return net, torch.randn(N, 64)
    return _nets.build(name), _nets.inputs(name, N)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _timed(net, params, X):
    """(CPU seconds, peak extra resident bytes, K) of one call."""
    base, peak, done = _rss(), [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _rss())
            time.sleep(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    start = time.thread_time()
    K = tangent_gram(net, params, X)
    seconds = time.thread_time() - start
    done.set()
    sampler.join()
    return seconds, max(peak[0], _rss()) - base, K


def _side(side):
    if side == "ref":
        return mock.patch.object(capture_module, "formed_terms", lambda *args: None)
    return mock.patch.object(capture_module, "formed_terms", capture_module.formed_terms)


def main(cases, reps):
    torch.set_num_threads(1)
    rows = []
    for case in cases:
        net, X = _case(case)
        params = {k: v.detach() for k, v in net.named_parameters()}
        times, peaks, out = {"ref": [], "tree": []}, {"ref": [], "tree": []}, {}
        for side in ("ref", "tree"):  # warm-up: first-call costs, the allocator's pools
            with _side(side):
                _timed(net, params, X)
        for r in range(reps):
            for side in ("ref", "tree") if r % 2 == 0 else ("tree", "ref"):
                with _side(side):
                    seconds, peak, K = _timed(net, params, X)
                times[side].append(seconds)
                peaks[side].append(peak)
                out[side] = K.double().numpy()
        row = outputs_row(case, times, out)
        for side in ("ref", "tree"):
            row[f"{side}_peak_mib"] = f"{max(peaks[side]) / 2**20:.0f}"
            with _side(side):
                _, peak = cpu_peak_bytes(lambda: tangent_gram(net, params, X))  # noqa: B023
            row[f"{side}_torch_mib"] = f"{peak / 2**20:.1f}"
        print("  peak extra RSS (MiB): ref {ref_peak_mib}, tree {tree_peak_mib}; torch's "
              "allocations: ref {ref_torch_mib}, tree {tree_torch_mib}".format(**row), flush=True)
        rows.append(row)
    return rows


# (outputs C, c_in, c_out, side, kernel, stride): the ResNet's convolutions with two
# outputs (its output groups), CIFAR's second with ten, and a few between.
SHAPES = [(2, 16, 16, 32, 3, 1), (2, 16, 32, 32, 3, 2), (2, 32, 32, 16, 3, 1),
          (2, 32, 64, 16, 3, 2), (2, 64, 64, 8, 3, 1), (2, 16, 32, 32, 1, 2),
          (2, 3, 16, 32, 3, 1), (4, 16, 16, 32, 3, 1), (10, 16, 16, 32, 3, 1),
          (2, 32, 64, 16, 3, 1), (4, 32, 64, 16, 3, 1), (10, 32, 64, 16, 3, 1),
          (4, 64, 64, 8, 3, 1), (10, 32, 32, 16, 3, 1)]


def _ways(C, c_in, c_out, side, k, stride, n):
    """The two ways of forming the blocks of one chunk of ``n`` samples, as callables."""
    pad = k // 2
    x = torch.randn(n, c_in, side, side)
    out_side = (side + 2 * pad - k) // stride + 1
    d = torch.randn(n, C, c_out, out_side, out_side)
    out = torch.empty(n, C * c_out, c_in * k * k)

    def patches():
        P = _unfold(F.pad(x, [pad] * 4), (k, k), (stride, stride), (1, 1))
        torch.bmm(d.reshape(n, C * c_out, -1), P.transpose(1, 2), out=out)

    def grouped():
        torch.nn.grad.conv2d_weight(x.reshape(1, n * c_in, side, side),
                                    (n * C * c_out, c_in, k, k),
                                    d.reshape(1, n * C * c_out, out_side, out_side),
                                    stride, pad, 1, n)

    return {"patches": patches, "grouped": grouped}, out_side**2


def kernels(n=16):
    """Rows of the two ways of forming one chunk's blocks, on the shapes of SHAPES."""
    evict = torch.empty(2**24)
    rows = []
    for C, c_in, c_out, side, k, stride in SHAPES:
        ways, S = _ways(C, c_in, c_out, side, k, stride, n)
        times = {name: [] for name in ways}
        for _ in range(16):
            for name, f in ways.items():
                evict.add_(1.0)
                start = time.perf_counter()
                f()
                times[name].append(time.perf_counter() - start)
        med = {name: sorted(t[1:])[7] for name, t in times.items()}  # the first: warm-up
        q = c_in * k * k
        taken = k > 1 and q % 16 == 0 and C * c_out < S and C * c_out <= 128
        rows.append(f"| {C} | {c_in} -> {c_out}, {side} x {side}, {k}x{k} stride {stride} | "
                    f"{S} | {C * c_out} | {q} | {med['patches'] * 1e3:.2f} | "
                    f"{med['grouped'] * 1e3:.2f} | {med['patches'] / med['grouped']:.2f} | "
                    f"{'yes' if taken else 'no'} |")
        print(rows[-1], flush=True)
    return rows


if __name__ == "__main__":
    if sys.argv[1:2] == ["kernels"]:
        torch.set_num_threads(1)
        rows = kernels()
        prov = ab_provenance(ROOT, "bench_conv_formed_ab", ["benchmarks/bench_conv_formed_ab.py"],
                             "-", 15)
        lines = ["# Forming one chunk's convolution blocks: patches and GEMM, or a grouped "
                 "convolution backward", "", *(f"- {k}: {v}" for k, v in prov.items()), "",
                 "16 samples, float32, one thread; time of each way, median of 15 calls "
                 "(operands out of cache); ratio = patches / grouped (above 1: the grouped "
                 "backward is faster); taken: whether `_conv_formed`'s rule takes the grouped "
                 "backward for this shape.", "",
                 "| outputs C | convolution | S | C p | q | patches (ms) | grouped (ms) | "
                 "ratio | taken |", "|---|---|---|---|---|---|---|---|---|", *rows, "",
                 f"Load average at the end: {os.getloadavg()[0]:.2f}."]
        (ROOT / "benchmarks/results/conv_formed_kernels.md").write_text("\n".join(lines) + "\n")
        sys.exit()
    cases = (sys.argv[1] if len(sys.argv) > 1 else "resnet,cifar,cnn8,mlp").split(",")
    reps = int(os.environ.get("REPS", 3))
    load_start = os.getloadavg()[0]
    rows = main(cases, reps)
    prov = ab_provenance(ROOT, "bench_conv_formed_ab",
                         ["skpathkernel/_tangent/_layers.py", "skpathkernel/_tangent/_capture.py",
                          "skpathkernel/_tangent/_gram.py", "benchmarks/bench_conv_formed_ab.py"],
                         "formed_terms patched to None", reps, N=N,
                         load_start=f"{load_start:.2f}")
    write_ab(ROOT / "benchmarks/results/conv_formed_ab",
             "Convolutions' weight gradients formed by a grouped convolution backward: "
             "A/B (issue 31)", "time.thread_time", prov, rows, 3,
             columns=(("ref peak extra RSS (MiB)", "ref_peak_mib"),
                      ("tree peak extra RSS (MiB)", "tree_peak_mib"),
                      ("ref peak of torch's allocations (MiB)", "ref_torch_mib"),
                      ("tree peak of torch's allocations (MiB)", "tree_torch_mib")),
             machine=True)
