"""What the refusal's bytes per sample count on the probe's ResNet (torchvision's
resnet18 widths at WIDTH 64): ``python refusal.py WIDTH DTYPE``; diagnostics only."""

# ruff: noqa: E501
import sys

import probe

import skpathkernel._analysis._decomposition as D

orig = D._run


def run(*a, **k):
    P, itemsize, row, node = k["P"], k["itemsize"], k["row"], k["node"]
    n_res = len(k["outputs"])
    print(
        f"P={P:,} itemsize={itemsize} node (one sample's factors, pair layout)={node[0]:,} largest term={node[1]:,} row=4*node+input={row:,}"
    )
    print(
        f"  q_bytes ~ 2 copies * 4 rows = {8 * row:,}; b_bytes ~ row = {row:,}; fixed STEP_VECTORS*8*P = {8 * 8 * P:,}; node points 2*P*itemsize = {2 * P * itemsize:,}; n_res={n_res}"
    )
    return orig(*a, **k)


D._run = run
try:
    probe.main(int(sys.argv[1]), 4, 2**30, sys.argv[2])
except ValueError as e:
    print(str(e)[:300])
print(f"peak RSS {probe.hwm() / 2**20:.0f} MiB")
