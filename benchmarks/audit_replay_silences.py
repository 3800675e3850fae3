"""The unrolled attribution's record check (``AttributionScores.replay_error``) on own
training loops that train what the record declares, and on loops that add an L2 term to
the loss by hand, which the record does not know.

``python -m benchmarks.audit_replay_silences [quick]``: own loops recorded with
``PathRecorder`` (200 steps of random minibatches of 8, the squared error, a scheduler
stepped after every step) of a 3-16-1 tanh MLP on 32 regression points, float32 and
float64, for SGD, momentum SGD, Adam, AdamW (its own decoupled decay declared) and
RMSprop under five schedules, each complete and with ``0.5 * wd * |theta|^2`` added to
the loss by hand (``wd`` 1e-3 and 1e-5); and complete float32 records of a small CNN and
of a token transformer encoder (whose attention key bias is moved by round-off only),
the false alarms' check. For each: ``replay_error`` by the check before this change (the
per-step residual, ``_replay_check`` of commit ``BEFORE``, 4de196a by default, patched
in) and by the check now (the residual carried through the optimizer's first moment),
and where the record misses the training, the scores' largest difference, relative to
the largest score, from central differences (h = 1e-4) of the training as it happened,
rerun in float64 from the same start with each training point's weight perturbed
(float32 records only: a float64 record that misses the training warns at any score
error). Writes ``benchmarks/results/replay_silences.md``.
"""

import copy
import datetime
import os
import platform
import subprocess
import sys
import warnings

import numpy as np
import torch

N, BATCH, STEPS = 32, 8, 200
SOLVERS = {
    "sgd": lambda p: torch.optim.SGD(p, lr=0.1),
    "momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "adamw": lambda p: torch.optim.AdamW(p, lr=0.01, weight_decay=1e-2),
    "rmsprop": lambda p: torch.optim.RMSprop(p, lr=0.003),
}
SCHEDULES = {
    "constant": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda t: 1.0),
    "cosine": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=STEPS),
    "step": lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=15, gamma=0.5),
    "warm-up": lambda o: torch.optim.lr_scheduler.LinearLR(o, start_factor=1e-6,
                                                           total_iters=2),
    "one-cycle": lambda o: torch.optim.lr_scheduler.OneCycleLR(
        o, max_lr=o.param_groups[0]["lr"], total_steps=STEPS, cycle_momentum=False),
}
ERRORS = {"complete": 0.0, "L2 1e-3": 1e-3, "L2 1e-5": 1e-5}
LENGTH, D = 4, 6


