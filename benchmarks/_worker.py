"""One torch benchmark case in a fresh process, served by :func:`benchmarks._serve.serve`.

Run by ``python -m benchmarks`` as ``python -m benchmarks._worker '<json spec>'``. Gram
methods: ``skpathkernel`` times the public ``TangentKernel(net)(X)``,
``skpathkernel_engine`` the private ``tangent_gram`` under it, the others the peers. A fresh
process per case keeps one method's allocator cache from hiding another's memory. Peak
memory: on the CPU the peak resident set size above the level after setup, sampled every
millisecond; on CUDA ``torch.cuda.max_memory_allocated`` above the allocation at entry.
``spec["device"]`` ("cpu" by default, or "cuda") places the module and the data.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
from torch import nn
from torch.func import functional_call, grad, jacrev, vmap

from benchmarks import _nets
from benchmarks._flops import executed_flops
from benchmarks._serve import PeakRSS, serve
from skpathkernel import PathRecorder, TangentKernel
from skpathkernel._tangent import tangent_gram

BUDGET = 2**30  # tangent_gram's default memory_budget


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
    """The module, its parameters and X of a Gram case; the JAX peer rebuilds the same.

    ``spec["arch"]`` names an image / token network of :mod:`benchmarks._nets`; without
    it, ``spec["sizes"]`` is a tanh MLP.
    """
    torch.manual_seed(0)
    dtype = getattr(torch, spec["dtype"])
    if spec.get("arch"):
        module = _nets.build(spec["arch"]).to(dtype)
        X = _nets.inputs(spec["arch"], spec["n"], dtype)
    else:
        module = _mlp(spec["sizes"]).to(dtype)
        X = torch.randn(spec["n"], spec["sizes"][0], dtype=dtype)
    module, X = module.to(device), X.to(device)
    params = {k: v.detach() for k, v in module.named_parameters()}
    return module, params, X


def _vmap_recipe(module, params, X, output="trace"):
    """The PyTorch tutorial recipes: per-sample gradients by vmap(grad) (one output) or
    Jacobians by vmap(jacrev) (several, the NTK tutorial's), then the trace J J^T / C;
    ``output``: an index, that output's Gram alone."""
    keep = slice(None) if output == "trace" else slice(output, output + 1)

    def f(p, x):
        return functional_call(module, p, (x.unsqueeze(0),)).reshape(-1)[keep]

    n_out = f(params, X[0]).shape[0]
    if n_out == 1:
        grads = vmap(grad(lambda p, x: f(p, x)[0]), in_dims=(None, 0))(params, X)
    else:
        grads = vmap(jacrev(f), in_dims=(None, 0))(params, X)
    J = torch.cat([g.reshape(X.shape[0], -1) for g in grads.values()], dim=1)
    return J @ J.T / n_out


def _loop(module, params, X, output="trace"):
    """Per-sample autograd loop: N backward passes, then J J^T."""
    live = [p.detach().requires_grad_(True) for p in params.values()]
    named = dict(zip(params, live))
    rows = []
    for x in X:
        f = functional_call(module, named, (x.unsqueeze(0),)).reshape(-1)
        # One-output networks (the only ones this peer runs on), or the output asked for.
        f = f[0 if output == "trace" else output]
        rows.append(torch.cat([g.reshape(-1) for g in torch.autograd.grad(f, live)]))
    J = torch.stack(rows)
    return J @ J.T


PEERS = {"vmap_grad": _vmap_recipe, "autograd_loop": _loop}


def memory_budget() -> int:
    """skpathkernel's ``memory_budget`` in the Gram cases: the default unless
    ``SKPATHKERNEL_BENCH_MEMORY_BUDGET`` (bytes, or with a ``GiB`` suffix) names another,
    to show what a larger budget buys against the peers' memory."""
    text = os.environ.get("SKPATHKERNEL_BENCH_MEMORY_BUDGET", "").strip()
    if not text:
        return BUDGET
    if text.lower().endswith("gib"):
        return int(float(text[:-3]) * 2**30)
    return int(text)


def _gram_call(spec, module, params, X):
    """The timed call of a Gram case (``spec["output"]``: "trace" unless one is named).

    ``skpathkernel``, the headline row, is the call users make, ``TangentKernel(net)(X)``
    on NumPy inputs, with ``net`` the module at its current parameters as a one-point
    recorded path (:class:`~skpathkernel.PathRecorder` before any step: the public route
    for a network trained elsewhere, no training and nothing private). Its time includes
    what the public path adds to the engine: validating ``X`` and moving it to the
    network's device and dtype, and returning K as a float64 NumPy array.
    ``skpathkernel_engine`` is the private engine under it (float32 K on the device).
    """
    output = spec.get("output", "trace")
    budget = memory_budget()
    if spec["method"] == "skpathkernel":
        net = PathRecorder(module, torch.optim.SGD(module.parameters(), lr=0.0)).as_estimator(
            memory_budget=budget)
        X_user = X.cpu().numpy()
        return lambda: TangentKernel(net, output=output)(X_user)
    if spec["method"] == "skpathkernel_engine":
        return lambda: tangent_gram(module, params, X, output=output, memory_budget=budget)
    peer = PEERS[spec["method"]]
    return lambda: peer(module, params, X, output)


def gram_case(spec):
    device = torch.device(spec.get("device", "cpu"))
    module, params, X = gram_problem(spec, device)
    call = _gram_call(spec, module, params, X)
    peak, sync = _device_tools(device)
    roofline = probe = None
    if spec.get("roofline"):
        # The bound's FLOPs and the GEMM probe are set up before the timed calls: the
        # probe is then timed in every round beside the call (:func:`serve`), in this
        # process, so that the rate and the call's time see the same conditions.
        roofline = (_structured_roofline(module, params, X, spec.get("output", "trace"))
                    if spec.get("arch") else _roofline(spec, module, X))
        probe, roofline["probe_flops"] = _gemm_probe(X.shape[0], roofline["probe_width"], X)

    def finish(K):
        result = {}
        if spec["method"] != "skpathkernel_engine":
            # Every other row against the engine's float32 K, compared in float64.
            ref = tangent_gram(module, params, X, output=spec.get("output", "trace"))
            K = torch.as_tensor(K, device=ref.device, dtype=torch.float64)
            ref = ref.to(torch.float64)
            result["rel_diff_vs_skpathkernel"] = float((K - ref).abs().max() / ref.abs().max())
        if roofline is not None:
            if spec.get("arch"):
                # One more call, after the timed ones, under the FLOP counter.
                roofline["executed_flops"] = executed_flops(call)[1]
            result["roofline"] = roofline
        return result

    serve(call, {"n_params": sum(p.numel() for p in params.values())}, finish, peak, sync,
          probe)


def _roofline(spec, module, X):
    """FLOPs of the MLP's factor products: full and performed; ``width`` the probe's."""
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
    pairs = _panel_pairs(n, *_panel_rows(X.device))
    performed = sum(2 * pairs * (lay.in_features + lay.out_features) + 3 * pairs
                    for lay in linear)
    performed += sum(2 * n * lay.in_features * lay.out_features for lay in linear)
    performed += sum(2 * n * lay.in_features * lay.out_features for lay in linear[1:])
    width = max(spec["sizes"])
    return {"flops": flops, "performed_flops": performed, "width": width,
            "probe_width": width}


def _panel_pairs(n, outer, inner):
    """Pairs of samples the symmetric panels of K(X, X) compute (one block of n rows)."""
    pairs = 0
    for s in range(0, n, outer):
        e = min(s + outer, n)
        pairs += (e - s) * (n - e)  # right of the outer panel's square
        pairs += sum(min(inner, e - t) * (e - t) for t in range(s, e, inner))  # the square
    return pairs


def _gemm_probe(n, width, X):
    """The roofline's GEMM: torch.matmul on an n x width x n product (the Gram's shape)
    into one preallocated result (a fresh n x n result at every repeat read 10-20% slower
    on an idle core, ``benchmarks/results/matmul_probe.md``); ``(call, its FLOPs)``."""
    a = torch.randn(n, width, dtype=X.dtype if X.is_floating_point() else torch.float32,
                    device=X.device)
    b = torch.randn(width, n, dtype=a.dtype, device=X.device)
    out = a @ b
    return (lambda: torch.matmul(a, b, out=out)), 2 * n * n * width


def _matmul_rate(n, width, X, sync):
    """torch.matmul FLOP/s of :func:`_gemm_probe`: the least wall time of 5 repeats (the
    digits path case's floor; the Gram rows time the probe beside their calls)."""
    probe, flops = _gemm_probe(n, width, X)
    times = []
    for _ in range(5):
        sync()
        t0 = time.perf_counter()
        probe()
        sync()
        times.append(time.perf_counter() - t0)
    return flops / min(times)


def _structured_roofline(module, params, X, output="trace"):
    """The floor of the exact contraction the engine chose, per term, at GEMM speed.

    *Full products*, the issue's definition: every term's Gram products in full, for
    N x N: gradient blocks ``2 N^2 C p q`` (a convolution's floor), rank-one terms
    ``2 N^2 (q + C p)`` (a dense head), position pairs ``2 N^2 S^2 (q + C p)``.
    *Performed*: the share of those the symmetric panels compute (the upper triangle,
    ``N (N + 1) / 2`` pairs, for the dense rows that a BLAS SYRK takes on the CPU with
    one torch thread: :func:`skpathkernel._tangent._gram._syrk_block`), plus forming the
    gradient blocks (``2 N S C p q``); the forward and backward passes are not counted.
    The SYRK's rule is the engine's at the run's budget (:func:`memory_budget`) for a
    diagonal block of all N rows: at least ``SYRK_MIN_ROWS``, its buffers within an
    eighth of the budget, less the two groups' sums where the outputs are split in
    groups. It assumes that the Gram is one block (or one per output group), as on the
    benchmark's networks at N = 1024; a Gram of several row blocks takes the SYRK on
    smaller squares, and is counted here as by the panels where the rule fails for N.
    ``width``: the widest block row; ``probe_width``: the GEMM probe's (:func:`_gemm_probe`,
    N x width x N), at most 2^16 to bound its memory. ``output``: the row's, "trace" over the
    C outputs or one output's index (C = 1, the same definitions).
    """
    from skpathkernel._tangent import _gram, _stacked
    from skpathkernel._tangent._contract import param_numel

    n = X.shape[0]
    budget = memory_budget()
    params, outputs, mode, probe = _gram._prepare(module, params, X, output, budget)
    C = len(outputs)
    itemsize = probe.terms[0].delta.element_size()
    full = forming = rows = 0
    widest = 1
    rest = []  # the terms that the panels add after the SYRKs
    for t in probe.terms:
        factored = [a for _, a in t.inputs if a is not None]
        S, p = t.delta.shape[2], t.delta.shape[3]
        route = _gram.gram_route(t, n, n, mode, False, True, budget // 8, itemsize)
        if factored and route != "dense":
            rest.append(t)
        if not factored or route == "dense":
            numel = sum(param_numel(t, a) for _, a in t.inputs)
            full += 2 * n * n * C * numel
            rows += 2 * n * n * C * numel
            forming += 2 * n * S * C * numel if factored else 0
            widest = max(widest, C * numel)
        elif route == "rank1":
            full += 2 * n * n * (sum(a.shape[2] for a in factored) + C * p) + 3 * n * n
        else:
            full += 2 * n * n * S * S * (sum(a.shape[2] for a in factored) + C * p)
    pairs = _panel_pairs(n, *_gram._panel_rows(X.device, widest))
    spare = budget // 8
    if len(_gram._output_groups(probe, n, n, mode, None, True, budget, itemsize)) > 1:
        spare -= 2 * n * n * itemsize  # the groups' sums (K returned wider: two of them)
    syrk = (X.device.type == "cpu" and torch.get_num_threads() == 1
            and n >= _gram.SYRK_MIN_ROWS and _stacked._blas_process_wide()
            and _gram._syrk_bytes(rest, n, mode, itemsize) <= spare)
    if syrk:
        performed = (full - rows) * pairs / (n * n) + rows * (n + 1) / (2 * n) + forming
    else:
        performed = full * pairs / (n * n) + forming
    return {"flops": full, "performed_flops": performed, "width": widest,
            "probe_width": min(widest, 2**16)}


def path_case(spec):
    """PathKernel(X, X) over the recorded path: an MLP (``sizes``) on a sine, or a network
    of :mod:`benchmarks._nets` (``arch``, on its image inputs) on random targets, trained
    by ``spec["solver"]`` (Adam weights every step kernel by D)."""
    import numpy as np

    from skpathkernel import PathKernelMachine
    from skpathkernel.kernels import PathKernel

    device = torch.device(spec.get("device", "cpu"))
    if spec.get("arch") == "digits":
        return _digits_path_case(spec, device)
    rng = np.random.RandomState(0)
    # T full-batch steps, every one recorded (the table's setting, pinned).
    common = dict(max_iter=spec["T"], device=str(device), dtype=spec["dtype"],
                  solver=spec.get("solver", "sgd"), batch_size=None, tol=None, record_every=1,
                  normalize_y=False, random_state=0)
    if spec.get("arch"):
        shape = _nets.ARCHS[spec["arch"]]["shape"]
        X = rng.standard_normal((spec["n"], *shape)).astype(spec["dtype"])
        y = rng.standard_normal((spec["n"], _nets.ARCHS[spec["arch"]]["outputs"]))
        est = PathKernelMachine(module=lambda n_in, n_out: _nets.build(spec["arch"]),
                                learning_rate_init=0.01, **common).fit(X, y)
    else:
        X = rng.uniform(-1, 1, size=(spec["n"], spec["sizes"][0]))
        y = np.sin(3 * X[:, 0])
        est = PathKernelMachine(hidden_layer_sizes=tuple(spec["sizes"][1:-1]),
                                learning_rate_init=0.05, activation="tanh", **common).fit(X, y)
    kernel = PathKernel(est)
    peak, sync = _device_tools(device)
    serve(lambda: kernel(X), {"n_points": len(est.trajectory_),
                              "trajectory_bytes": est.trajectory_.nbytes,
                              "n_params": est.n_params_},
          lambda K: {}, peak, sync)


def _digits_path_case(spec, device):
    """The default estimator as a new user runs it: ``PathKernelClassifier`` (Adam, or
    ``solver="sgd", learning_rate_init=0.1``) on 1000 standardised digits, then
    ``path_kernel_(X[:n])``; with the FLOP floor of its stacked route (the cheapest exact
    contraction per layer and point, halved by the Gram's symmetry) at this machine's
    GEMM rate on an n x 64 x n product."""
    from sklearn.datasets import load_digits
    from sklearn.preprocessing import StandardScaler

    from skpathkernel import PathKernelClassifier
    from skpathkernel._tangent._stacked import path_flops, stacked_mlp

    X, y = load_digits(return_X_y=True)
    X = StandardScaler().fit_transform(X)[:1000]
    kw = {} if spec["solver"] == "adam" else dict(solver="sgd", learning_rate_init=0.1)
    est = PathKernelClassifier(random_state=0, device=str(device), **kw).fit(X, y[:1000])
    traj = est.trajectory_
    mlp = stacked_mlp(est.network_.module, traj.names)
    n, points = spec["n"], len(traj) - 1
    floor = points * path_flops(mlp, n, n, est.n_outputs_, spec["solver"] != "sgd", True)
    peak, sync = _device_tools(device)
    rate = _matmul_rate(n, 64, torch.as_tensor(X[:n], dtype=torch.float32, device=device),
                        sync)
    serve(lambda: est.path_kernel_(X[:n]),
          {"n_points": len(traj), "trajectory_bytes": traj.nbytes, "n_params": est.n_params_,
           "floor_flops": floor, "matmul_flops_per_s": rate, "floor_s": floor / rate},
          lambda K: {}, peak, sync)


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])
    {"gram": gram_case, "path": path_case}[spec["kind"]](spec)
