"""Contributions, n_nodes and contribution_error of decompose at the default budget
(1 GiB), this tree against another (an extracted ``git archive main``), bit for bit, on
the digits classifier, the diabetes regressor and a CNN; each tree in its own process,
compared here:

python benchmarks/decompose_small_budget_identity_s58.py /tmp/oldmain .
(results: benchmarks/results/decompose_small_budget-s58.md)
"""
import os
import subprocess
import sys
import tempfile
import warnings

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))


def cases():
    import audit_contribution_error as ace
    from sklearn.datasets import load_diabetes, load_digits

    from skpathkernel import PathKernelClassifier, PathKernelMachine

    X, y = load_digits(return_X_y=True)
    X = X / 16.0
    yield "digits", PathKernelClassifier(max_iter=5, random_state=0), X[:200], y[:200], X[300:310]
    Xd, yd = load_diabetes(return_X_y=True)
    yield "diabetes", PathKernelMachine(max_iter=5, random_state=0), Xd[:200], yd[:200], Xd[300:310]
    yield ("cnn", PathKernelClassifier(module=ace.SmallCNN, max_iter=3, random_state=0),
           X[:100], y[:100], X[300:305])


def run(out):
    warnings.simplefilter("ignore")
    sys.path.insert(0, HERE)
    saved = {}
    for name, est, X, y, Xq in cases():
        r = est.fit(X, y).decompose(Xq)
        saved[name + " contributions"] = r.contributions
        saved[name + " n_nodes"] = r.n_nodes
        saved[name + " contribution_error"] = np.float64(r.contribution_error)
    np.savez(out, **saved)


def main(*trees):
    results = []
    for tree in trees:
        out = os.path.join(tempfile.mkdtemp(), "r.npz")
        env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
        subprocess.run([sys.executable, os.path.abspath(__file__), "--run", out],
                       check=True, env=env, cwd=os.path.abspath(tree))
        results.append(np.load(out))
    a, b = results
    for key in a.files:
        print(f"{key}: bit-identical {np.array_equal(a[key], b[key])}, shape {a[key].shape}")


if __name__ == "__main__":
    if sys.argv[1] == "--run":
        run(sys.argv[2])
    else:
        main(*sys.argv[1:])
