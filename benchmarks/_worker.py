"""One torch benchmark case in a fresh process, served by :func:`benchmarks._serve.serve`.

Run by ``python -m benchmarks`` as ``python -m benchmarks._worker '<json spec>'``. A fresh
process per case keeps one method's allocator cache from hiding another's memory. Peak
memory: on the CPU the peak resident set size above the level after setup, sampled every
millisecond; on CUDA ``torch.cuda.max_memory_allocated`` above the allocation at entry.
``spec["device"]`` ("cpu" by default, or "cuda") places the module and the data.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch
from torch import nn
from torch.func import functional_call, grad, vmap

from benchmarks._serve import PeakRSS, serve
from skpathkernel._tangent import tangent_gram


class CudaPeak:
    """Peak CUDA allocation above the allocation at entry (the caching allocator's view)."""

    def __init__(self, device):
        self.device = device

    def __enter__(self):
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.base = torch.cuda.memory_allocated(self.device)
        return self

    def __exit__(self, *exc):
        torch.cuda.synchronize(self.device)
        self.delta = torch.cuda.max_memory_allocated(self.device) - self.base
        return False


def _device_tools(device):
    if device.type == "cuda":
        return (lambda: CudaPeak(device)), (lambda: torch.cuda.synchronize(device))
    return PeakRSS, (lambda: None)


def _mlp(sizes, activation=nn.Tanh):
    layers = []
    for d_in, d_out in zip(sizes[:-2], sizes[1:-1]):
        layers += [nn.Linear(d_in, d_out), activation()]
    layers.append(nn.Linear(sizes[-2], sizes[-1]))
    return nn.Sequential(*layers)


def gram_problem(spec, device="cpu"):
    """The module, its parameters and X of a Gram case; the JAX peer rebuilds the same."""
    torch.manual_seed(0)
    dtype = getattr(torch, spec["dtype"])
    module = _mlp(spec["sizes"]).to(dtype)
    X = torch.randn(spec["n"], spec["sizes"][0], dtype=dtype)
    module, X = module.to(device), X.to(device)
    params = {k: v.detach() for k, v in module.named_parameters()}
    return module, params, X


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


def gram_case(spec):
    device = torch.device(spec.get("device", "cpu"))
    module, params, X = gram_problem(spec, device)
    method = METHODS[spec["method"]]
    peak, sync = _device_tools(device)

    def finish(K):
        result = {}
        if spec["method"] != "skpathkernel":
            ref = tangent_gram(module, params, X)
            result["rel_diff_vs_skpathkernel"] = float((K - ref).abs().max() / ref.abs().max())
        if spec.get("roofline"):
            result["roofline"] = _roofline(spec, module, X, sync)
        return result

    serve(lambda: method(module, params, X),
          {"n_params": sum(p.numel() for p in params.values())}, finish, peak, sync)


def _roofline(spec, module, X, sync):
    """FLOPs of the factor products against the measured torch.matmul rate."""
    n = X.shape[0]
    from skpathkernel._tangent._gram import _panel_rows

    linear = [layer for layer in module.modules() if isinstance(layer, nn.Linear)]
    # The bound: every factor product in full, A A^T (2 n^2 d_in) and
    # Delta Delta^T (2 n^2 d_out), plus the Hadamard products and sums (3 n^2).
    flops = sum(2 * n * n * (lay.in_features + lay.out_features) + 3 * n * n
                for lay in linear)
    # What the engine performs: the products of the panels on and above the diagonal
    # (K(X, X) is symmetric), plus the forward pass and the backward pass to the layer
    # outputs that produce the factors.
    outer, inner = _panel_rows(X.device)
    pairs = 0
    for s in range(0, n, outer):
        e = min(s + outer, n)
        pairs += (e - s) * (n - e)  # right of the outer panel's square
        pairs += sum(min(inner, e - t) * (e - t) for t in range(s, e, inner))  # the square
    performed = sum(2 * pairs * (lay.in_features + lay.out_features) + 3 * pairs
                    for lay in linear)
    performed += sum(2 * n * lay.in_features * lay.out_features for lay in linear)
    performed += sum(2 * n * lay.in_features * lay.out_features for lay in linear[1:])
    width = max(spec["sizes"])
    a = torch.randn(n, width, dtype=X.dtype, device=X.device)
    b = torch.randn(width, n, dtype=X.dtype, device=X.device)
    a @ b
    times = []
    for _ in range(5):
        sync()
        t0 = time.perf_counter()
        a @ b
        sync()
        times.append(time.perf_counter() - t0)
    rate = 2 * n * n * width / statistics.median(times)
    return {"flops": flops, "matmul_flops_per_s": rate, "gemm_bound_s": flops / rate,
            "performed_flops": performed, "performed_bound_s": performed / rate}


def path_case(spec):
    import numpy as np

    from skpathkernel import PathKernelMachine
    from skpathkernel.kernels import PathKernel

    device = torch.device(spec.get("device", "cpu"))
    rng = np.random.RandomState(0)
    X = rng.uniform(-1, 1, size=(spec["n"], spec["sizes"][0]))
    y = np.sin(3 * X[:, 0])
    # T full-batch SGD steps, every one recorded (the table's setting, pinned).
    est = PathKernelMachine(hidden_layer_sizes=tuple(spec["sizes"][1:-1]), max_iter=spec["T"],
                            solver="sgd", learning_rate_init=0.05, batch_size=None, tol=None,
                            record_every=1, activation="tanh", normalize_y=False,
                            device=str(device), dtype=spec["dtype"], random_state=0).fit(X, y)
    kernel = PathKernel(est)
    peak, sync = _device_tools(device)
    serve(lambda: kernel(X), {"n_points": len(est.trajectory_),
                              "trajectory_bytes": est.trajectory_.nbytes,
                              "n_params": est.n_params_},
          lambda K: {}, peak, sync)


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    {"gram": gram_case, "path": path_case}[spec["kind"]](spec)
