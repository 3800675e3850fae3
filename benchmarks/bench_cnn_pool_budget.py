"""The plain-CNN route's max-pool (:func:`skpathkernel._tangent._cnn._max_pool`) against
the memory budget, and its forward's time (session s48 review).

``peak``: tangent_gram of small CNNs with a wide first convolution (3 x 3 to ``c``
channels on ``side`` x ``side`` rows, a ReLU and a max-pool of ``k``, then a Linear head
or a 1 x 1 convolution to 2 channels and a 2 x 2 pool first), one output, the trace
and the full blocks, with and without Y (48 and 20 rows), at the least budget that
the plan accepts, 5/4 of it and twice it: the peak of torch's CPU allocations less K,
as a share of the budget (the contract of ``memory_budget``). It runs the
``skpathkernel`` it imports: run it on exports of the commits compared
(``git archive C skpathkernel | tar -x -C DIR``, ``PYTHONPATH=DIR``).

``forward``: ``_cnn._forward`` of the CIFAR CNN on a 23-row chunk (float32, one
thread), ``time.process_time`` per call, the sides alternating in one process:
"base" the NCHW pool after a ReLU (50a894e), "s48" the ReLU then a channels-last copy
(0ef5b93), "fix" the ReLU written in channels-last memory (as committed).

Usage: ``OMP_NUM_THREADS=1 taskset -c 1 python -m benchmarks.bench_cnn_pool_budget
{peak,forward}``. Results: ``benchmarks/results/cnn_pool_budget-s48.md``.
"""

import functools
import os
import statistics
import sys
import time
from unittest import mock

import torch
import torch.nn.functional as F
from torch import nn

import skpathkernel
from benchmarks import _worker
from benchmarks.bench_gpu_choices import cpu_peak_bytes
from skpathkernel._tangent import _cnn
from skpathkernel._tangent._gram import tangent_gram


def _least(call):
    least = 64
    while True:
        try:
            call(least)
            return least
        except ValueError as e:
            least = int(str(e).split("at least ")[1].rstrip(".").replace(",", ""))


def peak():
    torch.set_num_threads(1)
    print("skpathkernel from", os.path.dirname(skpathkernel.__file__))
    shares = []
    for c in (64, 128):
        for side in (16, 24):
            for tail in ("none", "tiny"):
                for k in (2, 3):
                    p = side // k
                    layers = [nn.Conv2d(3, c, 3, padding=1), nn.ReLU(), nn.MaxPool2d(k)]
                    feat = c * p * p
                    if tail == "tiny":
                        layers += [nn.Conv2d(c, 2, 1), nn.MaxPool2d(2)]
                        feat = 2 * (p // 2) ** 2
                    torch.manual_seed(0)
                    net = nn.Sequential(*layers, nn.Flatten(), nn.Linear(feat, 2))
                    params = {n: v.detach() for n, v in net.named_parameters()}
                    X, Y = torch.randn(48, 3, side, side), torch.randn(20, 3, side, side)
                    for output in (0, "trace", "full"):
                        for y in (None, Y):

                            def call(b, y=y, output=output, net=net, params=params, X=X):
                                return tangent_gram(
                                    net, params, X, y, output=output, memory_budget=b
                                )

                            least = _least(call)
                            for budget in (least, least * 5 // 4, 2 * least):
                                call(budget)
                                K, top = cpu_peak_bytes(functools.partial(call, budget))
                                share = (top - K.nbytes) / budget
                                shares.append(share)
                                print(
                                    f"c={c} side={side} tail={tail} k={k} output={output} "
                                    f"Y={y is not None} budget={budget} share={share:.3f}",
                                    flush=True,
                                )
    over = [s for s in shares if s > 1]
    print(f"cases {len(shares)}, over the budget {len(over)}, max share {max(shares):.3f}")


def _base(z, k, relu=False):
    return F.max_pool2d(torch.relu(z) if relu else z, k, k, 0, 1, False, True)


def _s48(z, k, relu=False):
    z = torch.relu(z) if relu else z
    out, idx = F.max_pool2d(
        z.contiguous(memory_format=torch.channels_last), k, k, 0, 1, False, True
    )
    return out.contiguous(), idx.contiguous()


def forward(rounds=7, calls=20):
    torch.set_num_threads(1)
    module, params, X = _worker.gram_problem({"arch": "cifar", "n": 23, "dtype": "float32"})
    cnn = _cnn.plain_cnn(module, list(params))
    sides = {"base": _base, "s48": _s48, "fix": _cnn._max_pool}
    times = {side: [] for side in sides}
    outs = {}
    for r in range(rounds):
        for side in list(sides) if r % 2 == 0 else list(sides)[::-1]:
            with mock.patch.object(_cnn, "_max_pool", sides[side]):
                _cnn._forward(cnn, params, X)
                t = time.process_time()
                for _ in range(calls):
                    calls_, saved = _cnn._forward(cnn, params, X)
                times[side].append((time.process_time() - t) / calls)
                outs[side] = [(s[0], s[1]) for s in saved]
    for side in sides:
        same = all(
            torch.equal(a, b) and torch.equal(i, j) and a.stride() == b.stride()
            for (a, i), (b, j) in zip(outs[side], outs["base"])
        )
        print(
            f"{side}: median {statistics.median(times[side]) * 1e3:.2f} ms per forward "
            f"(by round {', '.join(f'{t * 1e3:.2f}' for t in times[side])}), "
            f"pooled outputs and argmax as base's: {same}"
        )


if __name__ == "__main__":
    {"peak": peak, "forward": forward}[sys.argv[1]]()
