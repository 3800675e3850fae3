"""The kernels behind the plain-CNN capture's choices, in isolation (issue 31, s47).

On the CIFAR CNN's shapes (a 16-row chunk, ten outputs, float32, one thread), the median
``time.process_time`` of 15 calls after a warm-up, each case twice:

- the second convolution's input gradient (``aten.convolution_backward``, input gradient
  only): once per output on the chunk's rows (autograd's calls) against once on the
  ``n C`` rows; its input operand a reused tensor of the right shape, a fresh one each
  call, or a stride-0 expansion; channels_last operands with and without converting the
  backprops into that layout first;
- the first convolution's backprops through max-pool and ReLU for every output:
  autograd's operations per output (max-pool backward, threshold backward, the copy into
  the buffer) against one threshold at the pooled resolution then zero fill and
  scatter-add for all the outputs, and a ``torch.where`` over the window's view;
- the second convolution's forward on NCHW and channels_last operands, and forming the
  first convolution's blocks in either order of their rows;
- the first convolution's weight and bias gradients formed from its backprops (the route)
  or from the pooled backprops and the patches gathered at the pool's argmax.

Usage: ``OMP_NUM_THREADS=1 taskset -c 0 python -m benchmarks.bench_cnn_route_kernels``.
Results: ``benchmarks/results/cnn_route_ab-s47.md``.
"""

import os
import time

import torch
import torch.nn.functional as F


