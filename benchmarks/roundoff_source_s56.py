"""Where a float32 path's contribution round-off comes from: converged full-batch Adam
(tests/test_quadrature.py's ``_converged_full_batch_adam``, float32, two training points
as queries), each contribution against the float64 12-node decomposition of the same
recorded path (``_float64_reference``), with one float32 source removed or changed:

* ``default``: the package as it is;
* ``adj64``: the adjoint's buffer (and the queries' factors, the preconditioner it is
  updated with) in float64;
* ``exact_res``: the batches' loss residuals from a float64 forward pass at the same
  point (rounded once to float32), the rest unchanged;
* ``nomkldnn``: ``torch.backends.mkldnn.enabled = False``;
* run under ``MKL_CBWR=COMPATIBLE`` (MKL's SSE2 kernels) or ``ATEN_CPU_CAPABILITY=default``
  (ATen's unvectorized kernels): the GEMMs' and reductions' accumulation orders.

And the first-order prediction of the error from the residuals' round-off alone,
``sum_t share_t (r32_t - r64_t) / r_t`` per contribution (the first walk's shares,
``--shares``), against the true error.

Run: SEED=1 OMP_NUM_THREADS=1 python benchmarks/roundoff_source_s56.py VARIANT [--shares]
(numbers in benchmarks/results/roundoff_model-s56.md)
"""
import copy
import os
import pickle
import sys
import tempfile
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from test_quadrature import _converged_full_batch_adam, _float64_reference, _path_scale

import skpathkernel._analysis._decomposition as dec
import skpathkernel._tangent._pairs as pairs
from skpathkernel._network._trained import network_of
from skpathkernel._tangent import forward

torch.set_num_threads(1)
EPS = float(torch.finfo(torch.float32).eps)
SEED = int(os.environ.get("SEED", "1"))
CACHE = Path(tempfile.gettempdir()) / f"roundoff_source_s56_seed{SEED}.pkl"


def fitted():
    """The fit, its queries, their float64 reference and S (cached across variants)."""
    if CACHE.exists():
        with open(CACHE, "rb") as fh:
            return pickle.load(fh)
    est, _ = _converged_full_batch_adam(seed=SEED, dtype="float32")
    Xq = network_of(est)._training_data()[0][:2].double().numpy()
    with tempfile.TemporaryDirectory() as d:
        ref = _float64_reference(est, Xq, Path(d))
    out = (est, Xq, ref, _path_scale(est, Xq))
    with open(CACHE, "wb") as fh:
        pickle.dump(out, fh)
    return out


def adjoint_in(dtype):
    """Adjoint's buffer, the queries' factors it is updated from and D in ``dtype``."""
    init, pass_ = pairs.Adjoint.__init__, pairs.Adjoint._pass

    def flat(f):
        return pairs.Flat(f.delta.to(dtype), [(n, None if a is None else a.to(dtype))
                                              for n, a in f.inputs])

    def __init__(self, like, *a, **k):
        init(self, [flat(f) for f in like], *a, **k)

    def _pass(self, groups, alpha, D, batch, dhat, decay):
        if groups is not None:
            groups = [(g, [[flat(f) for f in node] for node in nodes], w)
                      for g, nodes, w in groups]
        D = None if D is None else {k: v.to(dtype) for k, v in D.items()}
        decay = None if decay is None else {k: v.to(dtype) for k, v in decay.items()}
        return pass_(self, groups, alpha, D, batch, dhat, decay)

    pairs.Adjoint.__init__, pairs.Adjoint._pass = __init__, _pass


def exact_residuals(net):
    """The stacked engine's batch residuals from a float64 forward at the same point."""
    last, fwd, real = [None], dec._StackedCapture.forward, net.loss.residuals

    def forward_(self, thetas, X):
        # float64 first: the float32 call's cache must be the last one made.
        last[0] = fwd(self, thetas.double(), X.double())[0].clone()
        return fwd(self, thetas, X)

    def residuals(out, y):
        if out.dtype == torch.float64:  # the round-off measurement's own
            return real(out, y)
        o = last[0].flatten(0, 1) if last[0].dim() == 3 else last[0]
        assert o.shape == out.shape
        return real(o, y.double()).float()

    dec._StackedCapture.forward = forward_
    net.loss.residuals = residuals


def shares_prediction(net, est_res, ref, S):
    """The first walk's per-step shares (adjoint route), and the prediction of the error
    from the residuals' round-off (plain float32 and float64 forwards at theta_t)."""
    rec, real = [], pairs.Adjoint.step

    def step(self, *a, **k):
        share, part = real(self, *a, **k)
        rec.append(share)
        return share, part

    pairs.Adjoint.step = step
    X_fit, Y_fit = net._training_data()
    traj = net.trajectory
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        res, _ = dec.decompose(net.module, traj, X_fit, Y_fit, net.loss,
                               net.tensor(est_res), warn=False)
    pairs.Adjoint.step = real
    m64 = copy.deepcopy(net.module).double()
    n_q = est_res.shape[0]
    steps = traj.n_steps
    shares = rec[:steps]  # the first walk, last step first; full batch, points in order
    pred = np.zeros(res.contributions.shape)
    amp = []
    for k, share in enumerate(shares):
        t = steps - 1 - k
        p32 = dict(traj.unflatten(traj.parameters(t)))
        p64 = {n: v.double() for n, v in p32.items()}
        r32 = net.loss.residuals(forward(net.module, p32, X_fit), Y_fit).double()[:, 0]
        r64 = net.loss.residuals(forward(m64, p64, X_fit.double()), Y_fit.double())[:, 0]
        rel = ((r32 - r64) / r64).numpy()
        s = share.view(2 * n_q, -1)[:n_q].numpy()  # (n_q * C, N), C = 1
        pred[:, :, 0] += s * rel[None, :]  # the shares carry their weights
        amp.append(np.abs(rel) / EPS)
    true = res.contributions - ref
    amp = np.concatenate(amp)
    print(f"residual relative round-off (eps32): median {np.median(amp):.1f}, 90% "
          f"{np.quantile(amp, 0.9):.1f}; prediction vs true: correlation "
          f"{np.corrcoef(true.ravel(), pred.ravel())[0, 1]:.4f}, largest true "
          f"{np.abs(true).max() / S:.3g} S, largest |true - prediction| "
          f"{np.abs(true - pred).max() / S:.3g} S")


def main(variant="default", *flags):
    est, Xq, ref, S = fitted()
    net = network_of(est)
    if "--shares" in flags:
        return shares_prediction(net, Xq, ref, S)
    if variant == "adj64":
        adjoint_in(torch.float64)
    elif variant == "exact_res":
        exact_residuals(net)
    elif variant == "nomkldnn":
        torch.backends.mkldnn.enabled = False
    X_fit, Y_fit = net._training_data()
    res, checks = dec.decompose(net.module, net.trajectory, X_fit, Y_fit, net.loss,
                                net.tensor(Xq), warn=False)
    true = np.abs(res.contributions - ref).max()
    print(f"{variant} (MKL_CBWR={os.environ.get('MKL_CBWR', '-')}, ATEN_CPU_CAPABILITY="
          f"{os.environ.get('ATEN_CPU_CAPABILITY', '-')}): true {true / S:.3g} S, "
          f"contribution_error {res.contribution_error / S:.3g} S "
          f"(x{res.contribution_error / true:.2f}), of it round-off {checks.roundoff / S:.3g} S")


if __name__ == "__main__":
    main(*sys.argv[1:])
