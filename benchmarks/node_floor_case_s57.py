"""The node counts of the s56 small-budget case (decompose_cuts-s56.md, section 2),
old (OLD.py, another commit's ``_decomposition.py``) against this commit: per path
(thinned / every step), budget and queries, the choice's counts, failed / capped /
floored steps, warnings, and contribution_error against a float64 16-node
decomposition of the every-step path. V=1 prints the tries of one run.

Run: OMP_NUM_THREADS=1 taskset -c 0 python benchmarks/node_floor_case_s57.py OLD.py [old|new]
(results: benchmarks/results/node_floor-s57.md)
"""
import os
import sys
import warnings

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
import audit_contribution_error as ace
from contribution_check_overhead import load_old

from skpathkernel import PathKernelMachine
from skpathkernel._analysis import _decomposition as new
from skpathkernel._network._trained import network_of

torch.set_num_threads(1)


def instrument(module):
    """Log every node choice's tries ``(n, residual, eps * spread)`` of ``module``."""
    log = []
    orig = module._Quadrature.choose

    def choose(self, t, evaluate, df, noise):
        tries = []

        def logged(n, *a, **k):
            out = evaluate(n, *a, **k)
            tries.append((n, module._residual(out[0], df), self._spread(out[1])))
            return out

        payload = orig(self, t, logged, df, noise)
        log.append((id(self), t, tries, float(self.budgets[t]), noise))
        return payload

    module._Quadrature.choose = choose
    return log


def run(module, net, Xq, budget, log):
    log.clear()
    args = (net.module, net.trajectory, *net._training_data(), net.loss, net.tensor(Xq))
    res, checks = module.decompose(*args, memory_budget=budget, warn=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module.finish(res, checks)
    return res, checks, [str(w.message) for w in caught]


def main(old_path, *which):
    rng = np.random.RandomState(0)
    X = rng.uniform(-1, 1, size=(24, 3))
    y = np.sin(X @ np.array([1.0, -2.0, 0.5]))
    kw = dict(hidden_layer_sizes=(64, 64), solver="adam", learning_rate_init=1e-3,
              max_iter=120, tol=None, random_state=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        thin = PathKernelMachine(**kw, memory_budget=2**20).fit(X, y)
        full = PathKernelMachine(**kw).fit(X, y)
    nets = {"thinned": network_of(thin), "every": network_of(full)}
    queries = {"0, 1": X[:2], "0": X[:1], "1": X[1:2]}
    refs = {q: ace.reference(nets["every"], Xq).contributions for q, Xq in queries.items()}
    for name, mod in (("old", load_old(old_path)), ("new", new)):
        if which and name not in which:
            continue
        log = instrument(mod)
        print(f"## {name}")
        print("| path | budget | queries | choices | n_nodes sum / max | choice sum / max | "
              "tries | failed / capped / floored | warnings | ce / true |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        for pn in ("thinned", "every"):
            for budget in (2**20, 2**30):
                for qn, Xq in queries.items():
                    res, checks, msgs = run(mod, nets[pn], Xq, budget, log)
                    first = {}  # the first walk's choices (the check's walks follow)
                    for qid, t, tries, b, noise in log:
                        first.setdefault((qid, t), (tries, b, noise))
                    chosen = {}
                    for (_, t), (tries, _, _) in first.items():
                        chosen[t] = max(chosen.get(t, 0), tries[-1][0])
                    ch = np.array(list(chosen.values()))
                    n_tries = sum(len(v[0]) for v in first.values())
                    true = np.abs(res.contributions - refs[qn]).max()
                    print(f"| {pn} | {budget >> 20} MiB | {qn} | {len({q for q, _ in first})} "
                          f"| {res.n_nodes.sum()} / {res.n_nodes.max()} | {ch.sum()} / "
                          f"{ch.max()} | {n_tries} | {len(checks.failed)} / "
                          f"{len(checks.capped)} / {len(checks.floored)} | {len(msgs)} | "
                          f"{res.contribution_error / true:.3g} |", flush=True)
                    if os.environ.get("V") and (pn, budget, qn) == ("every", 2**20, "1"):
                        for (_, t), (tries, b, noise) in sorted(first.items(),
                                                                key=lambda k: -k[0][1]):
                            print(f"   step {t}, budget {b:.2g}, noise {noise:.2g}:",
                                  [(int(n), f"{r:.2g}", f"{s:.2g}") for n, r, s in tries])


if __name__ == "__main__":
    main(*sys.argv[1:])
