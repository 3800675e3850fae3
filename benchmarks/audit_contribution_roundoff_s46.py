"""Is the float32 round-off estimate in ``contribution_error`` judged against a truth that
holds? Each reference's own closure beside each case's miss, and a reference that closes.

``audit_contribution_roundoff_s45.py`` judged ``contribution_error`` (the two rules'
difference plus ``ROUNDOFF * eps32 * sum_t |s_t|``) against a float64 16-node reference
of the same recorded float32 path, whose per-sample loss gradients are those of float64
arithmetic at the recorded points (``ref64``). That reference does not close on Adam
paths: Adam's step divides each gradient coordinate by ``sqrt(v_hat) + eps``, so where a
coordinate's gradient is within round-off of 0 (the first step above all, where
``v_hat = g^2``), the step the training took follows float32's value of that gradient,
not float64's: the float64 gradients rebuild a path the training did not take, and the
reference's contributions do not sum to ``f(x_T) - f(x_0)`` of the recorded path.

``ref32g`` is the same float64 16-node decomposition (the queries' Jacobians at the
nodes, the adjoint over the steps, the contraction, all in float64) with the batch's
per-sample loss-gradient factors (each layer's inputs and backprops, and the loss
residuals) evaluated in float32 at the recorded float32 points, as the training
evaluated its gradients, then cast to float64. That is the decomposition's own
definition of a contribution (``a_i = sum_s lambda_s . g_{s,i} w_i``, the steps
``-coef_t D_t sum m^(t-s) d_s`` with the recorded preconditioners ``D_t``) applied to
the gradients that made the recorded steps. It closes to the float32 decomposition's
own closure (the training's unattributable round-off: the float32 parameters' storage,
the float32 batch sums, which no per-sample share holds). What it does not count as
error is the float32 rounding of the batch factors, which the float32 decomposition
computes with the very same float32 captures (bit for bit); ``ref64`` counts it.

Per case, in units of 1e-6 * S (S the largest |f| along the path): the estimate
(``contribution_error``), and per reference the true error (the largest over queries,
training points and outputs of one contribution's difference from the reference), the
reference's closure (``max |initial + sum_i a_i + regularization - prediction|`` of the
reference: its contributions' sum against f(x_T) - f(x_0) of the recorded path,
evaluated in float64), its split into ``R`` (what the reference's gradients leave of
the recorded steps) and ``int`` (the rest, the reference's own error on its sum), the
ratio estimate / true, and whether the case is validated: strictly (closure < 0.1 x
true) and for the reference's definition (int < 0.1 x true); also the float32
decomposition's own closure and the two references' largest difference. Cases: the 39
of ``contribution_roundoff-s45.md``, the default classifier on all of digits (1797
points, batches of 200: 1800 steps over 200 epochs, two seeds), iris (standardized)
with full-batch momentum SGD (Nesterov and heavy-ball, two seeds each) and with Adam.
The CNN cases have no float32-gradient reference (their batch captures are the general
engine's, which the float32 patch does not reach).

Run: OMP_NUM_THREADS=1 taskset -c 1 python benchmarks/audit_contribution_roundoff_s46.py
[words] (results: benchmarks/results/contribution_roundoff-s46.md, one JSON line per case
beside it in contribution_roundoff-s46.jsonl as they finish; with words, only the cases
whose names hold one, printed and not written)
"""
import contextlib
import copy
import json
import os
import platform
import subprocess
import sys
import time
import warnings

import numpy as np
import torch
from sklearn.datasets import load_digits, load_iris
from sklearn.preprocessing import StandardScaler

sys.path.insert(0, os.path.dirname(__file__))
import audit_check_rows
import audit_contribution_error as ace
from audit_contribution_roundoff import cases as s45_cases

from skpathkernel import PathKernelClassifier
from skpathkernel._analysis import _decomposition as package
from skpathkernel._tangent import stacked_mlp
from skpathkernel._tangent._pairs import Flat

torch.set_num_threads(1)
HERE = os.path.dirname(__file__)
OUT = os.path.join(HERE, "results", "contribution_roundoff-s46.md")
LINES = os.path.join(HERE, "results", "contribution_roundoff-s46.jsonl")
UNIT = 1e-6
VALID = 0.1


