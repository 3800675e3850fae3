"""The unrolled scores of a float32 path against the same path read in float64.

``python benchmarks/audit_unrolled_float32.py N_QUERIES MAX_ITER raw|scaled [SOLVER]``:
fits ``PathKernelClassifier(random_state=0, max_iter=MAX_ITER, tol=None)`` (float32; SOLVER
``adam``, the default, ``adam-eps1e-4`` with ``epsilon=1e-4``, or ``sgd`` at
``learning_rate_init=0.1``) on
the 1000 digits of ``bench_attribution`` (``raw``: pixels / 16; ``scaled``: standardised),
rebuilds its recorded path and module in float64, and computes ``unrolled_scores`` of
N_QUERIES held-out digits with fixed random output weights on every route of the float32
path (the MLP's products by hand, forward over reverse, the double backward) and on the
float64 one (the truth). Prints each float32 route's largest difference from the truth,
over the truth's largest score. Results by hand in ``benchmarks/results/unrolled_routes-mlp.md``.
"""

import copy
import sys
import warnings

import numpy as np
import torch

SOLVERS = {"adam": {}, "adam-eps1e-4": dict(epsilon=1e-4),
           "sgd": dict(solver="sgd", learning_rate_init=0.1)}


def main(n_queries: int, max_iter: int, scale: str, solver: str = "adam") -> None:
    from benchmarks.bench_attribution import digits
    from skpathkernel import PathKernelClassifier, Trajectory
    from skpathkernel._analysis import _unrolled

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    X, y, Xq, _ = digits(False)
    Xq = Xq[:n_queries]
    if scale == "scaled":
        from sklearn.preprocessing import StandardScaler

        scaler = StandardScaler().fit(X)
        X, Xq = scaler.transform(X), scaler.transform(Xq)
    net = PathKernelClassifier(random_state=0, max_iter=max_iter, tol=None,
                               **SOLVERS[solver]).fit(X, y).network_
    t = net.trajectory
    t64 = Trajectory(names=t.names, shapes=t.shapes, params=t._params.double(), steps=t.steps,
                     learning_rates=t.learning_rates, batch_indices=t._batch_indices,
                     batch_offsets=t._batch_offsets,
                     states={k: v.double() for k, v in t._states.items()},
                     state_steps=t._state_steps, solver=t.solver_spec, n_samples=t.n_samples,
                     record_every=t.record_every, step_lrs=t._step_lrs)
    net64 = net.replace(module=copy.deepcopy(net.module).double(), trajectory=t64)
    # Output weights that float32 holds exactly: both dtypes then score the same queries.
    W = np.random.RandomState(0).normal(size=(n_queries, 10)).astype(np.float32)
    W = W.astype(np.float64)

    def scores(network, mlp, forward_work):
        _unrolled.MLP_PRODUCTS, _unrolled.FORWARD_WORK = mlp, forward_work
        X_fit, Y_fit = network._training_data()
        return np.asarray(_unrolled.unrolled_scores(network, X_fit, Y_fit,
                                                    network.tensor(Xq), W))

    truth = scores(net64, False, 0)
    scale_ = np.abs(truth).max()
    print(f"float64: MLP by hand against forward over reverse "
          f"{np.abs(scores(net64, True, 0) - truth).max() / scale_:.2e}")
    for name, mlp, work in (("MLP by hand", True, 0), ("forward over reverse", False, 0),
                            ("double backward", False, np.inf)):
        print(f"float32 {name} against the float64 truth "
              f"{np.abs(scores(net, mlp, work) - truth).max() / scale_:.2e}")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:5])
