"""Review s51: resident memory of a ``PathRecorder`` loop that reads its path every 10
steps, in a fresh process per run: ``VmHWM`` above the high-water mark after a warm-up
of the same training without a recorder, against ``memory_budget``; and the process's
memory mappings and ``VmRSS`` after 40 recorders made, read and dropped.

    python -m benchmarks.bench_review_segments_memory SIDE P BUDGET_MIB STORAGE
(SIDE: base, the bad1034 copy ``skpk_base`` on ``sys.path``, or tree)
"""

import gc
import importlib
import json
import sys

import torch

from benchmarks.bench_recording_segments import OPTIMIZERS, _data, _net, _step
from benchmarks.bench_recording_segments import _vm as vm


def maps():
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


def main():
    side, n_params, budget_mib, storage = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), \
        sys.argv[4]
    pkg = importlib.import_module({"base": "skpk_base", "tree": "skpathkernel"}.get(side, side))
    torch.set_num_threads(1)
    budget = budget_mib * 2**20
    net = _net(n_params)
    P = sum(p.numel() for p in net.parameters())
    steps = int(0.9 * budget / (4 * P)) - 1  # 0.9 of the budget, SGD (no state)
    X, y = _data(net)
    opt = OPTIMIZERS["sgd"](net.parameters())
    for step in range(3):
        _step(net, opt, X, y, None, step)
    base = vm("VmHWM")
    rec = pkg.PathRecorder(net, opt, n_samples=len(X), storage=storage,
                           memory_budget=budget)
    for step in range(steps):
        _step(net, opt, X, y, rec, step)
        if (step + 1) % 10 == 0:
            rec.trajectory.parameters(-1)
    traj = rec.trajectory
    out = dict(side=side, P=P, budget_mib=budget_mib, storage=storage, points=len(traj),
               path_mib=len(traj) * P * 4 / 2**20, kept=traj.storage,
               hwm_mib=(vm("VmHWM") - base) / 2**20)
    rec.close()
    del rec, traj
    gc.collect()
    # Drop test: small recorders made, read mid-way and at the end, dropped.
    for r in range(45):
        small = _net(20_000)  # its own: a recorder not closed stays in its hooks
        Xs, ys = _data(small)
        if r == 5:
            gc.collect()
            maps0, rss0 = maps(), vm("VmRSS")
        o = OPTIMIZERS["adam"](small.parameters())
        rec = pkg.PathRecorder(small, o, n_samples=len(Xs))
        for step in range(150):
            _step(small, o, Xs, ys, rec, step)
            if step == 100:
                rec.trajectory.parameters(0)
        rec.trajectory.parameters(0)
        rec.close()  # a recorder not closed stays alive with its optimizer (bad1034 too)
        del rec, o, small
    gc.collect()
    out.update(maps_growth=maps() - maps0, rss_growth_mib=(vm("VmRSS") - rss0) / 2**20)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
