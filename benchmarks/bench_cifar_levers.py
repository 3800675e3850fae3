"""The CIFAR CNN's Gram: where a call's time goes by aten operation, and its kernels'
alternatives in isolation (issue 31, session s49).

Subcommands (one torch thread, float32, CPU time ``time.process_time``, medians):

- ``ops``: one ``tangent_gram(net, params, X)`` call of ``cifar@1024`` (trace, default
  budget) under a ``TorchDispatchMode`` timing every aten call (CPU time and minor page
  faults around it, summed by operation and operand shapes), the SYRKs
  (``_gram._syrk_block``) as one line; after a warm-up call.
- ``syrk``: the Gram of a ``1024 x 193920`` float32 block (the CIFAR CNN's formed rows):
  SciPy's OpenBLAS SYRK on the rows (as :func:`skpathkernel._tangent._stacked._syrk`) and
  on the transposed layout, in slices of the columns, torch's (MKL's) full GEMM, MKL's
  upper triangle by 256-row strips, a SYRK of each diagonal square plus an MKL GEMM right
  of it (strips of 512 / 256 / 128 rows), and MKL's own SYRK (``mkl_blas_ssyrk``, a symbol
  of torch's statically linked MKL, called by ctypes: a measurement, not a route).
- ``gate``: the route's backprops through the second block's ReLU and 2 x 2 max-pool
  (:func:`skpathkernel._tangent._cnn._gate`) on a 23-row chunk of ten outputs, against one
  selection by ``torch.where`` or a product with a float mask.
- ``first``: the steps of :func:`skpathkernel._tangent._cnn.first_formed` on a 23-row
  chunk, and its gather into a reused buffer.
- ``cl``: the second convolution's input gradient on NCHW and on channels-last backprops,
  and forming its blocks from each layout (the route's one GEMM per sample; one per sample
  and output from channels-last backprops).
- ``cl-call``: that prototype in the call, by patching (not a route): the capture's
  buffers of the second convolution's backprops and of its input gradient's input
  channels-last (``_capture._buffer``), and its blocks formed by one GEMM per sample and
  output (``_gram.dense_grad``); an alternated A/B against the route
  (:func:`benchmarks.bench_vit_cuts_ab.alternated`, ``--reps`` rounds), then with
  ``--ops`` the prototype's operations as ``ops`` times them.

Usage: ``OMP_NUM_THREADS=1 taskset -c 1 python -m benchmarks.bench_cifar_levers
{ops,syrk,gate,first,cl,cl-call} [--reps R] [--ops]``. Results:
``benchmarks/results/cifar_levers-s49.md``.
"""

import argparse
import collections
import ctypes
import os
import resource
import statistics
import time
from contextlib import ExitStack
from unittest import mock

import torch
import torch.nn.functional as F
from scipy.linalg import blas
from threadpoolctl import threadpool_limits
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks import _worker
from benchmarks.bench_vit_cuts_ab import alternated
from skpathkernel._tangent import _capture, _cnn, _gram
from skpathkernel._tangent._gram import tangent_gram
from skpathkernel._tangent._layers import _unfold


def _median_ms(f, reps=21):
    ts = []
    for _ in range(reps):
        t = time.process_time()
        f()
        ts.append(time.process_time() - t)
    return 1e3 * statistics.median(ts)


def _table(fns, rounds=2, reps=21):
    for r in range(rounds):
        for f in fns:
            print(f"round {r}: {f.__name__:24s} {_median_ms(f, reps):8.3f} ms", flush=True)


class _Ops(TorchDispatchMode):
    def __init__(self, acc):
        super().__init__()
        self.acc = acc

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t = time.process_time()
        out = func(*args, **(kwargs or {}))
        dt = time.process_time() - t
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        shapes = tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))[:2]
        e = self.acc[(str(func), shapes)]
        e[0] += dt
        e[1] += 1
        e[2] += faults
        return out


