# ruff: noqa: E402
# s51 review probe: run with PYTHONPATH=<package root>; benchmarks/results/review-newuser-s51.md.
import json
import sys
import warnings

import numpy as np

import skpathkernel.metrics as _m

print("using", _m.__file__, "ragged helper:", hasattr(_m, "_ragged_masks"))
warnings.simplefilter("ignore")
from skpathkernel.metrics import (
    linear_datamodeling_interval as ldi,
)
from skpathkernel.metrics import (
    linear_datamodeling_score as lds,
)

rng = np.random.RandomState(1)
N, Q, m = 12, 3, 6
A = rng.normal(size=(Q, N))
masks = rng.rand(m, N) < 0.5
out = masks.astype(float) @ A.T + 0.3 * rng.normal(size=(m, Q))
rows = [np.flatnonzero(r) for r in masks]
res = {}


def run(name, f):
    try:
        v = f()
        res[name] = (
            np.asarray(
                v
                if not hasattr(v, "__dict__")
                else [
                    getattr(v, k)
                    for k in sorted(vars(v))
                    if np.isscalar(getattr(v, k)) or isinstance(getattr(v, k), np.ndarray)
                ],
                dtype=object,
            )
            .tolist()
            .__repr__()
        )
    except Exception as e:
        res[name] = f"{type(e).__name__}: {e}"


run("masks", lambda: lds(A, masks, out))
run("rows ragged", lambda: lds(A, rows, out))
run("rows ragged list", lambda: lds(A, [r.tolist() for r in rows], out))
eq = [rng.choice(N, 5, replace=False) for _ in range(m)]
eqm = np.zeros((m, N), bool)
[eqm.__setitem__((j, r), True) for j, r in enumerate(eq)]
out2 = eqm.astype(float) @ A.T + 0.3 * rng.normal(size=(m, Q))
run("rows equal", lambda: lds(A, np.array(eq), out2))
run("rows ragged with empty", lambda: lds(A, rows[:-1] + [np.array([], dtype=int)], out))
run("rows ragged with empty list", lambda: lds(A, [r.tolist() for r in rows[:-1]] + [[]], out))
run("ragged dup", lambda: lds(A, [[0, 0], [1]] + rows[2:], out))
run("ragged oob", lambda: lds(A, [[0, N], [1]] + rows[2:], out))
run("ragged neg", lambda: lds(A, [[-1], [1, 2]] + rows[2:], out))
run("ragged bool", lambda: lds(A, [masks[0], [1, 2]] + rows[2:], out))
run("ragged 2d row", lambda: lds(A, [[[0]], [1, 2]] + rows[2:], out))
run("interval masks", lambda: ldi(A, masks, out, random_state=0))
run("interval ragged", lambda: ldi(A, rows, out, random_state=0))
json.dump(res, open(sys.argv[1], "w"), indent=1)