class Encoder(torch.nn.Module):
    """Tokens of 2 features, one post-norm encoder layer (GELU), mean pool."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(2, D)
        self.layer = torch.nn.TransformerEncoderLayer(D, 2, dim_feedforward=8, dropout=0.0,
                                                      activation="gelu", batch_first=True)
        self.head = torch.nn.Linear(D, 1)

    def forward(self, x):
        return self.head(self.layer(self.inp(x.reshape(-1, LENGTH, 2))).mean(1))


class CNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(1, 3, 3)
        self.head = torch.nn.Linear(3 * 4 * 4, 1)

    def forward(self, x):
        return self.head(torch.tanh(self.conv(x.reshape(-1, 1, 6, 6))).flatten(1))


MODELS = {
    "MLP": (3, lambda: torch.nn.Sequential(torch.nn.Linear(3, 16), torch.nn.Tanh(),
                                           torch.nn.Linear(16, 1))),
    "CNN": (36, CNN),
    "encoder": (2 * LENGTH, Encoder),
}


def data(n_features):
    rng = np.random.RandomState(0)
    X = rng.normal(size=(N, n_features))
    y = np.sin(X[:, 0]) + 0.5 * X[:, 1] * X[:, -1]
    return X, y[:, None]


def loop(module, solver, schedule, X, y, wd, weights=None, record=False):
    """The user's loop: each step's weighted mean squared error (halved), plus
    ``0.5 * wd * |theta|^2`` by hand; the recorder with ``record``."""
    from skpathkernel import PathRecorder

    opt = SOLVERS[solver](module.parameters())
    sched = SCHEDULES[schedule](opt)
    gen = torch.Generator().manual_seed(0)
    w = torch.ones(len(X), dtype=X.dtype) if weights is None else weights
    rec = PathRecorder(module, opt, n_samples=len(X)) if record else None
    for _ in range(STEPS):
        batch = torch.randperm(len(X), generator=gen)[:BATCH]
        if rec is not None:
            rec.set_batch(batch.numpy())
        per = 0.5 * (module(X[batch]) - y[batch]).pow(2).sum(1)
        loss = (w[batch] * per).sum() / w[batch].sum()
        if wd:
            loss = loss + 0.5 * wd * sum(p.pow(2).sum() for p in module.parameters())
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    if rec is not None:
        rec.close()
        return rec.trajectory
    return module


def as_it_happened(start, solver, schedule, X, y, wd, n_queries, h=1e-4):
    """Central differences, in each point's weight, of the queries' outputs of the
    training as it happened, rerun in float64 from ``start``."""
    X64, y64 = X.double(), y.double()

    def trained(weights):
        module = loop(copy.deepcopy(start), solver, schedule, X64, y64, wd,
                      torch.as_tensor(weights))
        with torch.no_grad():
            return module(X64[:n_queries])[:, 0].numpy()

    eye = np.eye(len(X))
    return np.stack([(trained(1 + h * eye[i]) - trained(1 - h * eye[i])) / (2 * h)
                     for i in range(len(X))], axis=1)


def old_check():
    """The check before this change: its ``_replay_check`` from git, with the sweep's
    close of the first step as it read then."""
    from skpathkernel._analysis import _unrolled

    source = subprocess.run(["git", "show", f"{BEFORE}:skpathkernel/_analysis/_unrolled.py"],
                            capture_output=True, text=True, check=True).stdout
    start = source.index("def _replay_check(")
    namespace = dict(vars(_unrolled))
    exec(source[start:source.index("\n\n\n", start)], namespace)
    old = namespace["_replay_check"]

    def check(pending, direction, memory, modelled, lr):
        if direction is None:
            rest, _, weight, first = pending
            return (torch.nansum((weight * rest).double() ** 2),
                    torch.nansum((weight * first).double() ** 2), None)
        return old(pending, direction, memory, modelled, lr)

    return check


def case(model, dtype, solver, schedule, error, checks, n_queries=3):
    from skpathkernel import RecordedNetwork
    from skpathkernel._analysis import _unrolled

    n_features, factory = MODELS[model]
    X, y = data(n_features)
    torch.manual_seed(0)
    module = factory().to(dtype)
    start = copy.deepcopy(module).double()
    Xt, yt = torch.as_tensor(X, dtype=dtype), torch.as_tensor(y, dtype=dtype)
    wd = ERRORS[error]
    traj = loop(module, solver, schedule, Xt, yt, wd, record=True)
    net = RecordedNetwork(module, traj, X_train=Xt.numpy(), y_train=yt.numpy())
    errors, scores = {}, None
    for name, check in checks.items():
        _unrolled._replay_check = check
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            scores = net.attribute(Xt[:n_queries].numpy(), method="unrolled")
        errors[name] = scores.replay_error
    score_error = None
    # A float64 record that misses the training warns whatever the scores (its limit,
    # 1e-9, is round-off's): the central differences are taken in float32 only.
    if wd and dtype == torch.float32:
        truth = as_it_happened(start, solver, schedule, Xt, yt, wd, n_queries)
        score_error = float(np.abs(scores - truth).max() / np.abs(truth).max())
    return errors, score_error


def main(quick=False):
    from skpathkernel._analysis import _unrolled

    torch.set_num_threads(1)
    checks = {"before": old_check(), "now": _unrolled._replay_check}
    rows = []
    cases = [("MLP", dtype, s, sc, e) for dtype in (torch.float32, torch.float64)
             for s in SOLVERS for sc in SCHEDULES for e in ERRORS]
    cases += [(m, torch.float32, s, sc, "complete") for m in ("CNN", "encoder")
              for s in SOLVERS for sc in SCHEDULES]
    if quick:
        cases = cases[::7]
    for c in cases:
        errors, score_error = case(*c, checks)
        rows.append((*c, errors["before"], errors["now"], score_error))
        print(*c[:1], str(c[1])[6:], *c[2:], *(f"{v:.2g}" for v in errors.values()),
              score_error, flush=True)
    if not quick:  # a sample of the cases, printed only
        write(rows)


def limit(dtype):
    from skpathkernel._analysis._unrolled import REPLAY_LIMIT, REPLAY_LIMIT_FLOAT64

    return REPLAY_LIMIT_FLOAT64 if dtype == torch.float64 else REPLAY_LIMIT


def write(rows):
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "skpathkernel"],
                           capture_output=True, text=True).stdout.strip()
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    out = [
        "# replay_error: silences on loops that train what the record does not declare",
        "",
        "Provenance:",
        "",
        f"- `python -m benchmarks.audit_replay_silences` (pinned to one core by taskset, one "
        f"torch thread), "
        f"{commit}{' with uncommitted changes' if dirty else ''}, {now}; the check "
        f"before: `{BEFORE}`'s `_replay_check`.",
        f"- Machine: {platform.processor() or platform.machine()}, torch {torch.__version__}.",
        "- Cases: see the module docstring. `before` / `now`: replay_error by the check "
        "before this change and now; `warns`: above the dtype's limit (1e-3 float32, 1e-9 "
        "float64); `score error`: largest difference from central differences of the "
        "training as it happened, over the largest of them (records that miss the "
        "training only).",
        "",
    ]
    for dtype in (torch.float32, torch.float64):
        lim = limit(dtype)
        name = str(dtype)[6:]
        complete = [r for r in rows if r[1] == dtype and r[4] == "complete"]
        missed = [r for r in rows if r[1] == dtype and r[4] != "complete"]
        if complete:
            out += [f"- {name}, {len(complete)} complete records: before "
                    f"{min(r[5] for r in complete):.2g} to {max(r[5] for r in complete):.2g}, "
                    f"now {min(r[6] for r in complete):.2g} to "
                    f"{max(r[6] for r in complete):.2g}; warn now: "
                    f"{sum(r[6] > lim for r in complete)}."]
        if missed:
            off = [r for r in missed if r[7] is not None and r[7] > 1e-3]
            within = [r for r in missed if r[7] is not None and r[7] <= 1e-3]
            out += [f"- {name}, {len(missed)} records with an L2 term by hand: silent "
                    f"before {sum(not r[5] > lim for r in missed)}, now "
                    f"{sum(not r[6] > lim for r in missed)}."]
            if off or within:
                out += [f"  Scores off by more than 1e-3 in {len(off)}: silent before "
                        f"{sum(not r[5] > lim for r in off)}, now "
                        f"{sum(not r[6] > lim for r in off)}. Scores within 1e-3 in "
                        f"{len(within)}: warn before {sum(r[5] > lim for r in within)}, "
                        f"now {sum(r[6] > lim for r in within)}."]
    out += ["", "| model | dtype | solver | schedule | record | before | now | warns "
            "before / now | score error |", "|---|---|---|---|---|---|---|---|---|"]
    for model, dtype, solver, schedule, error, before, now, score in rows:
        lim = limit(dtype)
        flags = f"{'yes' if before > lim else 'no'} / {'yes' if now > lim else 'no'}"
        score = "" if score is None else f"{score:.2g}"
        out.append(f"| {model} | {str(dtype)[6:]} | {solver} | {schedule} | {error} | "
                   f"{before:.2g} | {now:.2g} | {flags} | {score} |")
    path = os.path.join(os.path.dirname(__file__), "results", "replay_silences.md")
    with open(path, "w") as f:
        f.write("\n".join(out) + "\n")
    print("\n".join(out[:12]))


# The commit whose check this audit compares against (the one before the change).
BEFORE = os.environ.get("BEFORE", "4de196a")

if __name__ == "__main__":
    main(quick=len(sys.argv) > 1 and sys.argv[1] == "quick")