def ops():
    net, params, X = _worker.gram_problem({"arch": "cifar", "n": 1024, "dtype": "float32"})
    acc = collections.defaultdict(lambda: [0.0, 0, 0])
    real = _gram._syrk_block

    def syrk(*a, **k):
        t = time.process_time()
        try:
            return real(*a, **k)
        finally:
            e = acc[("SYRKs (_syrk_block)", ())]
            e[0] += time.process_time() - t
            e[1] += 1

    _gram._syrk_block = syrk
    tangent_gram(net, params, X)  # warm-up
    acc.clear()
    t = time.process_time()
    with _Ops(acc):
        tangent_gram(net, params, X)
    print(f"call {time.process_time() - t:.3f} s CPU (with the mode's own cost); the "
          f"operations' sum {sum(v[0] for v in acc.values()):.3f} s")
    for (name, shapes), (cpu, calls, faults) in sorted(acc.items(), key=lambda kv: -kv[1][0]):
        if cpu >= 0.005:
            print(f"{cpu:7.3f} s {calls:4d} calls {faults:7d} faults  {name} {shapes}")


def syrk():
    threadpool_limits(1)
    n, W = 1024, 193920
    A = torch.randn(n, W)
    K = torch.zeros(n, n)
    flops = n * n * W  # the upper triangle's

    def into(Kv, Av, trans=1):
        c = Kv.numpy().T
        r = blas.ssyrk(1.0, Av.numpy().T if trans else Av, beta=1.0, c=c, trans=trans,
                       lower=1, overwrite_c=1)
        assert r.ctypes.data == c.ctypes.data

    def openblas_rows():
        K.zero_()
        into(K, A)

    def openblas_slices(width):
        def f():
            K.zero_()
            for s in range(0, W, width):
                into(K, A[:, s:s + width])
        f.__name__ = f"openblas_slices_{width}"
        return f

    def mkl_full():
        torch.mm(A, A.T, out=K)

    def mkl_strips():
        for s in range(0, n, 256):
            K[s:s + 256, s:].copy_(torch.mm(A[s:s + 256], A[s:].T))

    def split(b):
        def f():
            K.zero_()
            for s in range(0, n, b):
                e = min(s + b, n)
                T = torch.zeros(e - s, e - s)
                into(T, A[s:e])
                K[s:e, s:e] = T
                if e < n:
                    K[s:e, e:].addmm_(A[s:e], A[e:].T)
        f.__name__ = f"syrk_square_gemm_right_{b}"
        return f

    lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))

    def mkl_syrk():
        K.zero_()
        u, t, nn_, kk = ctypes.c_char(b"U"), ctypes.c_char(b"T"), ctypes.c_int64(n), \
            ctypes.c_int64(W)
        one = ctypes.c_float(1.0)
        lib.mkl_blas_ssyrk(ctypes.byref(u), ctypes.byref(t), ctypes.byref(nn_),
                           ctypes.byref(kk), ctypes.byref(one), ctypes.c_void_p(A.data_ptr()),
                           ctypes.byref(kk), ctypes.byref(one), ctypes.c_void_p(K.data_ptr()),
                           ctypes.byref(nn_))

    openblas_rows()
    want = torch.triu(K).clone()
    scale = want.abs().max().item()
    X, Y = torch.randn(1024, 4096), torch.randn(4096, 1024)
    probe = 2 * 1024 * 4096 * 1024 / _median_ms(lambda: torch.mm(X, Y), 5) / 1e6
    ob = 2 * 1024 * 4096 * 1024 / _median_ms(
        lambda: blas.sgemm(1.0, Y.numpy().T, X.numpy().T), 5) / 1e6
    print(f"probe: torch.mm 1024 x 4096 x 1024 {probe:.1f} GFLOP/s; OpenBLAS sgemm "
          f"{ob:.1f}", flush=True)
    cases = [(openblas_rows, 1), (openblas_slices(16384), 1), (openblas_slices(2048), 1),
             (mkl_full, 2), (mkl_strips, 1.25), (split(512), 1), (split(256), 1),
             (split(128), 1), (mkl_syrk, 1)]
    for f, work in cases:
        f()
        got = torch.tril(K).T if f is mkl_syrk else torch.triu(K)
        diff = (got - want).abs().max().item() / scale
        ms = _median_ms(f, 3)
        print(f"{f.__name__:28s} {ms / 1e3:.3f} s, {flops / ms / 1e6:6.1f} GFLOP/s of the "
              f"triangle's ({work * flops / ms / 1e6:6.1f} executed); rel. diff {diff:.1e}",
              flush=True)
    B = A.T.contiguous()
    A = None  # its memory freed: the closures above are done with it

    def openblas_columns():
        K.zero_()
        into(K, B.numpy().T, trans=0)

    ms = _median_ms(openblas_columns, 3)
    print(f"openblas_columns (W, n) rows {ms / 1e3:.3f} s, {flops / ms / 1e6:.1f} GFLOP/s")


