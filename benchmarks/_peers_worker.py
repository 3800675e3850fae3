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


def nt_gram_case(spec):
    """neural-tangents ``empirical_ntk_fn``, STRUCTURED_DERIVATIVES, jit-compiled, on the
    same MLP with the torch weights copied in (``x @ W.T + b``, tanh between layers)."""
    import numpy as np
    import torch

    from benchmarks._serve import serve
    from benchmarks._worker import gram_problem
    from skpathkernel._tangent import tangent_gram

    module, params, X = gram_problem(spec)

    import jax
    import jax.numpy as jnp
    import neural_tangents as nt

    linears = [m for m in module if isinstance(m, torch.nn.Linear)]
    jparams = [(jnp.asarray(m.weight.detach().numpy().T), jnp.asarray(m.bias.detach().numpy()))
               for m in linears]

    def f(p, x):
        for W, b in p[:-1]:
            x = jnp.tanh(x @ W + b)
        W, b = p[-1]
        return x @ W + b

    # trace_axes=(-1,) with one output is the scalar kernel, skpathkernel's output="trace".
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
                float(np.abs(np.asarray(K) - ref).max() / np.abs(ref).max())}

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
