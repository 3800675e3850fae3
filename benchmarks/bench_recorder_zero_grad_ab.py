"""A/B of PathRecorder's check that a step's gradient was not added onto the last one's.

CPU time per recorded Adam step of a 20-100-1 ReLU MLP (batch 32, one torch thread) with
the check as committed ("new") and with it patched off ("ref"), the sides alternating
(order reversed every round), medians over the rounds and of each round's own ratio.
Three loops: ``zero_grad()`` (``.grad`` None at the step's first ``backward()``: the
check reads no value), and ``zero_grad(set_to_none=False)`` with one and with four
micro-batches (each ``backward()`` reads whether the ``.grad`` it adds to is nonzero,
and the step syncs once).

``taskset -c 0 env PYTHONPATH=. python -m benchmarks.bench_recorder_zero_grad_ab``
"""

import time

import numpy as np
import torch

from skpathkernel import PathRecorder
from skpathkernel._path import _recorder

_NEW = (_recorder.PathRecorder._before_grad, _recorder.PathRecorder._check_accumulated)


def _per_step(new, X, Y, set_to_none=True, n_micro=1, steps=300):
    cls = _recorder.PathRecorder
    if new:
        cls._before_grad, cls._check_accumulated = _NEW
    else:
        cls._before_grad = lambda self, i, grad: None
        cls._check_accumulated = lambda self, step: None
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(20, 100), torch.nn.ReLU(),
                                 torch.nn.Linear(100, 1))
    opt = torch.optim.Adam(module.parameters(), lr=1e-3)
    rec = PathRecorder(module, opt, n_samples=len(X))
    start = time.process_time()
    for t in range(steps):
        idx = np.arange(t * 32, t * 32 + 32) % len(X)
        opt.zero_grad(set_to_none=set_to_none)
        for part in np.array_split(idx, n_micro):
            (((module(X[part]) - Y[part]) ** 2).mean() / n_micro).backward()
            rec.set_batch(part)
        opt.step()
    elapsed = time.process_time() - start
    rec.close()
    cls._before_grad, cls._check_accumulated = _NEW
    return elapsed / steps * 1e6


LOOPS = {"zero_grad()": {}, "zero_grad(set_to_none=False)": {"set_to_none": False},
         "zero_grad(set_to_none=False), 4 micro-batches": {"set_to_none": False,
                                                           "n_micro": 4}}


def main(rounds=11):
    torch.set_num_threads(1)
    X, Y = torch.randn(256, 20), torch.randn(256, 1)
    for loop, kw in LOOPS.items():
        times = {"new": [], "ref": []}
        for r in range(rounds):
            for side in (("new", "ref") if r % 2 == 0 else ("ref", "new")):
                times[side].append(_per_step(side == "new", X, Y, **kw))
        print(loop)
        for side, values in times.items():
            print(f"  {side}: median {np.median(values):.1f} us/step, rounds "
                  f"{', '.join(f'{v:.0f}' for v in values)}")
        paired = np.array(times["new"]) / np.array(times["ref"])
        print(f"  new / ref: {np.median(times['new']) / np.median(times['ref']):.3f} by "
              f"medians, {np.median(paired):.3f} the median of the rounds' own ratios "
              f"({paired.min():.2f}-{paired.max():.2f})")


if __name__ == "__main__":
    main()