def _chunk_gate(n=23, C=10, c=64, H=16, seed=0):
    torch.manual_seed(seed)
    z = torch.randn(n, c, H, H)
    pooled, idx = F.max_pool2d(torch.relu(z), 2, 2, 0, 1, False, True)
    return pooled, idx


def gate():
    n, C, c, H = 23, 10, 64, 16
    h = H // 2
    ref, idx = _chunk_gate(n, C, c, H)
    g = torch.randn(1, C, c, h, h)  # the head's gradient, shared by the samples
    old_out, new_out = torch.empty(n, C, c, H, H), torch.empty(n, C, c, H, H)

    def route():
        _cnn._gate(old_out, g, ref.unsqueeze(1), idx.unsqueeze(1))

    def mask():
        m = torch.zeros(n, 1, c, H * H, dtype=torch.bool)
        m.scatter_(3, idx.unsqueeze(1).flatten(3), True)
        m.view(n, 1, c, h, 2, h, 2).logical_and_(
            ref.le(0).logical_not_().view(n, 1, c, h, 1, h, 1))
        return m.view(n, 1, c, H, H)

    def upsampled():
        return g.unsqueeze(-1).unsqueeze(-3).expand(1, C, c, h, 2, h, 2).reshape(1, C, c, H, H)

    def where_views():
        torch.where(mask().view(n, 1, c, h, 2, h, 2), g.unsqueeze(-1).unsqueeze(-3),
                    g.new_zeros(()), out=new_out.view(n, C, c, h, 2, h, 2))

    def where_upsampled():
        torch.where(mask(), upsampled(), g.new_zeros(()), out=new_out)

    maskf = mask().float()

    def mul_float_mask():
        torch.mul(upsampled(), maskf, out=new_out)

    def mask_alone():
        mask()

    def zero_fill_alone():
        new_out.zero_()

    route()
    for f in (where_views, where_upsampled, mul_float_mask):
        f()
        print(f.__name__, "equal to the route's:", torch.equal(old_out, new_out))
    _table([route, where_views, where_upsampled, mul_float_mask, mask_alone,
            zero_fill_alone])


def first():
    n, C, c_out, S, L, q = 23, 10, 32, 1024, 256, 27
    torch.manual_seed(0)
    x = torch.randn(n, 3, 32, 32)
    _, idx = F.max_pool2d(torch.randn(n, c_out, 32, 32), 2, 2, 0, 1, False, True)
    pooled = torch.randn(n, c_out, C, 16, 16).transpose(1, 2)
    xp = F.pad(x, [1, 1, 1, 1])
    patches = _unfold(xp, (3, 3), (1, 1), (1, 1))
    rows = patches.transpose(1, 2).reshape(n * S, q)
    at = (idx.reshape(n, c_out * L) + torch.arange(n).mul_(S)[:, None]).reshape(-1)
    picked = rows.index_select(0, at).view(n * c_out, L, q)
    gg = pooled.flatten(3).transpose(1, 2).reshape(n * c_out, C, L)
    G = torch.bmm(gg, picked)
    buf = torch.empty(n * c_out * L, q)

    def pad():
        F.pad(x, [1, 1, 1, 1])

    def unfold():
        _unfold(xp, (3, 3), (1, 1), (1, 1))

    def rows_copy():
        patches.transpose(1, 2).reshape(n * S, q)

    def rows_from_padded_input():
        xp.as_strided((n, 32, 32, 3, 3, 3),
                      (xp.stride(0), 34, 1, xp.stride(1), 34, 1)).reshape(n * S, q)

    def index_select():
        rows.index_select(0, at)

    def index_select_reused():
        torch.index_select(rows, 0, at, out=buf)

    def bmm():
        torch.bmm(gg, picked)

    def bmm_transposed():
        torch.bmm(picked.transpose(1, 2), gg.transpose(1, 2))

    def weight_layout():
        G.view(n, c_out, C, q).transpose(1, 2).reshape(n, C, 1, c_out * q)

    def bias_sum():
        pooled.flatten(3).sum(3)

    _table([pad, unfold, rows_copy, rows_from_padded_input, index_select,
            index_select_reused, bmm, bmm_transposed, weight_layout, bias_sum])


