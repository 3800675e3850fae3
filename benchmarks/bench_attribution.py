"""Training-data attribution on sklearn's digits: the linear datamodeling score (LDS) of
skpathkernel's path scores against TracIn, TRAK and influence functions (dattri), with
the same trained network, the same queries and the same retrained models for every method.

Protocol (TRAK's, Park et al. 2023): a network is trained on ``N_TRAIN`` digits (pixels
/ 16) by plain minibatch SGD with every training parameter passed explicitly; each method
scores every training point for ``N_QUERY`` held-out queries (the margin of the query's
label, ``log(p_y / (1 - p_y))``); ``N_SUBSETS`` random halves of the training set are
retrained under three protocols (:func:`skpathkernel.metrics.retrain_on_subsets`) and the
LDS is the Spearman correlation, per query and over the subsets, between the summed scores
and the retrained margin, averaged over the queries. "replay": the trained network's own
initialization and recorded minibatches, minus the left-out points; "same_seed": a fresh
fit with the same random_state (same initialization, minibatches drawn anew from the same
stream over the subset); "independent": a fresh fit with its own seed (TRAK's protocol).
The interval is the 95% bootstrap interval over the subset draws.

Every method runs in its own fresh process on the saved network (skpathkernel in this
interpreter, the peers in the peers venv of ``benchmarks/setup_peers.sh``): time to scores
is the faster of two calls after the imports and the data loading (both listed); peak
memory is the extra resident memory during the first call, sampled every millisecond.

Run by ``python -m benchmarks --only attribution [--quick]``; each method's case process
is ``python -m benchmarks.bench_attribution --case '<json spec>'``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import pickle
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

ROOT = Path(__file__).resolve().parent.parent

N_TRAIN = {False: 1000, True: 300}
N_QUERY = {False: 100, True: 30}
N_SUBSETS = {False: 50, True: 8}
N_CHECKPOINTS = 5  # TracIn's and multi-checkpoint TRAK's checkpoints, evenly spaced
# TRAK's projection: below the number of training points, or its Gram is singular.
PROJ_DIM = {False: 512, True: 128}
SEED = 0

# Every training parameter explicit: the estimators' defaults may change.
# One recipe for both networks, chosen for test accuracy (about 0.9 on both) at few steps.
TRAINING = dict(solver="sgd", learning_rate_init=0.5, momentum=0.0, alpha=0.0,
                batch_size=128, shuffle=True, loss="log_loss", record_every=1, tol=None,
                device="cpu", dtype="float32", memory_budget=2**30, verbose=0)
EPOCHS = {False: 10, True: 4}
MODELS = {
    "mlp": dict(title="MLP 64-64-64-10 tanh", hidden_layer_sizes=(64, 64),
                activation="tanh"),
    "cnn": dict(title="CNN conv8-pool-conv16-fc10 tanh", module="cnn"),
}
PROTOCOLS = {"replay": "LDS replay", "same_seed": "LDS same seed",
             "independent": "LDS independent"}
# skpathkernel's scores: (label, method, weighting).
PATH_SCORES = [
    ("skpathkernel exact, realized", "exact", "realized"),
    ("skpathkernel exact, expected", "exact", "expected"),
    ("skpathkernel path kernel (first order, expected)", "first_order", "expected"),
]
PEERS = ["tracin", "trak_final", "trak_k", "traker_final", "traker_k", "if_cg", "if_ekfac"]

_METHOD_NOTES = """\
Notes. Scores are oriented so that positive = including the point raises the query's
margin: skpathkernel's as they come; TRAK's as they come (dattri: margin gradients for
both sides as in its MNIST example, the 1 - p weighting; traker: its image_classification
margin; both with a 512-dimensional projection, normal on the CPU, float32); TracIn and the
influence functions (test gradient of the margin, training gradient of the loss) negated,
since a step on a training point's loss moves the margin by minus their product. TracIn:
dattri's TracInAttributor with its random projection switched off (exact gradient dot
products), weighted by the step size, on the same checkpoints as multi-checkpoint TRAK.
IF-CG: dattri's IFAttributorCG, damping 5e-3, 10 CG iterations (dattri's MNIST MLP
example), Hessian of the mean training loss at the final parameters. IF-EKFAC: dattri's
IFAttributorEKFAC on the Linear layers (all the MLP's parameters; only the CNN's final
layer), damping 1e-3. skpathkernel's "exact" uses every optimizer step (the trajectory is
recorded during training, at no extra pass), "path kernel" is Domingos' first-order
kernel machine with expected (1/N) weighting, i.e. TracIn over every step. The time goal
compares with TRAK on as many checkpoints as skpathkernel reads steps only where that
row exists; TRAK's cost is linear in its checkpoints.
"""


# --------------------------------------------------------------------------- models
class DigitsCNN(nn.Module):
    """A small CNN that takes flat 64-pixel rows and reshapes them to (n, 1, 8, 8)."""

    def __init__(self, n_outputs: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, 3, padding=1)
        self.pool = nn.AvgPool2d(2)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.fc = nn.Linear(16 * 4 * 4, n_outputs)

    def forward(self, x):
        h = self.pool(torch.tanh(self.conv1(x.reshape(-1, 1, 8, 8))))
        return self.fc(torch.tanh(self.conv2(h)).flatten(1))


def digits_cnn(n_features: int, n_outputs: int) -> nn.Module:
    """``module=`` builder of :class:`DigitsCNN` (module level: joblib pickles it)."""
    if n_features != 64:
        raise ValueError(f"DigitsCNN takes 8 x 8 images as 64 features, got {n_features}.")
    return DigitsCNN(n_outputs)


def build_module(name: str) -> nn.Module:
    """The same architecture outside the estimator (the peers rebuild it from this)."""
    from skpathkernel._base import make_mlp

    spec = MODELS[name]
    if spec.get("module") == "cnn":
        return digits_cnn(64, 10)
    return make_mlp(64, 10, list(spec["hidden_layer_sizes"]), spec["activation"])


def estimator(name: str, quick: bool):
    from skpathkernel import PathKernelClassifier

    spec = MODELS[name]
    net = (dict(module=digits_cnn) if spec.get("module") == "cnn" else
           dict(hidden_layer_sizes=spec["hidden_layer_sizes"], activation=spec["activation"]))
    return PathKernelClassifier(**net, **TRAINING, max_iter=EPOCHS[quick], random_state=SEED)


def digits(quick: bool):
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    X, y = load_digits(return_X_y=True)
    X_train, X_query, y_train, y_query = train_test_split(
        X / 16.0, y, train_size=N_TRAIN[quick], test_size=N_QUERY[quick], stratify=y,
        random_state=SEED)
    return X_train, y_train, X_query, y_query


def checkpoints(n_steps: int) -> list[int]:
    """Recorded points of the multi-checkpoint peers: evenly spaced, the last one final."""
    return [int(round(k * n_steps / N_CHECKPOINTS)) for k in range(1, N_CHECKPOINTS + 1)]


# --------------------------------------------------------------------------- cases
REPEATS = 2


def _measure(call):
    """(result, seconds of each call, peak extra resident bytes of the first).

    The first call runs under the memory sampler; the others alone, so that the sampler
    thread does not compete with Python-heavy code for the GIL.
    """
    from benchmarks._serve import PeakRSS

    times = []
    with PeakRSS() as mem:
        start = time.perf_counter()
        out = call()
        times.append(time.perf_counter() - start)
    for _ in range(REPEATS - 1):
        start = time.perf_counter()
        out = call()
        times.append(time.perf_counter() - start)
    return out, times, mem.delta


def _threads(spec):
    if spec.get("threads"):
        torch.set_num_threads(spec["threads"])


def ours_case(spec: dict) -> dict:
    """skpathkernel's scores from the pickled fitted estimator."""
    _threads(spec)
    work = Path(spec["dir"])
    with open(work / "estimator.pkl", "rb") as f:
        clf = pickle.load(f)
    data = np.load(work / "data.npz")
    scores, times, peak = _measure(lambda: clf.attribute(
        data["X_query"], data["y_query"], method=spec["method"], weighting=spec["weighting"]))
    np.save(work / f"scores_{spec['key']}.npy", scores)
    return {"seconds": min(times), "times": times, "peak_bytes": peak}


