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
    ``LayerNorm``, ``GlobalSelfAttention``, ``Index``), its parameters the torch weights,
    transposed to stax's layouts.

    Returns ``(apply_fn, params, to_input)``: ``to_input`` maps the torch inputs to the
    stax ones (NCHW -> NHWC; token ids -> one-hot rows). ``parameterization="standard"``
    makes ``Dense`` / ``Conv`` compute ``x W + b`` as torch does (the default "ntk" scales
    by ``1 / sqrt(fan_in)``, another function with another tangent kernel); stax's
    attention scales are set the same way, so that every stax parameter is a torch one
    and the two functions, hence their tangent kernels, are the same. Custom layers
    (:func:`_custom`) stand in where stax has no layer for the torch one, each for a
    reason given where it is used: max pooling; BatchNorm in eval mode; LayerNorm's affine
    gain and bias (stax's LayerNorm has none); the constant channel that carries the
    attention's query / key / value biases; a learned position embedding added to the
    tokens; the class token.
    """
    import jax.numpy as jnp
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
        # stax.GlobalSelfAttention holds per-head query / key / value matrices without
        # biases: a constant channel of ones appended to its input carries torch's
        # in_proj biases as the matrices' last rows (the same parameters, so the same
        # function and tangent kernel). Its scores are scaled by W_query_std * W_key_std
        # / (d_in sqrt(d_head)) and its output by W_out_std * W_value_std
        # / sqrt(d_head heads d_in): the stds below make them torch's 1 / sqrt(d_head)
        # and 1.
        heads, d = mha.num_heads, mha.embed_dim
        dh, d_in = d // heads, d + 1
        W, b = arr(mha.in_proj_weight), arr(mha.in_proj_bias)

        def per_head(i):  # torch's rows i d .. (i + 1) d, head h at h dh .. (h + 1) dh
            Wb = jnp.concatenate([W[i * d:(i + 1) * d].T, b[None, i * d:(i + 1) * d]])
            return Wb.reshape(d_in, heads, dh).transpose(1, 0, 2)  # (heads, d_in, dh)

        # stax concatenates the heads' channels head-fastest (index v heads + h), torch
        # head-slowest (h dh + v): out_proj's input rows reordered.
        Wo = arr(mha.out_proj.weight).T.reshape(heads, dh, d).transpose(1, 0, 2)
        layer = stax.GlobalSelfAttention(
            d, dh, dh, heads, linear_scaling=False, W_query_std=float(d_in),
            W_out_std=float(dh * heads * d_in) ** 0.5, b_std=1.0)
        ones = _custom(lambda _, x: jnp.concatenate(
            [x, jnp.ones(x.shape[:-1] + (1,), x.dtype)], axis=-1))
        return serial((ones, ()), (layer, (per_head(0), per_head(1), per_head(2),
                                           Wo.reshape(dh * heads, d),
                                           arr(mha.out_proj.bias).reshape(1, 1, d), None)))

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
        # stax has no embedding layer: one-hot token rows through a bias-free Dense (the
        # same parameters as the embedding), then the position rows added, for which
        # stax has no layer (GlobalSelfAttention's own position embedding enters only
        # its first attention, not the residual stream).
        tok = arr(module.tok.weight)
        add_pos = _custom(lambda p, x: x + p[: x.shape[1]])
        layer, params = serial((stax.Dense(tok.shape[1], parameterization="standard"),
                                (tok, None)),
                               (add_pos, arr(module.pos.weight)),
                               *layers, (stax.GlobalAvgPool(), ()), dense(module.head))
        vocab = tok.shape[0]
        return layer[1], params, lambda X: jnn.one_hot(jnp.asarray(X.numpy()), vocab,
                                                       dtype=tok.dtype)

    def tokens(p, x):
        n, h, w, d = x.shape
        x = x.reshape(n, h * w, d)  # row-major patches, torch's flatten(2) order
        return jnp.concatenate([jnp.broadcast_to(p[0], (n, 1, d)), x], axis=1) + p[1]

    layer, params = serial(conv(module.embed), (_custom(tokens), (arr(module.cls),
                                                                  arr(module.pos))),
                           *layers, layernorm(module.norm),
                           (stax.Index(idx=stax.Slice[:, 0]), ()), dense(module.head))
    return layer[1], params, nchw_to_nhwc


# A peer's K must equal skpathkernel's to float32 precision, or its row fails: a time is
# only worth comparing for the same kernel (max |K - K_ref| / max |K_ref|).
RTOL = 1e-5
# The float64 recheck's bound: both float64 Ks of the same function agree far below it.
RTOL64 = 1e-10
# Samples of the float64 recheck: those whose K rows differ most, up to this many.
RECHECK_N = 64


def _rel_diff(K, ref):
    import numpy as np

    return float(np.abs(np.asarray(K, dtype=np.float64) - ref).max() / np.abs(ref).max())


def _checked(name, K, module, params, X, output="trace", recheck=None):
    """The peer's K against skpathkernel's engine, once before the timings; the info
    entries of the row. Raises (the row then reads "failed" with this message) when they
    differ past ``RTOL``, unless ``recheck`` shows why.

    A ReLU or max-pool network is piecewise smooth: a sample whose pre-activation or
    pooling window sits within float32 rounding of a kink takes the kink's one side in
    torch's float32 forward and may take the other in another framework's, which
    rounds the same sums in another order; the Jacobian rows of that sample then
    differ by O(1), not by rounding. ``recheck(module64, x64)``, the peer's K of the
    float64 copy of the module on float64 samples, tells the two apart: on the
    ``RECHECK_N`` samples whose rows differ most, the float64 Ks of both must agree to
    ``RTOL64``, or the row fails.
    """
    import copy

    import numpy as np
    import torch

    from skpathkernel._tangent import tangent_gram

    ref = tangent_gram(module, params, X, output=output).double().numpy()
    diff = _rel_diff(K, ref)
    info = {"rel_diff_vs_skpathkernel": diff}
    if diff <= RTOL:
        return info
    message = (f"{name}'s K is not skpathkernel's: max |K - K_ref| / max |K_ref| "
               f"= {diff:.1e} > {RTOL:.0e}")
    if recheck is None:
        raise RuntimeError(message)
    bad = np.abs(np.asarray(K, dtype=np.float64) - ref) > RTOL * np.abs(ref).max()
    count = bad.sum(1)
    index = np.sort(np.argsort(-count, kind="stable")[:RECHECK_N])
    module64 = copy.deepcopy(module).double()
    params64 = {k: v.double() for k, v in module64.named_parameters()}
    x64 = X[torch.as_tensor(index)]
    x64 = x64.double() if x64.is_floating_point() else x64
    ref64 = tangent_gram(module64, params64, x64, output=output).numpy()
    diff64 = _rel_diff(recheck(module64, x64), ref64)
    if not diff64 <= RTOL64:
        raise RuntimeError(f"{message}; in float64 on the {len(index)} samples whose rows "
                           f"differ most, {diff64:.1e} > {RTOL64:.0e}")
    # The samples at a kink: each one's row differs from most others, while a partner's
    # differs from the kink samples' alone.
    kinks = [int(i) for i in np.flatnonzero((count > 1) & (4 * count > count.max()))]
    info["float64_recheck"] = {"rel_diff": diff64, "n": len(index), "samples": kinks}
    return info


def nt_gram_case(spec):
    """neural-tangents ``empirical_ntk_fn``, STRUCTURED_DERIVATIVES, jit-compiled, on the
    same network written in ``stax`` with the torch weights copied in
    (:func:`_stax_network`)."""
    from benchmarks._serve import serve
    from benchmarks._worker import gram_problem

    module, params, X = gram_problem(spec)

    import jax
    import neural_tangents as nt
    from jax.experimental import enable_x64

    output = spec.get("output", "trace")

    def ntk_fn(module):
        f, jparams, to_input = _stax_network(module, spec)
        if output != "trace":
            f = (lambda net: lambda p, x: net(p, x)[:, output:output + 1])(f)
        # trace_axes=(-1,): the trace over the outputs, which neural-tangents averages,
        # as skpathkernel's trace does.
        ntk = jax.jit(nt.empirical_ntk_fn(
            f, trace_axes=(-1,), vmap_axes=0,
            implementation=nt.NtkImplementation.STRUCTURED_DERIVATIVES))
        return ntk, jparams, to_input

    def recheck(module64, x64):
        with enable_x64():
            ntk, jparams, to_input = ntk_fn(module64)
            return ntk(to_input(x64), None, jparams).block_until_ready()

    ntk, jparams, to_input = ntk_fn(module)
    xj = to_input(X)
    t0 = time.perf_counter()
    compiled = ntk.lower(xj, None, jparams).compile()
    compile_s = time.perf_counter() - t0

    def call():
        return compiled(xj, None, jparams).block_until_ready()

    serve(call, {"n_params": sum(p.numel() for p in params.values()), "compile_s": compile_s,
                 **_checked("neural-tangents", call(), module, params, X, output, recheck),
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
                 **_checked("nngeometry", call(), module, params, X, output),
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