def cl():
    n, C, p, c_in, H = 23, 10, 64, 32, 16
    S, q = H * H, c_in * 9
    torch.manual_seed(0)
    w = torch.randn(p, c_in, 3, 3)
    D = torch.randn(n, C, p, H, H)
    Dcl = D.permute(0, 1, 3, 4, 2).contiguous()  # each sample's and output's rows (H, W, p)
    a_in = torch.empty(n * C, c_in, H, H)
    a_cl = a_in.contiguous(memory_format=torch.channels_last)
    P = torch.randn(n, q, S)  # the patches as the route's unfold lays them out
    block = torch.empty(n, C * p * q)
    args = ([p], [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, False, False])

    def input_grad_nchw():
        return torch.ops.aten.convolution_backward(D.view(n * C, p, H, H), a_in, w,
                                                   *args)[0]

    def input_grad_channels_last():
        d = Dcl.view(n * C, H, H, p).permute(0, 3, 1, 2)
        return torch.ops.aten.convolution_backward(d, a_cl, w, *args)[0]

    def forming_route():  # dense_grad's "qp" order: (q x S) @ (S x C p) per sample
        d = D.view(n, C * p, S).transpose(1, 2)
        torch.bmm(P, d, out=block.view(n, q, C * p))

    def forming_channels_last():  # (q x S) @ (S x p) per sample and output
        out = block.view(n, C, q, p)
        for c in range(C):
            torch.bmm(P, Dcl[:, c].view(n, S, p), out=out[:, c])

    diff = (input_grad_nchw() - input_grad_channels_last()).abs().max().item()
    print(f"input gradient, channels-last against NCHW: max abs diff {diff:.2g}")
    _table([input_grad_nchw, input_grad_channels_last, forming_route,
            forming_channels_last], reps=11)


def _cl_buffer(real):
    def buffer(scratch, j, shape, like):
        if len(shape) == 5 and j == 1:  # the second convolution's backprops (n, C, p, H, W)
            n, C, p, H, W = shape
            return real(scratch, j, (n, C, H, W, p), like).permute(0, 1, 4, 2, 3)
        if len(shape) == 4 and j == 3:  # the placeholder input of its input gradient
            N, c, H, W = shape
            return real(scratch, j, (N, H, W, c), like).permute(0, 3, 1, 2)
        return real(scratch, j, shape, like)
    return buffer


def _cl_dense_grad(real):
    def dense_grad(term, a, out=None, order="flat"):
        delta = term.delta
        if (a is not None and delta.dim() == 4 and delta.is_contiguous() and delta.shape[2] > 1
                and term.groups == 1 and not term.transposed and term.rows is None
                and out is not None and out.is_contiguous()):
            n, C, S, p = delta.shape
            o = out.view(n, C, p, a.shape[2])  # the route's (C, p, q) order of a row
            for c in range(C):
                o[:, c] = torch.bmm(delta[:, c].transpose(1, 2), a)
            return out
        return real(term, a, out=out, order=order)
    return dense_grad


def _cl_side(name):
    stack = ExitStack()
    if name == "new":
        stack.enter_context(mock.patch.object(_capture, "_buffer",
                                              _cl_buffer(_capture._buffer)))
        stack.enter_context(mock.patch.object(_gram, "dense_grad",
                                              _cl_dense_grad(_gram.dense_grad)))
    return stack


def cl_call(reps, with_ops):
    alternated(["cifar@1024"], reps, False, _cl_side)
    if with_ops:
        with _cl_side("new"):
            ops()


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("what", choices=["ops", "syrk", "gate", "first", "cl", "cl-call"])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--ops", action="store_true")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(args.what, time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "load",
          os.getloadavg(), flush=True)
    {"ops": ops, "syrk": syrk, "gate": gate, "first": first, "cl": cl,
     "cl-call": lambda: cl_call(args.reps, args.ops)}[args.what]()
    print("load after", os.getloadavg())


if __name__ == "__main__":
    main()
