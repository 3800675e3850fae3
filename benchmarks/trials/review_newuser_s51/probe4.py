# ruff: noqa: E402
# s51 review probe: run with PYTHONPATH=<package root>; benchmarks/results/review-newuser-s51.md.
import warnings

import numpy as np
import torch

warnings.simplefilter("ignore")
from sklearn.base import clone
from sklearn.linear_model import Ridge

from skpathkernel import PathKernelMachine
from skpathkernel.metrics import retrain_on_subsets

rng = np.random.RandomState(0)
n = 20
X = rng.uniform(-1, 1, size=(n, 2))
y = np.sin(2 * X[:, 0]) + X[:, 1] ** 2
Xq = X[:4] + 0.1
est = PathKernelMachine(
    hidden_layer_sizes=(6,),
    solver="sgd",
    learning_rate_init=0.1,
    max_iter=5,
    batch_size=6,
    dtype="float64",
    device="cpu",
    random_state=0,
    tol=None,
    normalize_y=False,
    record_every=1,
).fit(X, y)
S = [2, 5, 11]
mask = ~np.isin(np.arange(n), S)
masks = np.stack([mask, np.ones(n, bool), np.arange(n) % 2 == 0])
rows = [np.flatnonzero(m) for m in masks]


def err(a, b):
    return np.abs(np.asarray(a) - np.asarray(b)).max()


# same_seed: brute force refit
for proto in ("same_seed", "independent"):
    rm = retrain_on_subsets(est, X, y, Xq, subsets=masks, protocol=proto, random_state=0)
    ri = retrain_on_subsets(est, X, y, Xq, subsets=rows, protocol=proto, random_state=0)
    print(
        proto,
        "masks vs rows",
        err(rm.outputs, ri.outputs),
        (rm.subsets == masks).all(),
        (ri.subsets == masks).all(),
    )
    for j, m in enumerate(masks):
        e = clone(est)
        if proto == "independent":
            e.set_params(random_state=int(rm.seeds[j, 0]))
        ref = e.fit(X[m], y[m]).predict(Xq)
        print(f"  {proto} brute force subset {j}: {err(rm.outputs[j], ref):.2e}")
# replay: my own loop
traj = est.trajectory_
print(
    "traj attrs:",
    [a for a in ("batches", "step_learning_rates", "learning_rates") if hasattr(traj, a)],
    len(traj.batches),
)
names = traj.names


def replay(keep):
    module = est.network_.module
    import copy

    m = copy.deepcopy(module)
    sd = traj.state_dict(0)
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(sd[name])
    Xt = torch.as_tensor(X)
    Yt = torch.as_tensor(y).reshape(-1, 1)
    for t, batch in enumerate(traj.batches):
        kept = [i for i in batch if keep[i]]
        if not kept:
            continue
        lr = float(traj.step_learning_rates[t])
        out = m(Xt[kept]).reshape(len(kept), -1)
        loss = 0.5 * ((out - Yt[kept]) ** 2).mean()
        grads = torch.autograd.grad(loss, list(m.parameters()))
        with torch.no_grad():
            for p, g in zip(m.parameters(), grads):
                p -= lr * g
    with torch.no_grad():
        return m.eval()(torch.as_tensor(Xq)).reshape(-1).numpy()


print("full replay vs est.predict:", err(replay(np.ones(n, bool)), est.predict(Xq)))
rr = retrain_on_subsets(est, X, y, Xq, subsets=masks, protocol="replay")
ri = retrain_on_subsets(est, X, y, Xq, subsets=rows, protocol="replay")
print("replay masks vs rows", err(rr.outputs, ri.outputs))
for j, m in enumerate(masks):
    print(f"  replay brute force subset {j}: {err(rr.outputs[j], replay(m)):.2e}")
# errors
cases = {
    "dup": [[0, 1, 1]],
    "neg": [[-1, 2, 3]],
    "oob": [[0, n]],
    "empty mask": np.zeros((1, n), bool),
    "empty ragged": [[0, 1], []],
    "empty list row": [[]],
    "wrong mask len": np.ones((1, n - 1), bool),
    "mix bool row + idx": [list(mask), [0, 1]],
    "int 0/1 masks": masks.astype(int),
    "float": masks.astype(float),
    "1-D mask": mask,
    "1-D idx": [0, 1, 2],
    "3-D": masks[None],
    "ragged 2-D row": [[[0, 1]], [2]],
    "object ragged array": np.array([np.array([0, 1]), np.array([2])], dtype=object),
    "zero subsets": np.zeros((0, n), bool),
}
for name, s in cases.items():
    try:
        r = retrain_on_subsets(Ridge(), X, y, Xq, subsets=s, protocol="same_seed")
        print(f"ACCEPTED {name}: subsets sums {r.subsets.sum(1)}")
    except Exception as exc:
        print(f"refused {name}: {type(exc).__name__}: {str(exc)[:110]}")
