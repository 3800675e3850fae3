"""One benchmark case in a fresh process: time (median of repeats) and peak memory.

Run by ``python -m benchmarks`` as ``python -m benchmarks._worker '<json spec>'``; prints
one JSON line. A fresh process per case keeps one method's allocator cache from hiding
another's memory. Peak memory is the peak resident set size sampled every millisecond
during the runs, minus the resident size just before them (after the setup).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import threading
import time

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from skpathkernel._tangent import tangent_gram

_PAGE = os.sysconf("SC_PAGE_SIZE")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


class _PeakRSS:
    def __enter__(self):
        self.base = self.peak = _rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, _rss())

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss())
        return False

    @property
    def delta(self) -> int:
        return self.peak - self.base


def _mlp(sizes, activation=nn.Tanh):
    layers = []
    for d_in, d_out in zip(sizes[:-2], sizes[1:-1]):
        layers += [nn.Linear(d_in, d_out), activation()]
    layers.append(nn.Linear(sizes[-2], sizes[-1]))
    return nn.Sequential(*layers)


def _vmap_recipe(module, params, X):
    """The PyTorch tutorial recipe: per-sample gradients by vmap(grad), then J J^T."""

    def f(p, x):
        return functional_call(module, p, (x.unsqueeze(0),)).squeeze()

    grads = vmap(grad(f), in_dims=(None, 0))(params, X)
    J = torch.cat([g.reshape(X.shape[0], -1) for g in grads.values()], dim=1)
    return J @ J.T


def _loop(module, params, X):
    """Per-sample autograd loop: N backward passes, then J J^T."""
    live = [p.detach().requires_grad_(True) for p in params.values()]
    named = dict(zip(params, live))
    rows = []
    for x in X:
        f = functional_call(module, named, (x.unsqueeze(0),)).squeeze()
        rows.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(f, live)]))
    J = torch.stack(rows)
    return J @ J.T


METHODS = {
    "skpathkernel": lambda m, p, X: tangent_gram(m, p, X),
    "vmap_grad": _vmap_recipe,
    "autograd_loop": _loop,
}


def _measure(fn, repeats):
    """Peak memory of one call under the RSS sampler, then the median of untimed-sampler runs.

    The sampler thread competes for the 1-ms GIL slots with Python-heavy code, so the
    timed calls run without it; the memory call doubles as the warm-up.
    """
    with _PeakRSS() as mem:
        out = fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    return out, times, mem.delta


def gram_case(spec):
    torch.manual_seed(0)
    dtype = getattr(torch, spec["dtype"])
    module = _mlp(spec["sizes"]).to(dtype)
    params = {k: v.detach() for k, v in module.named_parameters()}
    X = torch.randn(spec["n"], spec["sizes"][0], dtype=dtype)
    method = METHODS[spec["method"]]
    K, times, peak = _measure(lambda: method(module, params, X), spec["repeats"])
    result = {"times": times, "peak_bytes": peak,
              "n_params": sum(p.numel() for p in params.values())}
    if spec["method"] != "skpathkernel":
        ref = tangent_gram(module, params, X)
        result["rel_diff_vs_skpathkernel"] = float((K - ref).abs().max() / ref.abs().max())
    if spec.get("roofline"):
        result["roofline"] = _roofline(spec, module, X, dtype)
    return result


def _roofline(spec, module, X, dtype):
    """FLOPs of the factor products against the measured torch.matmul rate."""
    n = X.shape[0]
    flops = 0
    for layer in module.modules():
        if isinstance(layer, nn.Linear):
            # A A^T (2 n^2 d_in), Delta Delta^T (2 n^2 d_out), Hadamard and sum (3 n^2).
            flops += 2 * n * n * (layer.in_features + layer.out_features) + 3 * n * n
    width = max(spec["sizes"])
    a, b = torch.randn(n, width, dtype=dtype), torch.randn(width, n, dtype=dtype)
    _, times, _ = _measure(lambda: a @ b, 5)
    rate = 2 * n * n * width / statistics.median(times)
    return {"flops": flops, "matmul_flops_per_s": rate, "gemm_bound_s": flops / rate}


def path_case(spec):
    import numpy as np

    from skpathkernel import PathKernelMachine
    from skpathkernel.kernels import PathKernel

    rng = np.random.RandomState(0)
    X = rng.uniform(-1, 1, size=(spec["n"], spec["sizes"][0]))
    y = np.sin(3 * X[:, 0])
    est = PathKernelMachine(hidden_layer_sizes=tuple(spec["sizes"][1:-1]), max_iter=spec["T"],
                            learning_rate_init=0.05, device="cpu", dtype=spec["dtype"],
                            random_state=0).fit(X, y)
    kernel = PathKernel(est)
    _, times, peak = _measure(lambda: kernel(X), spec["repeats"])
    return {"times": times, "peak_bytes": peak, "n_points": len(est.trajectory_),
            "trajectory_bytes": est.trajectory_.nbytes, "n_params": est.n_params_}


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    result = {"gram": gram_case, "path": path_case}[spec["kind"]](spec)
    print(json.dumps({"spec": spec, **result}))