def _median_ms(f, reps=15):
    f()
    ts = []
    for _ in range(reps):
        s = time.process_time()
        f()
        ts.append(time.process_time() - s)
    return sorted(ts)[reps // 2] * 1000


def main():
    torch.set_num_threads(1)
    torch.manual_seed(0)
    cb = torch.ops.aten.convolution_backward
    n, C = 16, 10
    W = torch.randn(64, 32, 3, 3)
    x = torch.randn(n, 32, 16, 16)
    d = torch.randn(n, C, 64, 16, 16)
    rows = (n * C, 32, 16, 16)
    reused = x.unsqueeze(1).expand(n, C, 32, 16, 16).reshape(rows)
    cl = torch.channels_last
    d_cl, reused_cl, W_cl = (d.view(n * C, 64, 16, 16).contiguous(memory_format=cl),
                             reused.contiguous(memory_format=cl), W.contiguous(memory_format=cl))
    args = ([64], [1, 1], [1, 1], [1, 1], False, [0, 0], 1, [True, False, False])

    def per_output():
        return [cb(d[:, i].contiguous(), x, W, *args)[0] for i in range(C)]

    def batched(inp=None, grad=None, weight=W):
        return cb(d.view(n * C, 64, 16, 16) if grad is None else grad,
                  reused if inp is None else inp, weight, *args)[0]

    cases = {
        "per output (autograd's calls)": per_output,
        "n C rows, reused input": batched,
        "n C rows, fresh input each call": lambda: batched(x.new_empty(rows)),
        "n C rows, stride-0 input": lambda: batched(x.new_empty(()).expand(rows)),
        "n C rows, channels_last, backprops converted": lambda: batched(
            reused_cl, d.view(n * C, 64, 16, 16).contiguous(memory_format=cl), W_cl),
        "n C rows, channels_last, no conversion": lambda: batched(reused_cl, d_cl, W_cl),
    }
    same = torch.equal(torch.stack(per_output(), 1).reshape(rows), batched())
    print(f"conv2 input gradient: per output == n C rows bit for bit: {same}")
    flops = 2 * n * C * 64 * 288 * 256 / 1e9
    for _ in range(2):
        for name, f in cases.items():
            ms = _median_ms(f)
            print(f"  {name}: {ms:.2f} ms ({flops / ms * 1e3:.0f} GFLOP/s)", flush=True)

    z = torch.randn(n, 32, 32, 32)
    r = torch.relu(z)
    pooled, idx = F.max_pool2d(r, 2, 2, 0, 1, False, True)
    buf = torch.empty(n, C, 32, 32, 32)
    g = torch.randn(n, C, 32, 16, 16)
    keep = torch.zeros(n, 32, 1024, dtype=torch.bool).scatter_(2, idx.flatten(2), True)
    keep = keep.view(z.shape) & (r > 0)

    def autograd_ops():
        for i in range(C):
            gp = torch.ops.aten.max_pool2d_with_indices_backward(
                g[:, i], r, [2, 2], [2, 2], [0, 0], [1, 1], False, idx)
            buf[:, i].copy_(torch.ops.aten.threshold_backward(gp, r, 0))

    def route():
        gg = torch.ops.aten.threshold_backward(g, pooled.unsqueeze(1), 0)
        buf.zero_()
        src = gg.flatten(-2)
        buf.flatten(-2).scatter_add_(-1, idx.unsqueeze(1).expand(gg.shape).flatten(-2), src)

    def where_window():
        o = buf.unflatten(-1, (16, 2)).unflatten(-3, (16, 2))
        m = keep.unsqueeze(1).unflatten(-1, (16, 2)).unflatten(-3, (16, 2))
        torch.where(m, g[..., None, :, None], g.new_zeros(()), out=o)

    autograd_ops()
    ref = buf.clone()
    route()
    print(f"conv1 backprops: route == autograd's bit for bit: {torch.equal(ref, buf)}")
    for _ in range(2):
        for name, f in [("autograd's ops per output", autograd_ops),
                        ("threshold, zero fill, scatter-add (all outputs)", route),
                        ("where over the windows' view", where_window)]:
            print(f"  {name}: {_median_ms(f):.2f} ms", flush=True)
    # The second convolution's forward on 64 rows, NCHW against channels_last operands
    # (the rows already converted).
    x64, w2 = torch.randn(64, 32, 16, 16), torch.randn(64, 32, 3, 3)
    x64_cl, w2_cl = x64.contiguous(memory_format=cl), w2.contiguous(memory_format=cl)
    for _ in range(2):
        print(f"conv2 forward, 64 rows: NCHW {_median_ms(lambda: F.conv2d(x64, w2, padding=1)):.2f}"
              f" ms, channels_last {_median_ms(lambda: F.conv2d(x64_cl, w2_cl, padding=1)):.2f}"
              " ms", flush=True)
    # Forming the first convolution's blocks on a 16-row chunk into cold output: the
    # engine's order for 27-wide rows, (q x S) @ (S x C p), against (C p x S) @ (S x q).
    p, S, q = 32, 1024, 27
    dT = torch.randn(n, C * p, S)
    patches = torch.randn(n, q, S)
    cold_qp, cold_pq = torch.empty(64, n, q, C * p), torch.empty(64, n, C * p, q)
    i = [0]

    def qp():
        i[0] = (i[0] + 1) % 64
        torch.bmm(patches, dT.transpose(1, 2), out=cold_qp[i[0]])

    def pq():
        i[0] = (i[0] + 1) % 64
        torch.bmm(dT, patches.transpose(1, 2), out=cold_pq[i[0]])

    for _ in range(2):
        print(f"conv1 forming, 16 rows: q x C p {_median_ms(qp, 21):.2f} ms, "
              f"C p x q {_median_ms(pq, 21):.2f} ms", flush=True)
    # The first convolution's weight and bias gradients from its backprops (what the
    # route does: the gate into the buffer, forming by one GEMM per sample over the 1024
    # positions, the bias's sum) against from the pooled backprops (its ReLU-gated
    # gradients at the 256 argmax positions and the patches gathered there per channel:
    # a quarter of the products, no buffer; other sums, not the same bits).
    patches_qs = torch.randn(n, q, S)
    formed_cold = torch.empty(64, n, q, C * p)
    gathered_cold = torch.empty(64, n * p, C, q)

    def from_backprops():
        i[0] = (i[0] + 1) % 64
        route()
        torch.bmm(patches_qs, buf.view(n, C * p, S).transpose(1, 2), out=formed_cold[i[0]])
        return formed_cold[i[0]], buf.flatten(-2).sum(-1)

    def from_pooled():
        i[0] = (i[0] + 1) % 64
        gg = torch.ops.aten.threshold_backward(g, pooled.unsqueeze(1), 0)
        rows = patches_qs.transpose(1, 2).reshape(n * S, q)
        at = (idx.flatten(2) + (torch.arange(n) * S).view(n, 1, 1)).flatten()
        picked = rows.index_select(0, at).view(n * p, 256, q)
        torch.bmm(gg.flatten(-2).transpose(1, 2).reshape(n * p, C, 256), picked,
                  out=gathered_cold[i[0]])
        return gathered_cold[i[0]], gg.flatten(-2).sum(-1)

    (a, b), (c, e) = from_backprops(), from_pooled()
    diff = (a.view(n, q, C, p).permute(0, 3, 2, 1) - c.view(n, p, C, q)).abs().max()
    print(f"conv1 weight gradients from the pooled backprops: max abs diff {diff:.1e} "
          f"(bias {(b - e).abs().max():.1e})")
    for _ in range(2):
        print(f"  from the backprops {_median_ms(from_backprops):.2f} ms, from the pooled "
              f"backprops {_median_ms(from_pooled):.2f} ms", flush=True)
    print("load average", os.getloadavg())


if __name__ == "__main__":
    main()
