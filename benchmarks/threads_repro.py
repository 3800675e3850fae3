"""Concurrent engine calls on one shared module: wrong or raising calls per route.

4 threads x 20 calls of tangent_gram / tangent_features / tangent_gram_diag on the
same module (an MLP with two outputs, a small CNN), each compared with the
single-threaded reference. Usage: python benchmarks/threads_repro.py [rounds]
"""
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import nn

from skpathkernel._tangent import tangent_features, tangent_gram, tangent_gram_diag


class Pause(nn.Module):
    def forward(self, x):
        time.sleep(1e-3)
        return x


def nets():
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                        nn.Linear(16, 2)).double().eval()
    cnn = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
                        nn.Conv2d(4, 4, 3, padding=1), nn.ReLU(), nn.Flatten(),
                        nn.Linear(4 * 4 * 4, 2)).double().eval()
    # The test's CNN (tests/test_tangent.py): a pause inside the forward pass lets another
    # thread run there even on one core.
    paused = nn.Sequential(nn.Conv2d(1, 3, 3, padding=1), nn.ReLU(), Pause(),
                           nn.MaxPool2d(2), nn.Flatten(), nn.Linear(3 * 4 * 4, 2)).double()
    return [("mlp", mlp, torch.randn(24, 5, dtype=torch.float64)),
            ("paused", paused, torch.randn(6, 1, 8, 8, dtype=torch.float64)),
            ("cnn", cnn, torch.randn(24, 1, 8, 8, dtype=torch.float64))]


CALLS = {
    "gram": lambda m, p, X: tangent_gram(m, p, X),
    "gram_full": lambda m, p, X: tangent_gram(m, p, X, output="full"),
    "diag": lambda m, p, X: tangent_gram_diag(m, p, X),
    "features": lambda m, p, X: tangent_features(m, p, X, output="full"),
}


def run(call, n_threads=4, rounds=20):
    barrier = threading.Barrier(n_threads)

    def task(_):
        out = []
        for _ in range(rounds):
            barrier.wait(timeout=120)
            try:
                out.append(call())
            except Exception as exc:
                out.append(exc)
        return out

    with ThreadPoolExecutor(n_threads) as pool:
        return [r for rs in pool.map(task, range(n_threads)) for r in rs]


def main(rounds=20):
    sys.setswitchinterval(1e-5)  # more interleaving of the threads
    counts = {}
    for name, module, X in nets():
        params = {k: v.detach() + 0.1 for k, v in module.named_parameters()}
        for what, fn in CALLS.items():
            ref = fn(module, params, X)
            results = run(lambda fn=fn, m=module, p=params, X=X: fn(m, p, X), rounds=rounds)
            raised = [r for r in results if isinstance(r, Exception)]
            wrong = [r for r in results if not isinstance(r, Exception)
                     and not torch.allclose(r, ref, rtol=1e-10, atol=1e-12)]
            worst = max(((r - ref).abs().max() / ref.abs().max()).item() for r in wrong) \
                if wrong else 0.0
            msgs = sorted({f"{type(e).__name__}: {str(e)[:70]}" for e in raised})
            counts[name, what] = (len(results), len(raised), len(wrong))
            print(f"{name:6s} {what:10s} calls {len(results)} raised {len(raised)} "
                  f"wrong {len(wrong)} worst rel {worst:.3g} {msgs}", flush=True)
    return counts


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 20)
