"""The unrolled scores of a float32 path against the same path read in float64.

``python -m benchmarks.audit_unrolled_float32 N_QUERIES MAX_ITER raw|scaled [SOLVER]``:
fits ``PathKernelClassifier(random_state=0, max_iter=MAX_ITER, tol=None)`` (float32; SOLVER
``adam``, the default, ``adam-eps1e-4`` with ``epsilon=1e-4``, ``rmsprop``, or ``sgd`` at
``learning_rate_init=0.1``) on the 1000 digits of ``bench_attribution`` (``raw``: pixels /
16; ``scaled``: standardised), the inputs rounded to float32 first (what the training
takes), and prints, over the largest score of the truth, the largest difference from it
of:

- each route's float32 scores (the MLP's products by hand, forward over reverse, the
  double backward), each step's gradient in float64 at the recorded point (the default);
- the same with the gradient in float32 (``GRADIENT_DTYPE`` patched: the scores before the
  float64 gradient), and the route's ``gradient_sensitivity``, which estimates that change;
- the scores of a float64 training from the same initialization and batches (a training
  rounded otherwise).

The truth is the recorded float32 path and module rebuilt in float64 and scored by the
float64 route. Fixed random output weights that float32 holds exactly. Results in
``benchmarks/results/unrolled_float32.md``.
"""

import copy
import sys
import warnings

import numpy as np
import torch

SOLVERS = {"adam": {}, "adam-eps1e-4": dict(epsilon=1e-4), "rmsprop": dict(solver="rmsprop"),
           "sgd": dict(solver="sgd", learning_rate_init=0.1)}
ROUTES = {"MLP by hand": (True, 0), "forward over reverse": (False, 0),
          "double backward": (False, np.inf)}


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
    # The inputs as the float32 training takes them, so that the float64 reading of its
    # path differentiates the same losses.
    X, Xq = (v.astype(np.float32).astype(np.float64) for v in (X, Xq))
    params = dict(random_state=0, max_iter=max_iter, tol=None, **SOLVERS[solver])
    net = PathKernelClassifier(**params).fit(X, y).network_
    t = net.trajectory
    t64 = Trajectory(names=t.names, shapes=t.shapes, params=t._params.double(), steps=t.steps,
                     learning_rates=t.learning_rates, batch_indices=t._batch_indices,
                     batch_offsets=t._batch_offsets,
                     states={k: v.double() for k, v in t._states.items()},
                     state_steps=t._state_steps, solver=t.solver_spec, n_samples=t.n_samples,
                     record_every=t.record_every, step_lrs=t._step_lrs)
    net64 = net.replace(module=copy.deepcopy(net.module).double(), trajectory=t64)
    W = np.random.RandomState(0).normal(size=(n_queries, 10)).astype(np.float32)
    W = W.astype(np.float64)

    def scores(network, route, gradient=torch.float64):
        _unrolled.MLP_PRODUCTS, _unrolled.FORWARD_WORK = route
        _unrolled.GRADIENT_DTYPE = gradient
        X_fit, Y_fit = network._training_data()
        return _unrolled.unrolled_scores(network, X_fit, Y_fit, network.tensor(Xq), W)

    truth = np.asarray(scores(net64, ROUTES["forward over reverse"]))
    top = np.abs(truth).max()

    def off(s):
        return f"{np.abs(np.asarray(s) - truth).max() / top:.1e}"

    print(f"{scale} {solver} {max_iter} epochs {n_queries} queries ({t.n_steps} steps)")
    for name, route in ROUTES.items():
        exact, rounded = scores(net, route), scores(net, route, torch.float32)
        print(f"  {name}: float64 gradient {off(exact)}, float32 gradient {off(rounded)}, "
              f"gradient_sensitivity {_short(exact.gradient_sensitivity)}")
    retrained = PathKernelClassifier(**params, dtype="float64").fit(X, y).network_
    print(f"  float64 training from the same start: {off(scores(retrained, (True, 0)))}")


def _short(value: float | None) -> str:
    return "None" if value is None else f"{value:.1e}"


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), *sys.argv[3:5])
