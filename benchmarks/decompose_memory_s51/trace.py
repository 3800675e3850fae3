"""Plan and node counts of decompose on the probe's ResNet (diagnostics only)."""

# ruff: noqa: E501
import sys

import probe

import skpathkernel._analysis._decomposition as D

orig_rpb = D.rows_per_block


def rpb(budget, row_bytes, what):
    out = orig_rpb(budget, row_bytes, what)
    print(
        f"rows_per_block({budget / 2**20:.1f} MiB, {row_bytes / 2**20:.2f} MiB, {what[:40]!r}) = {out}; rss {probe.rss() / 2**20:.0f} MiB"
    )
    return out


D.rows_per_block = rpb
ofb = D._factored_block


def fb(ctx, Xq, rows, chunks, **k):
    print(
        "block",
        rows,
        [c for c, _ in chunks],
        "b_block",
        ctx.b_block,
        "node_points",
        ctx.node_points,
        "ahead",
        ctx.ahead_bytes / 2**20,
        "row",
        ctx.row_bytes / 2**20,
    )
    return ofb(ctx, Xq, rows, chunks, **k)


D._factored_block = fb
onodes = D._NodesAhead.nodes


def nodes(self, j, n, X, W, rows, ahead):
    out = onodes(self, j, n, X, W, rows, ahead)
    print(
        f"  step {j} n={n} rows={rows.start}:{rows.stop} width={len(out)} bytes={D._nbytes(out) / 2**20:.0f} MiB rss={probe.rss() / 2**20:.0f} MiB"
    )
    return out


D._NodesAhead.nodes = nodes
probe.main(int(sys.argv[1]), int(sys.argv[2]), int(float(sys.argv[3])), sys.argv[4])