class _Float32Batches:
    """A float32 stacked capture in a float64 walk: forward at float32 points and rows,
    backward from a float32 seed (the loss residuals), its factors cast to float64."""

    def __init__(self, stacked32):
        self.stacked32 = stacked32

    def forward(self, thetas, X):
        return self.stacked32.forward(thetas.float(), X.float())

    def backward(self, cache, seed):
        return [[Flat(t.delta.double(), [(n, None if a is None else a.double())
                                         for n, a in t.inputs]) for t in terms]
                for terms in self.stacked32.backward(cache, seed.float())]


def batch_gradient(terms, w, layout):
    """``sum_i w_i g_i`` (P,) float64 from a batch's captured factors."""
    d = torch.zeros(sum(size for _, size in layout.values()), dtype=torch.float64)
    for term in terms:
        wd = w[:, None] * term.delta[:, 0].double()
        for name, a in term.inputs:
            at, size = layout[name]
            d[at:at + size] = (wd.T @ a.double()).reshape(-1) if a is not None else wd.sum(0)
    return d


@contextlib.contextmanager
def recorded_batches(module32, names, store):
    """The decomposition's batch captures (made ahead for blocks of steps) kept in
    ``store`` by step, as the batch's gradient (:func:`batch_gradient`); with
    ``module32``, a float64 walk's taken in float32 (a walk that would capture a batch
    otherwise raises)."""
    ahead, batches = package._Context._capture_ahead, package._Context._batches

    def capture_ahead(self, t, size):
        kept = self.stacked
        if module32 is not None:
            self.stacked = _Float32Batches(
                package._StackedCapture(stacked_mlp(module32, names), self.layout))
        try:
            ahead(self, t, size)
        finally:
            self.stacked = kept
        for s, (_, w_sub, terms, _) in self._ahead.items():
            if s not in store:
                store[s] = batch_gradient(terms, w_sub, self.layout)

    def only_ahead(self, t, theta):
        idx, _ = package._step_points(self.traj, t, self.weighting, self.device)
        if module32 is not None and (self.stacked is None or not 0 < len(idx) <= self.b_block):
            raise NotImplementedError("the float32-gradient reference takes stacked MLPs")
        if self.stacked is not None and 0 < len(idx) <= self.b_block:
            yield from batches(self, t, theta)
            return
        d = None  # the general engine's captures, in blocks of rows
        for block in batches(self, t, theta):
            g = batch_gradient(block[2], block[1], self.layout)
            d = g if d is None else d + g
            yield block
        store.setdefault(t, d)

    package._Context._capture_ahead, package._Context._batches = capture_ahead, only_ahead
    try:
        yield
    finally:
        package._Context._capture_ahead, package._Context._batches = ahead, batches


def reference(net, Xq, grads):
    """The REF_NODES-node float64 decomposition of the recorded path, its batch factors
    in float64 (``grads="float64"``, ``audit_contribution_error.reference``) or float32;
    and its batch captures by step."""
    module = copy.deepcopy(net.module).double()
    traj = ace.float64_path(net.trajectory)
    X_fit, Y_fit = net._training_data()
    X_fit = X_fit.double()
    Y_fit = Y_fit.double() if Y_fit.is_floating_point() else Y_fit
    Xq = torch.as_tensor(np.asarray(Xq), dtype=torch.float64).reshape(
        (len(Xq),) + tuple(X_fit.shape[1:]))
    module32 = copy.deepcopy(net.module).float() if grads == "float32" else None
    store = {}
    with warnings.catch_warnings(), recorded_batches(module32, traj.names, store):
        warnings.simplefilter("ignore")
        res, _ = package.decompose(module, traj, X_fit, Y_fit, net.loss, Xq,
                                   n_nodes=ace.REF_NODES, warn=False)
    return res, store


def closure(res):
    return float(np.abs(res.reconstruction - res.prediction).max())


