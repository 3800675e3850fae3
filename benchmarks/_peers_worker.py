"""Peer cases that need the peers virtualenv (``benchmarks/setup_peers.sh``): the JAX
neural-tangents Gram and skorch training, served like :mod:`benchmarks._worker`.

Run as ``.venv-peers/bin/python -m benchmarks._peers_worker '<json spec>'``. The venv sees
the main environment's torch (``--system-site-packages``), so the torch module, its
weights and the data are rebuilt here exactly as the torch cases build them.
"""

from __future__ import annotations

import json
import os
import sys
import time


def _limit_threads(threads):
    """Must run before jax is imported: XLA reads its flags once."""
    if threads:
        # Eigen's own pool for the CPU GEMMs, and XLA's intra-op pool.
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + " --xla_cpu_multi_thread_eigen=false"
                                   f" intra_op_parallelism_threads={threads}").strip()
        os.environ["TF_CPP_MIN_LOG_LEVEL"] = "3"
        import torch

        torch.set_num_threads(threads)


def _jax_network(module, spec):
    """The torch network as a JAX function ``f(params, x)`` and its parameters (copied).

    Written with jax.numpy / lax (dot_general, conv_general_dilated, reduce_window,
    gather): the primitives neural-tangents' structured derivatives have rules for, as
    ``stax``'s layers emit them. The layouts are torch's (NCHW images, OIHW kernels).
    """
    import jax.numpy as jnp
    from jax import lax
    from jax import nn as jnn

    def arr(t):
        return jnp.asarray(t.detach().cpu().numpy())

    arch = spec.get("arch")
    if not arch:
        import torch

        linears = [m for m in module if isinstance(m, torch.nn.Linear)]
        params = [(arr(m.weight).T, arr(m.bias)) for m in linears]

        def f(p, x):
            for W, b in p[:-1]:
                x = jnp.tanh(x @ W + b)
            W, b = p[-1]
            return x @ W + b

        return f, params

    if arch in ("cnn8", "cifar"):
        import torch

        layers = [m for m in module if isinstance(m, (torch.nn.Conv2d, torch.nn.Linear))]
        params = [(arr(m.weight), arr(m.bias)) for m in layers]
        pool = arch == "cifar"

        def f(p, x):
            for W, b in p[:-1]:
                x = lax.conv_general_dilated(x, W, (1, 1), [(1, 1), (1, 1)],
                                             dimension_numbers=("NCHW", "OIHW", "NCHW"))
                x = jnp.maximum(x + b[None, :, None, None], 0.0)
                if pool:
                    x = lax.reduce_window(x, -jnp.inf, lax.max, (1, 1, 2, 2), (1, 1, 2, 2),
                                          "VALID")
            W, b = p[-1]
            return x.reshape(x.shape[0], -1) @ W.T + b

        return f, params

    heads = module.encoder.layers[0].self_attn.num_heads
    params = {"tok": arr(module.tok.weight), "pos": arr(module.pos.weight),
              "head": (arr(module.head.weight), arr(module.head.bias)), "layers": [
                  {"in": (arr(la.self_attn.in_proj_weight), arr(la.self_attn.in_proj_bias)),
                   "out": (arr(la.self_attn.out_proj.weight), arr(la.self_attn.out_proj.bias)),
                   "ff1": (arr(la.linear1.weight), arr(la.linear1.bias)),
                   "ff2": (arr(la.linear2.weight), arr(la.linear2.bias)),
                   "n1": (arr(la.norm1.weight), arr(la.norm1.bias)),
                   "n2": (arr(la.norm2.weight), arr(la.norm2.bias))}
                  for la in module.encoder.layers]}

    def linear(x, Wb):
        return x @ Wb[0].T + Wb[1]

    def norm(x, gb, eps=1e-5):
        mu = x.mean(-1, keepdims=True)
        var = ((x - mu) ** 2).mean(-1, keepdims=True)
        return (x - mu) / jnp.sqrt(var + eps) * gb[0] + gb[1]

    def attention(x, la):
        n, S, d = x.shape
        q, k, v = jnp.split(linear(x, la["in"]), 3, axis=-1)
        q, k, v = (t.reshape(n, S, heads, d // heads).transpose(0, 2, 1, 3) for t in (q, k, v))
        w = jnn.softmax(q @ k.transpose(0, 1, 3, 2) / jnp.sqrt(d // heads), axis=-1)
        return linear((w @ v).transpose(0, 2, 1, 3).reshape(n, S, d), la["out"])

    def f(p, ids):
        x = p["tok"][ids] + p["pos"][jnp.arange(ids.shape[1])]
        for la in p["layers"]:  # post-norm, ReLU: nn.TransformerEncoderLayer's defaults
            x = norm(x + attention(x, la), la["n1"])
            x = norm(x + linear(jnp.maximum(linear(x, la["ff1"]), 0.0), la["ff2"]), la["n2"])
        return linear(x.mean(1), p["head"])

    return f, params


def nt_gram_case(spec):
    """neural-tangents ``empirical_ntk_fn``, STRUCTURED_DERIVATIVES, jit-compiled, on the
    same network with the torch weights copied in (:func:`_jax_network`)."""
    import numpy as np

    from benchmarks._serve import serve
    from benchmarks._worker import gram_problem
    from skpathkernel._tangent import tangent_gram

    module, params, X = gram_problem(spec)

    import jax
    import jax.numpy as jnp
    import neural_tangents as nt

    f, jparams = _jax_network(module, spec)
    n_out = module(X[:1]).shape[1]
    # trace_axes=(-1,): the trace over the outputs; neural-tangents averages it (checked
    # by the relative difference against skpathkernel's trace / C).
    ntk = jax.jit(nt.empirical_ntk_fn(
        f, trace_axes=(-1,), vmap_axes=0,
        implementation=nt.NtkImplementation.STRUCTURED_DERIVATIVES))
    xj = jnp.asarray(X.numpy())
    t0 = time.perf_counter()
    compiled = ntk.lower(xj, None, jparams).compile()
    compile_s = time.perf_counter() - t0

    def finish(K):
        ref = tangent_gram(module, params, X).numpy()
        return {"rel_diff_vs_skpathkernel":
                float(np.abs(np.asarray(K) - ref).max() / np.abs(ref).max()),
                "n_outputs": n_out}

    serve(lambda: compiled(xj, None, jparams).block_until_ready(),
          {"n_params": sum(p.numel() for p in params.values()), "compile_s": compile_s,
           "versions": f"jax {jax.__version__}, jaxlib {jax.lib.__version__}, "
                       f"neural-tangents {nt.__version__}"},
          finish)


def skorch_training_case(spec):
    """skorch NeuralNetRegressor: same module (fresh copy per call), epochs, batch size,
    optimizer and learning rate as the torch loops of bench_peers_training."""
    import copy

    import skorch
    import torch

    from benchmarks._serve import serve
    from benchmarks.bench_peers_training import training_problem

    base, X, Y = training_problem(spec)
    X, Y = X.numpy(), Y.numpy()
    opt = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam}[spec["solver"]]

    def call():
        net = skorch.NeuralNetRegressor(
            copy.deepcopy(base), criterion=torch.nn.MSELoss, optimizer=opt,
            lr=spec["lr"], max_epochs=spec["epochs"],
            batch_size=spec["batch"] or -1,  # -1: the whole set, full-batch GD
            iterator_train__shuffle=True, train_split=None, verbose=0, device="cpu")
        return net.fit(X, Y)

    serve(call, {"versions": f"skorch {skorch.__version__}"}, lambda net: {})


if __name__ == "__main__":
    spec = json.loads(sys.argv[1])
    _limit_threads(spec.get("threads"))
    {"nt_gram": nt_gram_case, "skorch_training": skorch_training_case}[spec["kind"]](spec)
