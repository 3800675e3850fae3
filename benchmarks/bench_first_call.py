"""The unrolled attribution's first call in a fresh process, against a later one.

Usage: ``taskset -c 0 python benchmarks/bench_first_call.py TREE`` (``TREE``: the checkout
whose ``skpathkernel`` is imported; run one process per tree, alternating). Fits a tiny
classifier ((8,) MLP, SGD, 2 epochs of 60 digits, 5 features) and the default
``PathKernelClassifier(random_state=0)`` on 1000 standardised digits, then times
``attribute(Xq, method="unrolled")`` (3 and 5 queries: the double-backward route) twice
each, wall time, and says whether torch._dynamo was imported. Results by hand in
``benchmarks/results/unrolled_first_call.md``.
"""

import sys
import time
import warnings


def main(tree: str) -> None:
    sys.path.insert(0, tree)
    from sklearn.datasets import load_digits
    from sklearn.preprocessing import StandardScaler

    from skpathkernel import PathKernelClassifier

    warnings.simplefilter("ignore")
    X, y = load_digits(return_X_y=True)
    X = StandardScaler().fit_transform(X)
    tiny = PathKernelClassifier(hidden_layer_sizes=(8,), max_iter=2, solver="sgd",
                                random_state=0).fit(X[:60, :5], y[:60] % 2)
    default = PathKernelClassifier(random_state=0).fit(X[:1000], y[:1000])
    calls = [(tiny, X[60:63, :5]), (default, X[1000:1005])] * 2
    times = []
    for est, Xq in calls:
        start = time.perf_counter()
        est.attribute(Xq, method="unrolled")
        times.append(time.perf_counter() - start)
    dynamo = "torch._dynamo" in sys.modules
    print(" ".join(f"{t:.2f}" for t in times), "dynamo" if dynamo else "no-dynamo", tree)


if __name__ == "__main__":
    main(sys.argv[1])