def _margin_functions(model):
    """dattri target functions: the query label's margin, the loss, p_y (one sample)."""
    from torch.func import functional_call
    from torch.nn.functional import cross_entropy

    def logits(params, x):
        return functional_call(model, params, (x.reshape(-1, 64),))

    def margin(params, data):
        x, y = data
        out = logits(params, x)
        y = y.reshape(-1).long()
        correct = out.gather(1, y[:, None])[:, 0]
        classes = torch.arange(out.shape[1], device=out.device)
        others = torch.where(classes[None, :] == y[:, None], -torch.inf, out)
        return (correct - torch.logsumexp(others, dim=1)).mean()

    def loss(params, data):
        x, y = data
        return cross_entropy(logits(params, x), y.reshape(-1).long())

    def probability(params, data):
        return torch.exp(-loss(params, data))

    return margin, loss, probability


def peer_case(spec: dict) -> dict:
    """One dattri method (peers venv) on the saved checkpoints."""
    _threads(spec)
    from dattri.algorithm import IFAttributorCG, IFAttributorEKFAC, TracInAttributor, TRAKAttributor
    from dattri.task import AttributionTask
    from torch.utils.data import DataLoader, TensorDataset

    work = Path(spec["dir"])
    saved = torch.load(work / "peers.pt")
    model = build_module(spec["model"])
    model.eval()
    margin, loss, probability = _margin_functions(model)
    train = TensorDataset(saved["X_train"], saved["y_train"])
    query = TensorDataset(saved["X_query"], saved["y_query"])
    n = len(train)

    def loader(ds, batch):
        return DataLoader(ds, batch_size=batch, shuffle=False)

    method = spec["method"]
    final, several = [saved["checkpoints"][-1]], saved["checkpoints"]
    if method == "tracin":
        task = AttributionTask(loss_func=loss, target_func=margin, model=model,
                               checkpoints=several)
        attributor = TracInAttributor(task, weight_list=torch.tensor(saved["lrs"]),
                                      normalized_grad=False)
        attributor.projector_kwargs = None  # exact gradient dot products

        def call():
            return -attributor.attribute(loader(train, 250), loader(query, 250))
    elif method in ("trak_final", "trak_k"):  # not startswith("trak"): traker's too
        task = AttributionTask(loss_func=margin, model=model,
                               checkpoints=final if method == "trak_final" else several)
        attributor = TRAKAttributor(task, correct_probability_func=probability,
                                    projector_kwargs={"proj_dim": PROJ_DIM[spec["quick"]],
                                                      "device": "cpu"})

        def call():
            with torch.no_grad():
                attributor.cache(loader(train, 250))
                return attributor.attribute(loader(query, 250))
    elif method == "if_cg":
        task = AttributionTask(loss_func=loss, target_func=margin, model=model,
                               checkpoints=final)
        attributor = IFAttributorCG(task, regularization=5e-3, max_iter=10)

        def call():
            attributor.cache(loader(train, n))
            with torch.no_grad():
                return -attributor.attribute(loader(train, 250), loader(query, 250))
    elif method == "if_ekfac":
        def call():
            # Built afresh per call: a second cache() on the same attributor fails (its
            # hooks find parameters left without requires_grad).
            fresh = build_module(spec["model"]).eval()
            fresh_margin, fresh_loss, _ = _margin_functions(fresh)
            task = AttributionTask(loss_func=fresh_loss, target_func=fresh_margin,
                                   model=fresh, checkpoints=final)
            attributor = IFAttributorEKFAC(task, damping=1e-3)
            attributor.cache(loader(train, 64))
            with torch.no_grad():
                return -attributor.attribute(loader(train, 250), loader(query, 250))
    elif method.startswith("traker"):
        from trak import TRAKer

        ckpts = final if method == "traker_final" else several

        def call():
            # A fresh store per call: traker refuses to featurize a registered model id.
            traker = TRAKer(model=model, task="image_classification", train_set_size=n,
                            save_dir=tempfile.mkdtemp(prefix="traker_", dir=work),
                            device="cpu",
                            proj_dim=PROJ_DIM[spec["quick"]],
                            use_half_precision=False, logging_level=logging.ERROR)
            for model_id, ckpt in enumerate(ckpts):
                traker.load_checkpoint(ckpt, model_id=model_id)
                for xb, yb in loader(train, 250):
                    traker.featurize(batch=(xb, yb), num_samples=len(xb))
            traker.finalize_features()
            for model_id, ckpt in enumerate(ckpts):
                traker.start_scoring_checkpoint(exp_name="queries", checkpoint=ckpt,
                                                model_id=model_id, num_targets=len(query))
                for xb, yb in loader(query, 250):
                    traker.score(batch=(xb, yb), num_samples=len(xb))
            return torch.as_tensor(np.asarray(traker.finalize_scores(exp_name="queries")))
    else:
        raise ValueError(f"unknown peer {method!r}")
    scores, times, peak = _measure(call)
    # dattri returns (n_train, n_queries).
    np.save(work / f"scores_{spec['key']}.npy", scores.T.detach().cpu().numpy()
            .astype(np.float64))
    from importlib.metadata import version

    package = "traker" if method.startswith("traker") else "dattri"
    return {"seconds": min(times), "times": times, "peak_bytes": peak,
            "version": f"{package} {version(package)}"}


