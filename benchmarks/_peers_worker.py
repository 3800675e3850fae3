"""Peer cases that need the peers virtualenv (``benchmarks/setup_peers.sh``): the
neural-tangents and nngeometry Grams and skorch training, served like
:mod:`benchmarks._worker`.

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


def _custom(apply_fn):
    """A stax layer for what stax has no layer for: ``apply_fn(params, x)`` with the
    ``(init_fn, apply_fn, kernel_fn)`` shape ``stax.serial`` composes. Only
    ``empirical_ntk_fn`` runs it, which calls ``apply_fn`` alone; the infinite-width
    ``kernel_fn`` of such a layer does not exist and raises."""

    def init_fn(rng, input_shape):
        raise NotImplementedError("parameters are copied from the torch module")

    def kernel_fn(k, **kwargs):
        raise NotImplementedError("no infinite-width kernel for a custom layer")

    return init_fn, lambda params, x, **kw: apply_fn(params, x), kernel_fn


def _stax_network(module, spec):
    """The torch network written with neural-tangents' ``stax`` as its documentation
    writes networks (``stax.serial``, ``stax.Dense``, ``stax.Conv`` on NHWC images,
    ``stax.Relu``, ``FanOut`` / ``parallel`` / ``FanInSum`` residuals, ``GlobalAvgPool``,
    ``LayerNorm``), its parameters the torch weights, transposed to stax's layouts.

    Returns ``(apply_fn, params, to_input)``: ``to_input`` maps the torch inputs to the
    stax ones (NCHW -> NHWC). ``parameterization="standard"`` makes ``Dense`` / ``Conv``
    compute ``x W + b`` as torch does (the default "ntk" scales by ``1 / sqrt(fan_in)``,
    another function with another tangent kernel). Custom layers (:func:`_custom`) stand
    in where stax has no layer for the torch one, each for a reason given where it is
    used: max pooling; BatchNorm in eval mode; LayerNorm's affine gain and bias (stax's
    LayerNorm has none); torch's multi-head attention (stax's ``GlobalSelfAttention`` has
    no query / key / value biases and scales by ``1 / (d sqrt(d_key))``, so it cannot hold
    nn.MultiheadAttention's weights); token embeddings; the class token and position
    embedding; the ``[:, 0]`` readout.
    """
    import jax.numpy as jnp
    import numpy as np
    import torch
    from jax import lax
    from jax import nn as jnn
    from neural_tangents import stax

    def arr(t):
        return None if t is None else jnp.asarray(t.detach().cpu().numpy())

    def dense(lin, weight=None):
        W = arr(lin.weight).T if weight is None else weight
        return stax.Dense(lin.out_features, b_std=1.0, parameterization="standard"), \
            (W, arr(lin.bias))

    def conv(c):
        # OIHW -> HWIO, the layout of stax.Conv's default NHWC dimension numbers.
        W = jnp.transpose(arr(c.weight), (2, 3, 1, 0))
        b = None if c.bias is None else arr(c.bias).reshape(1, 1, 1, -1)
        k, pad, stride = c.kernel_size, c.padding, c.stride
        same = pad == (k[0] // 2, k[1] // 2) and stride == (1, 1)
        layer = stax.Conv(c.out_channels, k, stride, "SAME" if same else "VALID",
                          b_std=None if b is None else 1.0, parameterization="standard")
        if same or pad == (0, 0):
            return layer, (W, b)
        # "SAME" with a stride pads low 0 / high 1 where torch pads 1 / 1: torch's padding
        # explicitly, then a valid convolution.
        p = ((0, 0), (pad[0], pad[0]), (pad[1], pad[1]), (0, 0))
        return serial((_custom(lambda _, x: jnp.pad(x, p)), ()), (layer, (W, b)))

    def batchnorm(bn):
        # Eval mode: a per-channel affine map with fixed statistics; stax has no BatchNorm.
        mean, inv = arr(bn.running_mean), 1.0 / jnp.sqrt(arr(bn.running_var) + bn.eps)
        return _custom(lambda gb, x: (x - mean) * inv * gb[0] + gb[1]), \
            (arr(bn.weight), arr(bn.bias))

    def layernorm(ln):
        return stax.serial(stax.LayerNorm(axis=-1, eps=ln.eps),
                           _custom(lambda gb, x: x * gb[0] + gb[1])), \
            ((), (arr(ln.weight), arr(ln.bias)))

    def attention(mha):
        heads = mha.num_heads

        def apply(p, x):
            (Wi, bi), (Wo, bo) = p
            n, S, d = x.shape
            q, k, v = jnp.split(x @ Wi.T + bi, 3, axis=-1)
            q, k, v = (t.reshape(n, S, heads, d // heads).transpose(0, 2, 1, 3)
                       for t in (q, k, v))
            w = jnn.softmax(q @ k.transpose(0, 1, 3, 2) / np.sqrt(d // heads), axis=-1)
            return (w @ v).transpose(0, 2, 1, 3).reshape(n, S, d) @ Wo.T + bo

        return _custom(apply), ((arr(mha.in_proj_weight), arr(mha.in_proj_bias)),
                                (arr(mha.out_proj.weight), arr(mha.out_proj.bias)))

    def residual(main, shortcut=None):
        (lm, pm), (ls, ps) = main, shortcut or (stax.Identity(), ())
        return stax.serial(stax.FanOut(2), stax.parallel(lm, ls), stax.FanInSum()), \
            ((), (pm, ps), ())

    def serial(*pairs):
        return stax.serial(*(la for la, _ in pairs)), tuple(p for _, p in pairs)

    relu = (stax.Relu(), ())
    arch = spec.get("arch")
    nchw_to_nhwc = lambda X: jnp.asarray(X.permute(0, 2, 3, 1).numpy())  # noqa: E731
    if not arch:
        # stax has no tanh layer: Elementwise with the function alone (no NNGP integral,
        # which only the infinite-width kernel would need).
        linears = [m for m in module if isinstance(m, torch.nn.Linear)]
        pairs = []
        for lin in linears[:-1]:
            pairs += [dense(lin), (stax.Elementwise(fn=jnp.tanh), ())]
        layer, params = serial(*pairs, dense(linears[-1]))
        return layer[1], params, lambda X: jnp.asarray(X.numpy())

    if arch in ("cnn8", "cifar"):
        convs = [m for m in module if isinstance(m, torch.nn.Conv2d)]
        head = module[-1]
        # stax has no max pooling (no infinite-width limit): a reduce_window layer.
        pool = [(_custom(lambda _, x: lax.reduce_window(
            x, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")), ())] \
            if arch == "cifar" else []
        # torch flattens (C, H, W), stax.Flatten (H, W, C): the head's columns reordered.
        c = convs[-1].out_channels
        side = int(round((head.in_features // c) ** 0.5))
        Wh = arr(head.weight).reshape(-1, c, side, side).transpose(2, 3, 1, 0)
        layer, params = serial(conv(convs[0]), relu, *pool, conv(convs[1]), relu, *pool,
                               (stax.Flatten(), ()),
                               dense(head, Wh.reshape(-1, head.out_features)))
        return layer[1], params, nchw_to_nhwc

    if arch == "resnet":
        def block(b):
            main = serial(conv(b.conv1), batchnorm(b.bn1), relu, conv(b.conv2),
                          batchnorm(b.bn2))
            if isinstance(b.shortcut, torch.nn.Identity):
                return serial(residual(main), relu)
            return serial(residual(main, serial(conv(b.shortcut[0]),
                                                batchnorm(b.shortcut[1]))), relu)

        layer, params = serial(conv(module.stem[0]), batchnorm(module.stem[1]), relu,
                               *(block(b) for b in module.blocks),
                               (stax.GlobalAvgPool(), ()), dense(module.head))
        return layer[1], params, nchw_to_nhwc

    act = {"vit": (stax.Gelu(approximate=False), ()), "transformer": relu}[arch]

    def ffn(la):
        return serial(dense(la.linear1), act, dense(la.linear2))

    def encoder_layer(la):
        if la.norm_first:
            return serial(residual(serial(layernorm(la.norm1), attention(la.self_attn))),
                          residual(serial(layernorm(la.norm2), ffn(la))))
        return serial(residual(attention(la.self_attn)), layernorm(la.norm1),
                      residual(ffn(la)), layernorm(la.norm2))

    layers = [encoder_layer(la) for la in module.encoder.layers]
    if arch == "transformer":
        # stax has no embedding layer: a gather of the token rows, plus the positions'.
        embed = _custom(lambda p, ids: p[0][ids] + p[1][: ids.shape[1]])
        layer, params = serial((embed, (arr(module.tok.weight), arr(module.pos.weight))),
                               *layers, (stax.GlobalAvgPool(), ()), dense(module.head))
        return layer[1], params, lambda X: jnp.asarray(X.numpy())

    def tokens(p, x):
        n, h, w, d = x.shape
        x = x.reshape(n, h * w, d)  # row-major patches, torch's flatten(2) order
        return jnp.concatenate([jnp.broadcast_to(p[0], (n, 1, d)), x], axis=1) + p[1]

    layer, params = serial(conv(module.embed), (_custom(tokens), (arr(module.cls),
                                                                  arr(module.pos))),
                           *layers, layernorm(module.norm),
                           (_custom(lambda _, x: x[:, 0]), ()), dense(module.head))
    return layer[1], params, nchw_to_nhwc


# A peer's K must equal skpathkernel's to float32 precision, or its row fails: a time is
# only worth comparing for the same kernel (max |K - K_ref| / max |K_ref|).
RTOL = 1e-5


def _checked(name, K, module, params, X, output="trace"):
    """The peer's K against skpathkernel's engine, once before the timings; raises (the
    row then reads "failed" with this message) when they differ."""
    import numpy as np

    from skpathkernel._tangent import tangent_gram

    ref = tangent_gram(module, params, X, output=output).double().numpy()
    diff = float(np.abs(np.asarray(K, dtype=np.float64) - ref).max() / np.abs(ref).max())
    if not diff <= RTOL:
        raise RuntimeError(f"{name}'s K is not skpathkernel's: max |K - K_ref| / max |K_ref| "
                           f"= {diff:.1e} > {RTOL:.0e}")
    return diff


def nt_gram_case(spec):
    """neural-tangents ``empirical_ntk_fn``, STRUCTURED_DERIVATIVES, jit-compiled, on the
    same network written in ``stax`` with the torch weights copied in
    (:func:`_stax_network`)."""
    from benchmarks._serve import serve
    from benchmarks._worker import gram_problem

    module, params, X = gram_problem(spec)

    import jax
    import neural_tangents as nt

    f, jparams, to_input = _stax_network(module, spec)
    output = spec.get("output", "trace")
    if output != "trace":
        net, f = f, lambda p, x: net(p, x)[:, output:output + 1]
    # trace_axes=(-1,): the trace over the outputs, which neural-tangents averages, as
    # skpathkernel's trace does.
    ntk = jax.jit(nt.empirical_ntk_fn(
        f, trace_axes=(-1,), vmap_axes=0,
        implementation=nt.NtkImplementation.STRUCTURED_DERIVATIVES))
    xj = to_input(X)
    t0 = time.perf_counter()
    compiled = ntk.lower(xj, None, jparams).compile()
    compile_s = time.perf_counter() - t0

    def call():
        return compiled(xj, None, jparams).block_until_ready()

    serve(call, {"n_params": sum(p.numel() for p in params.values()), "compile_s": compile_s,
                 "rel_diff_vs_skpathkernel": _checked("neural-tangents", call(), module,
                                                      params, X, output),
                 "versions": f"jax {jax.__version__}, jaxlib {jax.lib.__version__}, "
                             f"neural-tangents {nt.__version__}"},
          lambda K: {})


def nng_gram_case(spec):
    """nngeometry's ``GramMatrix(model, loader)`` (PyTorch hooks, a ``(C, N, C, N)``
    result), as its documentation calls it, on the same module, then the trace over the
    outputs divided by C (``spec["output"]``: the Gram of that output alone, through
    ``function=``). One batch of all N samples, the loader nngeometry builds itself from
    a tuple of tensors."""
    from importlib.metadata import version

    import torch
    from nngeometry import GramMatrix
    from torch.utils.data import DataLoader, TensorDataset

    from benchmarks._serve import serve
    from benchmarks._worker import gram_problem

    module, params, X = gram_problem(spec)
    loader = DataLoader(TensorDataset(X), batch_size=len(X))
    output = spec.get("output", "trace")
    # nngeometry's own argument for a function of the model other than its output.
    function = None if output == "trace" else lambda x: module(x)[:, output:output + 1]

    def call():
        G = GramMatrix(module, loader, function=function).to_torch()
        return torch.einsum("inim->nm", G) / G.shape[0]

    serve(call, {"n_params": sum(p.numel() for p in params.values()),
                 "rel_diff_vs_skpathkernel": _checked("nngeometry", call(), module, params,
                                                      X, output),
                 "versions": f"nngeometry {version('nngeometry')}"},
          lambda K: {})


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
    {"nt_gram": nt_gram_case, "nng_gram": nng_gram_case,
     "skorch_training": skorch_training_case}[spec["kind"]](spec)
