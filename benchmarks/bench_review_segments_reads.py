"""Review s51: the CPU time of a recorded loop that reads ``rec.trajectory`` often (every
step, every 10 steps, or saves it every 50 steps, as a user checkpointing might), this
tree against bad1034 (``--base``: a copy of bad1034's ``skpathkernel`` renamed
``skpk_base``), alternating in one process, pinned by the caller, medians.

    taskset -c 0 python -m benchmarks.bench_review_segments_reads --base /tmp/b --out f.json
"""

import argparse
import json
import os
import statistics
import tempfile
import time

import torch

from benchmarks.bench_recording_segments import OPTIMIZERS, _data, _load, _net, _step

CASES = [  # optimizer, parameters, steps, record_every, read ("every N" or "save N")
    ("adam", 300_000, 300, 1, ("read", 1)),
    ("adam", 300_000, 300, 1, ("read", 10)),
    ("adam", 300_000, 300, 3, ("read", 1)),
    ("sgd", 20_000, 1000, 1, ("read", 1)),
    ("adam", 300_000, 300, 1, ("save", 50)),
    ("adam", 300_000, 300, 1, ("none", 0)),
]


def run(pkg, opt_name, n_params, steps, every, read, directory):
    net = _net(n_params)
    X, y = _data(net)
    opt = OPTIMIZERS[opt_name](net.parameters())
    t0 = time.process_time()
    rec = pkg.PathRecorder(net, opt, n_samples=len(X), record_every=every)
    kind, n = read
    for step in range(steps):
        _step(net, opt, X, y, rec, step)
        if kind == "read" and (step + 1) % n == 0:
            rec.trajectory.parameters(-1)
        elif kind == "save" and (step + 1) % n == 0:
            rec.trajectory.save(os.path.join(directory, f"p{step}"))
    rec.trajectory.parameters(0)
    out = time.process_time() - t0
    rec.close()
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--base", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cases", type=int, nargs="*", help="indices into CASES")
    args = parser.parse_args()
    torch.set_num_threads(1)
    old, new = _load(args.base)
    rows = alternated({"base": old, "tree": new},
                      CASES if args.cases is None else [CASES[i] for i in args.cases],
                      args.rounds)
    json.dump(rows, open(args.out, "w"), indent=1)


def alternated(sides, cases, rounds):
    """Each case's :func:`run` by both ``sides`` (modules), alternating, ``rounds``
    times: a row of medians and every round's time per case."""
    rows = []
    for case in cases:
        times = {s: [] for s in sides}
        for r in range(rounds):
            for side in (list(sides) if r % 2 == 0 else list(sides)[::-1]):
                with tempfile.TemporaryDirectory() as d:
                    times[side].append(run(sides[side], *case, d))
        row = dict(case=f"{case[0]} P={case[1]} steps={case[2]} every={case[3]} "
                        f"{case[4][0]} {case[4][1]}",
                   base=statistics.median(times["base"]),
                   tree=statistics.median(times["tree"]),
                   base_all=times["base"], tree_all=times["tree"],
                   load=os.getloadavg()[0])
        rows.append(row)
        print(row, flush=True)
    return rows


if __name__ == "__main__":
    main()