def unattributed(net, Xq, store):
    """``R(x) = sum_t rho_t(x) . (dtheta_t - dtheta_t^model)``, (Q, C): what the recorded
    steps hold beyond the steps that a reference's gradients rebuild,
    ``dtheta_t^model = -D_t (coef_t sum_{s<=t} m^(t-s) d_s + direct_t d_t)`` with
    ``d_s = sum_i w_i g_{s,i}`` (+ L2 decay), each batch's gradient formed from the
    reference's own batch captures (``store``, :func:`recorded_batches`), ``rho_t`` by
    REF_NODES-node Gauss-Legendre (forward-mode products along the recorded segment): a loop of its
    own, not the decomposition's adjoint. A reference that computes its definition
    exactly has ``reconstruction - prediction = -R`` to round-off. None where the path
    is thinned or decays decoupled, or a step's batch was not captured ahead."""
    traj = ace.float64_path(net.trajectory)
    steps = len(traj) - 1
    if (traj.record_every != 1 or traj.solver_spec.name == "adamw"
            or any(t not in store for t in range(steps))):
        return None
    module = copy.deepcopy(net.module).double()
    coefs, memory, direct = traj.step_coefficients(direct=True)
    wd = float(traj.solver_spec.weight_decay or 0.0)
    Xq = torch.as_tensor(np.asarray(Xq), dtype=torch.float64)
    nodes, weights = np.polynomial.legendre.leggauss(ace.REF_NODES)
    nodes, weights = (nodes + 1) / 2, weights / 2

    def f(theta):
        return torch.func.functional_call(module, traj.unflatten(theta), (Xq,))

    buf, R = None, 0.0
    for t in range(steps):
        theta, nxt = traj.parameters(t), traj.parameters(t + 1)
        d = store[t]
        if wd:
            d = d + wd * theta
        buf = d if buf is None else memory * buf + d
        D = traj.preconditioner(t)
        step = -(coefs[t] * buf + direct[t] * d)
        e = (nxt - theta) - (step if D is None else D * step)
        for s, wk in zip(nodes, weights):
            R = R + wk * torch.func.jvp(f, (theta + s * (nxt - theta),), (e,))[1]
    return R.numpy()


def cases():
    yield from s45_cases()
    X, y = load_digits(return_X_y=True)
    X = X / 16.0
    for seed in (0, 1):
        yield (f"digits (all 1797) f32, defaults, full max_iter, seed{seed}, 20 training "
               "points as queries", PathKernelClassifier(random_state=seed),
               (X, y, X[20 * seed:20 * seed + 20]))
    Xi, yi = load_iris(return_X_y=True)
    Xi = StandardScaler().fit_transform(Xi)
    rng = np.random.RandomState(0)
    Xiq = Xi[rng.choice(len(Xi), 20, replace=False)]
    for nesterov in (True, False):
        for seed in (0, 1):
            word = "Nesterov" if nesterov else "heavy-ball"
            yield (f"iris (X standardized) f32, SGD momentum 0.9 {word}, lr 0.05, full "
                   f"batch, 200 it, seed{seed}, 20 training points as queries",
                   PathKernelClassifier(solver="sgd", momentum=0.9,
                                        nesterovs_momentum=nesterov,
                                        learning_rate_init=0.05, tol=None,
                                        n_iter_no_change=10**6, random_state=seed),
                   (Xi, yi, Xiq))
    yield ("iris (X standardized) f32, Adam defaults, full batch, 200 it, seed0, 20 "
           "training points as queries",
           PathKernelClassifier(tol=None, n_iter_no_change=10**6, random_state=0),
           (Xi, yi, Xiq))


def main(*want):
    if not want and os.path.exists(LINES):
        os.remove(LINES)
    rows = []
    for name, net, Xq, args in audit_check_rows.fitted(cases(), want):
        t0 = time.process_time()
        res, checks = package.decompose(*args, memory_budget=net.memory_budget, warn=False)
        unit = UNIT * checks.scale
        row = {"case": name, "steps": len(net.trajectory) - 1,
               "solver": net.trajectory.solver, "est": res.contribution_error / unit,
               "closure_f32": closure(res) / unit}
        refs = {}
        for grads in ("float64", "float32"):
            try:
                ref, store = reference(net, Xq, grads)
            except NotImplementedError:
                continue
            refs[grads] = ref
            true = np.abs(res.contributions - ref.contributions).max() / unit
            row[grads] = {"true": true, "closure": closure(ref) / unit,
                          "ratio": row["est"] / true}
            R = unattributed(net, Xq, store)
            if R is not None:
                # The reference's closure beyond what its gradients leave of the steps.
                row[grads]["R"] = float(np.abs(R).max()) / unit
                row[grads]["internal"] = float(np.abs(
                    ref.reconstruction - ref.prediction + R).max()) / unit
        if len(refs) == 2:
            row["ref_diff"] = np.abs(refs["float64"].contributions
                                     - refs["float32"].contributions).max() / unit
        row["cpu_s"] = time.process_time() - t0
        rows.append(row)
        print(json.dumps(row), flush=True)
        if not want:
            with open(LINES, "a") as fh:
                fh.write(json.dumps(row) + "\n")
    if not want:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"],
                                capture_output=True, text=True, cwd=HERE).stdout.strip()
        load = os.getloadavg()
        with open(LINES + ".provenance", "w") as fh:
            fh.write(f"`OMP_NUM_THREADS=1 taskset -c 1 python benchmarks/"
                     f"audit_contribution_roundoff_s46.py` at commit {commit} (torch "
                     f"{torch.__version__}, one thread, "
                     f"{platform.processor() or platform.machine()}, "
                     f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} at the end, "
                     f"load average then {load[0]:.1f}/{load[1]:.1f}/{load[2]:.1f} on 2 "
                     "cores shared with other jobs).")
        write(rows, open(LINES + ".provenance").read())