def _run_case(spec: dict, python: str) -> dict:
    env = dict(os.environ)
    if spec.get("threads"):
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(spec["threads"])
    proc = subprocess.run([python, "-m", "benchmarks.bench_attribution", "--case",
                           json.dumps(spec)], cwd=ROOT, env=env, capture_output=True,
                          text=True)
    if proc.returncode != 0:
        return {"failed": proc.stderr.strip().splitlines()[-1][:300] if proc.stderr
                else f"exit {proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- the run
def _peer_label(method: str, k: int) -> tuple[str, int]:
    return {
        "tracin": (f"TracIn, {k} checkpoints (dattri)", k),
        "trak_final": ("TRAK, final checkpoint (dattri)", 1),
        "trak_k": (f"TRAK, {k} checkpoints (dattri)", k),
        "traker_final": ("TRAK, final checkpoint (traker)", 1),
        "traker_k": (f"TRAK, {k} checkpoints (traker)", k),
        "if_cg": ("Influence function, CG (dattri)", 1),
        "if_ekfac": ("Influence function, EK-FAC (dattri)", 1),
    }[method]


def _model_rows(name, quick, threads, work, data, retrain_log):
    from skpathkernel.metrics import (
        linear_datamodeling_interval,
        linear_datamodeling_score,
        retrain_on_subsets,
    )

    X_train, y_train, X_query, y_query = data
    clf = estimator(name, quick)
    start = time.perf_counter()
    clf.fit(X_train, y_train)
    fit_s = time.perf_counter() - start
    accuracy = clf.score(X_query, y_query)
    with open(work / "estimator.pkl", "wb") as f:
        pickle.dump(clf, f)
    np.savez(work / "data.npz", X_query=X_query, y_query=y_query)
    points = checkpoints(clf.t_)
    torch.save({
        "X_train": torch.as_tensor(X_train, dtype=torch.float32),
        "y_train": torch.as_tensor(y_train, dtype=torch.long),
        "X_query": torch.as_tensor(X_query, dtype=torch.float32),
        "y_query": torch.as_tensor(y_query, dtype=torch.long),
        "checkpoints": [clf.trajectory_.state_dict(k) for k in points],
        "lrs": [float(clf.trajectory_.learning_rates[min(k, clf.t_ - 1)]) for k in points],
    }, work / "peers.pt")

    cases = [(label, clf.t_, dict(kind="ours", key=f"{name}_{method}_{weighting}",
                                  method=method, weighting=weighting))
             for label, method, weighting in PATH_SCORES]
    from benchmarks.__main__ import peers_python

    peers = peers_python()
    for method in PEERS:
        label, k = _peer_label(method, N_CHECKPOINTS)
        cases.append((label, k, dict(kind="peer", key=f"{name}_{method}", method=method,
                                     model=name)))
    measured = []
    for label, k, spec in cases:
        spec.update(dir=str(work), threads=threads, quick=quick)
        if spec["kind"] == "peer" and peers is None:
            measured.append((label, k, spec, {"failed": "no peers venv"}))
            continue
        res = _run_case(spec, sys.executable if spec["kind"] == "ours" else peers)
        print(f"attribution {name}: {label}: {res}", flush=True)
        measured.append((label, k, spec, res))

    retrained = {}
    for protocol in PROTOCOLS:
        start = time.perf_counter()
        retrained[protocol] = retrain_on_subsets(
            clf, X_train, y_train, X_query, y_query, n_subsets=N_SUBSETS[quick],
            protocol=protocol, random_state=SEED + 1, n_jobs=-1)
        retrain_log.append((name, protocol, time.perf_counter() - start, os.getloadavg()[0]))
        print(f"attribution {name}: retrained {N_SUBSETS[quick]} subsets ({protocol}) in "
              f"{retrain_log[-1][2]:.0f} s", flush=True)

    rows = []
    for label, k, spec, res in measured:
        row = {"model": MODELS[name]["title"], "test acc": round(accuracy, 3),
               "method": label, "checkpoints / steps": k}
        if "failed" in res:
            row.update({"time to scores": f"failed: {res['failed']}"})
            rows.append(row)
            continue
        scores = np.load(work / f"scores_{spec['key']}.npy")
        row["time to scores"] = (f"{res['seconds']:.2f} s ("
                                 + ", ".join(f"{t:.2f}" for t in res["times"]) + ")")
        row["per checkpoint / step"] = f"{res['seconds'] / k:.3f} s"
        row["peak memory"] = f"{res['peak_bytes'] / 2**20:.0f} MiB"
        for protocol, title in PROTOCOLS.items():
            r = retrained[protocol]
            lds = linear_datamodeling_score(scores, r.subsets, r.outputs)
            low, high = linear_datamodeling_interval(scores, r.subsets, r.outputs,
                                                     random_state=SEED)
            row[title] = f"{lds:.3f} [{low:.3f}, {high:.3f}]"
            row[f"_{protocol}"] = lds
        row["_seconds"] = res["seconds"]
        rows.append(row)
    return rows, fit_s


def run(quick: bool = False, threads: int | None = None,
        models: list[str] | None = None) -> list[dict]:
    """One row per (model, method); the retraining times go to :data:`RUN_NOTES`."""
    global RUN_NOTES, NOTES
    torch.set_num_threads(threads or 2)
    data = digits(quick)
    rows, retrain_log, fits = [], [], []
    start = time.perf_counter()
    load = [os.getloadavg()[0]]
    with tempfile.TemporaryDirectory(prefix="skpk_attribution_") as tmp:
        for name in models or MODELS:
            model_rows, fit_s = _model_rows(name, quick, threads, Path(tmp), data, retrain_log)
            rows += model_rows
            fits.append((name, fit_s))
    load.append(os.getloadavg()[0])
    total = time.perf_counter() - start
    RUN_NOTES = _run_notes(rows, retrain_log, fits, total, load, quick)
    NOTES = RUN_NOTES + "\n\n" + _METHOD_NOTES  # what `python -m benchmarks` prints
    for row in rows:
        for key in [k for k in row if k.startswith("_")]:
            row.pop(key)
    return rows


RUN_NOTES = ""
NOTES = _METHOD_NOTES


def _run_notes(rows, retrain_log, fits, total, load, quick):
    from joblib import cpu_count

    lines = [f"Data: {N_TRAIN[quick]} training digits, {N_QUERY[quick]} held-out queries, "
             f"{N_SUBSETS[quick]} random halves per protocol. Training (both networks): plain "
             f"SGD, lr {TRAINING['learning_rate_init']}, batch {TRAINING['batch_size']}, "
             f"{EPOCHS[quick]} epochs, float32, CPU; fits "
             + ", ".join(f"{m} {s:.1f} s" for m, s in fits) + "."]
    lines.append("Retraining (`retrain_on_subsets(..., n_jobs=-1)`, joblib on "
                 f"{cpu_count()} cores; the first call includes starting the workers): "
                 + "; ".join(f"{m} {p}: {s:.0f} s (load {ld:.1f})"
                             for m, p, s, ld in retrain_log) + ".")
    lines.append(f"Whole LDS run (fits, every method's scores, retraining, LDS): {total:.0f} s; "
                 f"load average (1 min) {load[0]:.1f} before, {load[1]:.1f} after.")
    for title in MODELS.values():
        mine = [r for r in rows if r["model"] == title["title"] and "_seconds" in r]
        ours = [r for r in mine if r["method"].startswith("skpathkernel")]
        peers = [r for r in mine if not r["method"].startswith("skpathkernel")]
        if not ours or not peers:
            continue
        for protocol in PROTOCOLS:
            best = max(ours, key=lambda r: r[f"_{protocol}"])
            top = max(peers, key=lambda r: r[f"_{protocol}"])
            met = "met" if best[f"_{protocol}"] >= top[f"_{protocol}"] else "NOT met"
            lines.append(f"Goal (LDS), {title['title']}, protocol {protocol}: best path "
                         f"{best[f'_{protocol}']:.3f} ({best['method']}) vs best peer "
                         f"{top[f'_{protocol}']:.3f} ({top['method']}): {met}.")
        exact = next(r for r in ours if "exact, realized" in r["method"])
        for trak in (r for r in peers if r["method"].startswith("TRAK")):
            k, steps = trak["checkpoints / steps"], exact["checkpoints / steps"]
            ratio = (exact["_seconds"] / steps) / (trak["_seconds"] / k)
            lines.append(
                f"Goal (time), {title['title']}: skpathkernel exact {exact['_seconds']:.2f} s "
                f"over {steps} steps = {exact['_seconds'] / steps:.3f} s per step; "
                f"{trak['method']} {trak['_seconds']:.2f} s = {trak['_seconds'] / k:.3f} s "
                f"per checkpoint: per step / per checkpoint = {ratio:.2f} "
                f"({'met' if ratio <= 1 else 'NOT met'}: TRAK's work is the same for every "
                f"checkpoint, so on {steps} checkpoints it would take {steps} x its "
                "per-checkpoint time; that run is not made).")
    return "\n".join(lines)


def main(argv=None):
    """One method's case, in its own process: ``--case '<json spec>'``, the reply on stdout."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.bench_attribution")
    parser.add_argument("--case", required=True,
                        help="the JSON spec of one case (run by `python -m benchmarks "
                             "--only attribution`)")
    spec = json.loads(parser.parse_args(argv).case)
    result = (ours_case if spec["kind"] == "ours" else peer_case)(spec)
    print(json.dumps(result))


if __name__ == "__main__":
    # Through the package module, so that pickles (the estimator, joblib's tasks) name
    # ``benchmarks.bench_attribution.digits_cnn``, not ``__main__``'s.
    from benchmarks.bench_attribution import main as _main

    _main()
