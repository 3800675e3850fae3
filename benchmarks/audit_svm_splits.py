"""TangentFeatureSVM() and PathKernelClassifier() against MLPClassifier() over many splits.

Reads the per-split records of ``bench_svm_auto_ab`` (its ``default`` column is
``TangentFeatureSVM()``, ``net`` the same trained network's own predictions, which are
``PathKernelClassifier()``'s: the same seed, split and scaler, bit for bit; ``mlp``
``MLPClassifier()``; all in ``bench_defaults``' StandardScaler pipelines, seed ``s`` =
``train_test_split(random_state=s)`` = every estimator's ``random_state``) and prints,
per data set and seed range, the mean paired difference ours - MLPClassifier with two
standard errors:

- the naive one, ``s / sqrt(J)``: the error of the mean over random splits *of this data
  set*, the question "is the deficit real on these rows" (the splits are independent
  draws given the rows);
- Nadeau & Bengio's corrected one (``benchmarks._stats.paired``), which counts the
  splits' overlap: the question "would it hold on another sample of the same size". It
  does not shrink below ``sqrt(n_test / n_train) * s`` however many splits are drawn.

and the splits where ours is below / equal to / above MLPClassifier, with the net count
of test samples (the sum over the splits of the difference in correct predictions).
Records of one (set, seed) in several files are merged (the later file's fields win).
Usage::

    python -m benchmarks.audit_svm_splits FILE.jsonl [FILE.jsonl ...] [--ranges 0:200,200:400]
"""

import json
import sys

import numpy as np

from benchmarks._stats import paired, split_ratio

from .bench_svm_normalize_ab import SETS


def main(argv):
    ranges = None
    if "--ranges" in argv:
        i = argv.index("--ranges")
        ranges = [tuple(int(x) for x in r.split(":")) for r in argv[i + 1].split(",")]
        argv = argv[:i] + argv[i + 2 :]
    merged: dict = {}
    for path in argv:
        for line in open(path):
            r = json.loads(line)
            merged.setdefault((r["set"], r["seed"]), {}).update(r)
    sets = list(dict.fromkeys(s for s, _ in merged))
    print(
        "| data set | seeds | estimator | splits | MLPClassifier | ours - MLPClassifier "
        "| +- 2 naive SE | +- 2 corrected SE | below / equal / above | net test samples |"
    )
    print("|---" * 10 + "|")
    for name in sets:
        n = len(SETS[name]()[1])
        ratio = split_ratio(n)
        n_test = int(np.ceil(0.25 * n))
        seeds = sorted(s for t, s in merged if t == name)
        spans = [
            (lo, hi)
            for lo, hi in (ranges or [(seeds[0], seeds[-1] + 1)])
            if any(lo <= s < hi for s in seeds)
        ]
        if ranges and len(spans) > 1:
            spans.append((min(lo for lo, _ in spans), max(hi for _, hi in spans)))
        for lo, hi in spans:
            for key, label in (
                ("default", "TangentFeatureSVM()"),
                ("net", "PathKernelClassifier()"),
            ):
                rs = [merged[name, s] for s in seeds if lo <= s < hi and key in merged[name, s]]
                if len(rs) < 2:
                    continue
                p = paired([r[key] for r in rs], [r["mlp"] for r in rs], ratio)
                d = np.rint(
                    (np.array([r[key] for r in rs]) - np.array([r["mlp"] for r in rs])) * n_test
                ).astype(int)
                got = sorted(r["seed"] for r in rs)
                print(
                    f"| {name} | {got[0]}-{got[-1]} | {label} | {p.splits} | "
                    f"{np.mean([r['mlp'] for r in rs]):.4f} | {p.mean:+.4f} | "
                    f"+-{2 * p.naive_se:.4f} | +-{2 * p.se:.4f} | "
                    f"{(d < 0).sum()} / {(d == 0).sum()} / {(d > 0).sum()} | {d.sum():+d} |"
                )


if __name__ == "__main__":
    main(sys.argv[1:])