def write(rows, provenance):
    lines = [
        "# Float32 contribution_error against references that close", "", provenance, "",
        "Units of 1e-6 * S (S the largest |f| along the path). `est`: contribution_error "
        f"(ROUNDOFF = {package.ROUNDOFF:g}). Two references, each the 16-node float64 "
        "decomposition of the recorded float32 path: `ref64` with its batches' gradient "
        "factors in float64 (the s45 audit's truth), `ref32g` with them evaluated in "
        "float32 at the recorded points, as the training evaluated its gradients. Per "
        "reference: `true`, the largest error of one contribution of the float32 "
        "decomposition against it; `clos`, the reference's closure, the largest "
        "abs(initial + sum_i a_i + regularization - prediction) (its contributions' sum "
        "against f(x_T) - f(x_0) of the recorded path); `R`, what the recorded steps hold "
        "beyond the steps its own gradients rebuild, sum_t rho_t . (dtheta_t - "
        "dtheta_t^model), computed apart (its own loop: the batch gradients from the "
        "same captures, the solver's recursion with the recorded preconditioners, rho_t "
        "by 16-node Gauss-Legendre forward-mode products); `int`, the closure beyond it, "
        "max abs(reconstruction - prediction + R): the reference's own error on its sum; "
        "`est/true`; `strict`: closure < 0.1 x true (the brief's criterion); `ok`: int < "
        "0.1 x true (the reference exact for its definition, to well under the miss). "
        "`f32 clos`: the float32 decomposition's own closure. `refs`: the two "
        "references' largest difference of one contribution. n/a: not computed (CNN: "
        "no float32-gradient reference, its batch captures are the general engine's; R "
        "needs a stacked MLP).", "",
        "| case | steps | solver | est | ref64 true | ref64 clos | ref64 R | ref64 int | "
        "ref64 est/true | ref64 strict | ref64 ok | ref32g true | ref32g clos | ref32g R | "
        "ref32g int | ref32g est/true | ref32g strict | ref32g ok | f32 clos | refs |",
        "|" + "---|" * 20]

    def g(x):
        return "n/a" if x is None else f"{x:.3g}"

    for r in rows:
        cells = [r["case"], str(r["steps"]), r["solver"], g(r["est"])]
        for k in ("float64", "float32"):
            d = r.get(k)
            if d is None:
                cells += ["n/a"] * 7
                continue
            cells += [g(d["true"]), g(d["closure"]), g(d.get("R")), g(d.get("internal")),
                      g(d["ratio"]), "yes" if d["closure"] < VALID * d["true"] else "no",
                      "n/a" if "internal" not in d
                      else "yes" if d["internal"] < VALID * d["true"] else "no"]
        cells += [g(r["closure_f32"]), g(r.get("ref_diff"))]
        lines.append("| " + " | ".join(cells) + " |")
    with open(OUT, "w") as fh:
        fh.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    if sys.argv[1:] == ["--write"]:  # the table again from the JSON lines
        with open(LINES) as fh:
            rows = [json.loads(line) for line in fh]
        with open(LINES + ".provenance") as fh:
            write(rows, fh.read())
    else:
        main(*sys.argv[1:])
