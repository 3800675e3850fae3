"""A/B of PathRecorder's check that a step's gradient was not added onto the last one's.

CPU time per recorded Adam step of a 20-100-1 ReLU MLP (batch 32, one torch thread) with
the check as committed ("new") and with it patched off ("ref"), the sides alternating
(order reversed every round), medians over the rounds.

``taskset -c 0 env PYTHONPATH=. python -m benchmarks.bench_recorder_zero_grad_ab``
"""

import time

import numpy as np
import torch

from skpathkernel import PathRecorder
from skpathkernel._path import _recorder

_NEW = (_recorder.PathRecorder._before_grad, _recorder.PathRecorder._check_accumulated)


def _per_step(new, X, Y, steps=300):
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
        opt.zero_grad()
        ((module(X[idx]) - Y[idx]) ** 2).mean().backward()
        rec.set_batch(idx)
        opt.step()
    elapsed = time.process_time() - start
    rec.close()
    cls._before_grad, cls._check_accumulated = _NEW
    return elapsed / steps * 1e6


def main(rounds=7):
    torch.set_num_threads(1)
    X, Y = torch.randn(256, 20), torch.randn(256, 1)
    times = {"new": [], "ref": []}
    for r in range(rounds):
        for side in (("new", "ref") if r % 2 == 0 else ("ref", "new")):
            times[side].append(_per_step(side == "new", X, Y))
    for side, values in times.items():
        print(f"{side}: median {np.median(values):.1f} us/step, rounds "
              f"{', '.join(f'{v:.0f}' for v in values)}")
    print(f"new / ref: {np.median(times['new']) / np.median(times['ref']):.3f}")


if __name__ == "__main__":
    main()
