"""A/B of the autograd check's samples and retry (session s55), one process, pinned, CPU time.

Variants, switched by replacing ``check_samples`` and ``checked_capture`` in
``_capture`` and ``_gram``: main (s54: the cycle of the first three samples,
``checked_capture`` retrying any error on x0, x1) and s55 (the first two and the last
samples; the retry narrowed). Timed: the whole ``tangent_gram`` call (trace, float32, 10
outputs) and ``_gram._prepare`` alone (the probe capture and the check), for K(X, X) and
for one query against X, K(x, X). Run:
``taskset -c 0 python benchmarks/trials/reorder_check_s55/ab.py 9``.
"""

import statistics
import sys
import time

import torch

import skpathkernel._tangent._capture as C
import skpathkernel._tangent._gram as G
from benchmarks.trials.reorder_check_s54.ab import cnn, mlp  # s54's nets
from skpathkernel._tangent import tangent_gram

torch.set_num_threads(1)


def main_checked_capture(module, params, X, outputs, *, memory_budget, batch_bytes=0,
                         **capture_kw):
    """main's (s54) checked_capture."""
    try:
        return C._checked(module, params, C.check_rows(X, memory_budget), outputs,
                          memory_budget, batch_bytes, capture_kw)
    except Exception:
        if X.shape[0] < 2:
            raise
    return C._checked(module, params, [X[:2]], outputs, memory_budget, batch_bytes,
                      capture_kw)


VARIANTS = {
    "main": (lambda n, k=C.CHECK_SAMPLES: list(range(min(n, k))), main_checked_capture),
    "s55": (C.check_samples, C.checked_capture),
}


def use(name):
    samples, checked = VARIANTS[name]
    C.check_samples = G.check_samples = samples
    G.checked_capture = checked


def timed(fn, *args, **kw):
    t = time.process_time()
    fn(*args, **kw)
    return time.process_time() - t


def rows_cost(rounds, reps=2000):
    """check_rows alone, the only work that differs between the variants on the cycle's
    route (the same count of rows gathered): microseconds a call."""
    for shape in ((1024, 32), (1024, 3, 16, 16)):
        X = torch.randn(*shape)
        res = {v: [] for v in VARIANTS}
        for r in range(rounds + 1):
            for name in (VARIANTS if r % 2 else reversed(VARIANTS)):
                use(name)
                t = time.process_time()
                for _ in range(reps):
                    C.check_rows(X, G.DEFAULT_MEMORY_BUDGET)
                if r:
                    res[name].append((time.process_time() - t) / reps * 1e6)
        print(f"check_rows on {tuple(shape)}: " + ", ".join(
            f"{v} {statistics.median(t):.2f} us" for v, t in res.items()), flush=True)
    use("s55")


def main(rounds):
    rows_cost(rounds)
    torch.manual_seed(0)
    for net_name, make, shape in [("mlp", mlp, (32,)), ("cnn", cnn, (3, 16, 16))]:
        module = make()
        params = {k: v.detach() for k, v in module.named_parameters()}
        for N in (64, 1024):
            X = torch.randn(N, *shape)
            for case, args in (("K(X,X)", (X,)), ("K(x,X)", (X[:1], X))):
                res = {f"{p}{v}": [] for v in VARIANTS for p in ("", "p_")}
                for r in range(rounds + 1):  # round 0 warms up
                    for name in (VARIANTS if r % 2 else reversed(VARIANTS)):
                        use(name)
                        t = timed(tangent_gram, module, params, *args)
                        p = timed(G._prepare, module, params, args[0], "trace",
                                  G.DEFAULT_MEMORY_BUDGET, Y=args[-1] if len(args) > 1 else None)
                        if r:
                            res[name].append(t)
                            res[f"p_{name}"].append(p)
                med = {k: statistics.median(v) for k, v in res.items()}
                ratios = sorted(a / b for a, b in zip(res["s55"], res["main"]))
                pr = sorted(a / b for a, b in zip(res["p_s55"], res["p_main"]))
                print(f"{net_name} N={N} {case}: call main {med['main'] * 1e3:.2f} ms, "
                      f"s55/main {statistics.median(ratios):.3f} (rounds {ratios[0]:.3f}-"
                      f"{ratios[-1]:.3f}); probe+check main {med['p_main'] * 1e3:.2f} ms, "
                      f"s55 {med['p_s55'] * 1e3:.2f} ms (ratio {statistics.median(pr):.3f}, "
                      f"{pr[0]:.3f}-{pr[-1]:.3f}); extra / call "
                      f"{(med['p_s55'] - med['p_main']) / med['main']:+.4f}", flush=True)
    use("s55")


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 5)
