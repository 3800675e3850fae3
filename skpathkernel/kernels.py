"""The tangent kernel and the path kernel of a trained network, as scikit-learn kernels.

:class:`TangentKernel` is the empirical neural tangent kernel ``J_k(x) J_k(x')^T`` at one
recorded point of the optimisation path; :class:`PathKernel` is Domingos' path kernel, the
optimizer-weighted sum of step kernels ``sum_k w_k J_k(x) D_k J_k(x')^T`` over the recorded
steps. Both subclass :class:`sklearn.gaussian_process.kernels.Kernel`, so they plug into
``SVC(kernel=...)``, ``KernelRidge(kernel=...)`` and ``GaussianProcessRegressor``, and
combine with other kernels (``PathKernel(est) + WhiteKernel()``).

Inputs have the form of the estimator's training inputs: 2-D features, or, for a network
given as ``module``, ``(n, ...)`` arrays (images, sequences) and integer token ids. As
scikit-learn's kernel consumers (``GaussianProcessRegressor``, ``KernelRidge``) only pass
2-D arrays, the kernels also take such inputs as flat rows, ``X.reshape(n, -1)``, and
restore ``input_shape_``; ``SVC(kernel=...)`` passes ``X`` through as it is.

They are computed by the structured engine of :mod:`skpathkernel._tangent` (no Jacobian
is formed for ``nn.Linear`` layers), in blocks bounded by the estimator's
``memory_budget``, on its device and in its dtype; the result is a float64 NumPy array.
Calls on one network from several threads (``pairwise_kernels(..., n_jobs=4)``) take
turns, as the engine hooks the network's module; a kernel's ``n_jobs`` parallelises one
call on copies of the module.
"""

from __future__ import annotations

import copy
import functools
import numbers
import sys
import threading
import warnings
import weakref

import numpy as np
import torch
from scipy.signal import lfilter
from sklearn.gaussian_process.kernels import Kernel

from ._device import to_numpy
from ._modules import running
from ._network._inputs import check_representable
from ._network._trained import KERNELS, TrainedNetwork, network_of, pipeline_last_step
from ._parallel import (
    by_reference,
    dask_worker_threads,
    limit_torch_threads,
    local_processes,
    map_ranges,
    map_row_blocks,
    n_row_blocks,
    n_tasks,
)
from ._path._training import warn_drawing_now
from ._path._trajectory import Trajectory
from ._tangent import (
    block_forward_error,
    hidden_reads,
    stacked_mlp,
    stacked_path_sum,
    tangent_gram,
    tangent_gram_diag,
)
from ._validation import check_column_names, check_flag, check_index
from ._warnings import VersionedStateMixin, caller_stacklevel

__all__ = [
    "PathKernel",
    "TangentKernel",
    "full_to_matrix",
    "matrix_to_full",
    "path_weights",
    "step_kernel",
]


# --------------------------------------------------------------------------- helpers
# Every function below _resolve takes the fitted network (a TrainedNetwork, from
# network_of): the public functions and the kernels' __call__ resolve it once per call.
def _resolve(estimator, X, Y=None):
    """``(estimator, net, X, Y)``: the estimator holding the network (a fitted Pipeline's
    last step, a search's ``best_estimator_``: :func:`pipeline_last_step`), its network,
    and ``X`` and ``Y`` as that network takes them, checked; ``Y`` None where it is None
    or ``X`` itself (the symmetric ``K(X, X)``, known before the steps transform them).

    The inputs are transformed before anything is keyed on them: the Gram memo compares
    the rows the network sees, so a refitted transformer's rows are other rows."""
    same = Y is None or Y is X
    estimator, X, Y = pipeline_last_step(estimator, X, None if same else Y)
    # Fitted first, as scikit-learn's estimators check: an unfitted kernel is the
    # problem whatever X is.
    net = network_of(estimator)
    X = _validate(estimator, net, X)
    return estimator, net, X, None if same else _validate(estimator, net, Y, "Y")


def _validate(estimator, net: TrainedNetwork, X, name="X"):
    check_column_names(estimator, X)
    # The network's input form: 2-D features, or (n, ...) arrays and token ids, which
    # also come as flat rows of n_features_in_ values (GaussianProcessRegressor and
    # KernelRidge only pass 2-D arrays).
    X = net.check(X, name, allow_flat=True)
    check_representable(X, net.torch_dtype, name)
    return X


def _check_output(output):
    if isinstance(output, str):
        if output not in ("trace", "full"):
            raise ValueError(f"output must be 'trace', 'full' or an int, got {output!r}.")
    elif isinstance(output, bool) or not isinstance(output, numbers.Integral):
        raise TypeError(f"output must be 'trace', 'full' or an int, got {output!r}.")
    return output if isinstance(output, str) else int(output)


def _check_normalized(normalized, output):
    check_flag(normalized, "normalized")
    if normalized and output == "full":
        raise ValueError("normalized=True needs a scalar kernel: output='trace' or an int, "
                         "not 'full'.")


def _consumer(kernel) -> str:
    """The module that called the kernel: that of the nearest frame on the stack that is
    not one of ``kernel``'s own methods (a subclass's override calling ``super()``
    included) nor this module.

    The stack is the only place that says who asked: scikit-learn's consumers call the
    kernel as any caller does (``kernel(X, Y)``, ``kernel(X, eval_gradient=True)``,
    ``kernel.diag(X)`` from ``GaussianProcessRegressor``, ``Sum`` and ``Product``;
    ``kernel(X, Y)`` from ``SVC`` and ``pairwise_kernels``), with nothing that marks the
    call as theirs, and a user's own code may legitimately take the 4-D blocks. Without
    frame introspection (``sys._getframe`` is CPython's) nothing is refused."""
    getframe = getattr(sys, "_getframe", None)
    frame = None if getframe is None else getframe(1)
    while frame is not None and (frame.f_globals.get("__name__") == __name__
                                 or frame.f_locals.get("self") is kernel):
        frame = frame.f_back
    return "" if frame is None else frame.f_globals.get("__name__", "")


def _refuse_matrix_consumer(kernel) -> None:
    """A clear error where scikit-learn calls a kernel whose ``output="full"`` blocks
    are not the 2-D Gram it requires (SVC, KernelRidge, GaussianProcessRegressor, the
    kernel operators Sum and Product): each would fail later on the 4-D array, or worse,
    broadcast it."""
    if kernel.output != "full":
        return
    caller = _consumer(kernel)
    if caller == "sklearn" or caller.startswith("sklearn."):
        raise ValueError(
            f"{type(kernel).__name__}(output='full') gives (n_X, n_Y, C, C) blocks, not the "
            f"2-D Gram matrix that {caller} needs. Use output='trace' or an int with "
            "scikit-learn's kernel methods, or call the kernel yourself and pass "
            "full_to_matrix(K) as a precomputed (n_X * C, n_Y * C) matrix.")


def _gram_diagonal(K: torch.Tensor) -> torch.Tensor:
    """``K(x_i, x_i)`` of a square Gram: ``(n,)``, or the ``(n, C, C)`` blocks of "full"."""
    if K.ndim == 2:
        return K.diagonal().clone()
    return torch.diagonal(K, dim1=0, dim2=1).permute(2, 0, 1).clone()


def full_to_matrix(K) -> np.ndarray:
    """The ``(n_X * C, n_Y * C)`` matrix of a kernel's ``output="full"`` blocks.

    Row ``i * C + c`` and column ``j * C + d`` hold ``K[i, j, c, d]``: sample-major, so
    that the rows of one sample's ``C`` outputs are adjacent. This is the Gram of the
    multi-output kernel regression ``vec(F(X)) = K vec(alpha)`` with ``F`` and ``alpha``
    of shape ``(n, C)`` flattened row-major (``F.reshape(-1)``).

    Parameters
    ----------
    K : array-like of shape (n_X, n_Y, C, C)
        ``TangentKernel(est, output="full")(X, Y)``, or the same from
        :class:`PathKernel` or :func:`step_kernel`.

    Returns
    -------
    G : ndarray of shape (n_X * C, n_Y * C)
        A new array (the blocks are transposed into place); symmetric when ``K`` is
        ``K(X, X)``.

    See Also
    --------
    matrix_to_full : The inverse.

    Examples
    --------
    >>> import numpy as np
    >>> from skpathkernel.kernels import full_to_matrix, matrix_to_full
    >>> K = np.arange(2 * 3 * 2 * 2).reshape(2, 3, 2, 2)
    >>> G = full_to_matrix(K)
    >>> G.shape, bool(G[1 * 2 + 0, 2 * 2 + 1] == K[1, 2, 0, 1])
    ((4, 6), True)
    >>> bool(np.array_equal(matrix_to_full(G, 2), K))
    True
    """
    K = np.asarray(K)
    if K.ndim != 4 or K.shape[2] != K.shape[3]:
        raise ValueError(f"K must have shape (n_X, n_Y, C, C) (a kernel's output='full'), "
                         f"got {K.shape}.")
    n, m, C, _ = K.shape
    return np.ascontiguousarray(K.transpose(0, 2, 1, 3)).reshape(n * C, m * C)


def matrix_to_full(G, n_outputs: int) -> np.ndarray:
    """The ``(n_X, n_Y, C, C)`` blocks of an ``(n_X * C, n_Y * C)`` sample-major matrix.

    The inverse of :func:`full_to_matrix`.

    Parameters
    ----------
    G : array-like of shape (n_X * C, n_Y * C)
        Row ``i * C + c``, column ``j * C + d`` for outputs ``c`` and ``d`` of samples
        ``i`` and ``j``.
    n_outputs : int
        ``C``.

    Returns
    -------
    K : ndarray of shape (n_X, n_Y, C, C)

    Examples
    --------
    >>> import numpy as np
    >>> from skpathkernel.kernels import matrix_to_full
    >>> matrix_to_full(np.eye(6), 3)[1, 1]
    array([[1., 0., 0.],
           [0., 1., 0.],
           [0., 0., 1.]])
    """
    G = np.asarray(G)
    if isinstance(n_outputs, bool) or not isinstance(n_outputs, numbers.Integral) \
            or n_outputs < 1:
        raise ValueError(f"n_outputs must be a positive int, got {n_outputs!r}.")
    C = int(n_outputs)
    if G.ndim != 2 or G.shape[0] % C or G.shape[1] % C:
        raise ValueError(f"G must be a 2-D array whose sides are multiples of n_outputs="
                         f"{C}, got shape {G.shape}.")
    n, m = G.shape[0] // C, G.shape[1] // C
    return np.ascontiguousarray(G.reshape(n, C, m, C).transpose(0, 2, 1, 3))


def _tensors(net: TrainedNetwork, X, Y):
    Xt = None if X is None else net.tensor(X)
    Yt = None if Y is None else net.tensor(Y)
    return Xt, Yt


def _step_setup(net: TrainedNetwork, point, output, preconditioned, scales=None):
    """Parameters at one recorded point and the engine's keyword arguments (``scales``:
    the parameter groups' step size scales of the point, see :func:`_point_diagonal`)."""
    traj = net.trajectory
    check_index(point, "step")
    point = int(point)
    if not -len(traj) <= point < len(traj):
        raise IndexError(f"step {point} is out of range for {len(traj)} recorded points.")
    point %= len(traj)
    params = net.params_at(point)
    weight = None
    if preconditioned and len(traj) > 1:
        # The last point has no step leaving it; it takes the last recorded state.
        D = _point_diagonal(traj, min(point, len(traj) - 2), scales)
        weight = None if D is None else D.to(device=net.torch_device, dtype=net.torch_dtype)
    kw = dict(output=output, diag_weight=weight, memory_budget=net.memory_budget)
    return net.module, params, kw


def step_kernel(
    estimator,
    X,
    Y=None,
    *,
    step: int = -1,
    output: str | int = "trace",
    preconditioned: bool = False,
    normalized: bool = False,
) -> np.ndarray:
    """Gram matrix of one step kernel at recorded point ``step``.

    ``preconditioned=False`` gives the tangent kernel ``J_k(X) J_k(Y)^T``; ``True`` the
    optimizer-weighted step kernel ``J_k(X) D_k J_k(Y)^T`` with the optimizer's diagonal
    preconditioner at that step (the identity for SGD; the last recorded state for the
    final point, which no step leaves).

    Parameters
    ----------
    estimator : fitted skpathkernel estimator, RecordedNetwork, TrainedNetwork, Pipeline or search
        The trained network whose recorded path holds the point; a fitted Pipeline or
        search as :class:`TangentKernel` takes it (its network, on inputs through the
        steps before it).
    X : array-like of shape (n_samples_X, n_features) or (n_samples_X, ...)
        In the form of the estimator's training inputs, or flat rows of
        ``n_features_in_`` values each.
    Y : array-like of shape (n_samples_Y, n_features) or (n_samples_Y, ...), default=None
        ``None`` (or ``X`` itself) means ``Y = X`` (and uses the symmetry).
    step : int, default=-1
        Recorded point of ``estimator.trajectory_`` (negative indices count from the end).
    output : "trace", "full" or int, default="trace"
        See :class:`TangentKernel`; "full" returns the ``(n_X, n_Y, C, C)`` blocks.
    preconditioned : bool, default=False
        Weight the inner product with the optimizer's diagonal preconditioner at that
        step, as the step actually moved the parameters.
    normalized : bool, default=False
        Divide by ``sqrt(K(x, x) K(y, y))`` (not available with ``output="full"``).

    Returns
    -------
    K : ndarray of float64, shape (n_samples_X, n_samples_Y) or (n_X, n_Y, C, C)
        The Gram matrix.

    Examples
    --------
    >>> import numpy as np
    >>> from skpathkernel import PathKernelMachine
    >>> from skpathkernel.kernels import TangentKernel, step_kernel
    >>> X = np.linspace(-1, 1, 10).reshape(-1, 1); y = np.sin(3 * X).ravel()
    >>> est = PathKernelMachine(hidden_layer_sizes=(8,), max_iter=5, tol=None,
    ...                         dtype="float64", random_state=0).fit(X, y)
    >>> step_kernel(est, X, step=0).shape
    (10, 10)
    >>> bool(np.allclose(step_kernel(est, X), TangentKernel(est)(X)))
    True
    """
    check_flag(preconditioned, "preconditioned")
    output = _check_output(output)
    _check_normalized(normalized, output)
    check_index(step, "step")
    # Y is X: K(X, X) from its symmetry, as the kernels' call takes it.
    _, net, X, Y = _resolve(estimator, X, Y)
    with running(net.module, warn_drawing_now):
        return _check_finite(_step_gram(net, X, Y, step, output, preconditioned, normalized),
                             net, X, Y)


def _step_gram(net: TrainedNetwork, X, Y, step, output, preconditioned, normalized):
    """:func:`step_kernel` on arguments already checked (the kernels' call checks them)."""
    return to_numpy(_step_sums(net, X, Y, step, output, preconditioned, normalized,
                               diag=False)[0])


def _step_sums(net: TrainedNetwork, X, Y, step, output, preconditioned, normalized, *,
               diag):
    """``(K, dx, dy)`` of :func:`_step_gram`, float64 tensors, normalized as the kernel
    is (:func:`_own_sums`); the diagonals None unless ``diag`` or ``normalized``."""
    Xt, Yt = _tensors(net, X, Y)
    module, params, kw = _step_setup(net, step, output, preconditioned)
    # K in float64 from the start: a float32 network's Gram is widened panel by panel,
    # never held twice (the float64 copy of a 4096^2 Gram cost a third of the call).
    K = tangent_gram(module, params, Xt, Yt, out_dtype=torch.float64, blocks_last=True, **kw)
    if not (diag or normalized):
        return K, None, None
    if Yt is None:
        dx = dy = K.diagonal().clone()
    else:
        dx = tangent_gram_diag(module, params, Xt, **kw).to(torch.float64)
        dy = tangent_gram_diag(module, params, Yt, **kw).to(torch.float64)
    return _own_sums(K, dx, dy, normalized, same=Yt is None)


def _check_finite(K: np.ndarray, net: TrainedNetwork, X=None, Y=None) -> np.ndarray:
    """``K``, refused where it overflowed: a float32 network's tangent features grow with
    large inputs (a ReLU network's linearly) past float32's range, and the Gram then held
    inf (or nan) entries without a word, while ``predict`` stayed finite.

    ``X``, ``Y`` (checked inputs, None: not known): the inputs of ``K``, whose outputs
    say whether the network itself is not finite there."""
    # The sum first: finite only if every entry is (inf or NaN anywhere makes it inf or
    # NaN), without the n^2 temporary of isfinite (a fresh 1 MB at N = 1024, 256 page
    # faults on a cold heap); a finite float64 K whose sum overflows is checked entry by
    # entry. (Without a RuntimeWarning for that overflow, or for inf - inf.)
    with np.errstate(over="ignore", invalid="ignore"):
        total = K.sum()
    if not np.isfinite(total) and not np.isfinite(K).all():
        n_bad = int(np.size(K) - np.count_nonzero(np.isfinite(K)))
        # A diverged path ends non-finite (NaN stays NaN): its kernels were blamed on the
        # inputs, which no scaling cures.
        bad = [name for name, p in net.params_at(-1).items()
               if not bool(torch.isfinite(p).all())]
        if bad:
            raise ValueError(
                f"The kernel has {n_bad} non-finite entries: the network's parameters "
                f"{', '.join(map(repr, bad[:5]))}{' ...' if len(bad) > 5 else ''} hold NaN "
                "or inf at the last recorded point, so its training diverged. Train with "
                "a smaller learning rate (or clipped gradients).")
        # float64 is the way out only for a narrower dtype: a float64 network past its
        # range (a ReLU network at 1e160) has only its inputs to scale.
        way_out = ("Scale the inputs" if net.torch_dtype == torch.float64
                   else "Fit with dtype='float64', or scale the inputs")
        # A network whose own output is NaN at an input (an attention with every key
        # masked: a softmax over -inf only, on a sequence of padding alone) has NaN
        # features there in any dtype: the overflow below was blamed, and float64 advised.
        n_out = sum(int(np.count_nonzero(~np.isfinite(net.outputs(Z)).all(axis=1)))
                    for Z in (X, Y) if Z is not None)
        if n_out:
            raise ValueError(
                f"The kernel has {n_bad} non-finite entries: the network's own outputs "
                f"are NaN or inf at {n_out} of these inputs (at the last recorded point), "
                "and so are its tangent features. NaN comes from the module's forward in "
                "any dtype: e.g. an attention whose every key is masked (a sequence of "
                "padding alone) or a mean over no unmasked position; leave such inputs "
                f"out, or make the forward finite on them. For outputs past the range of "
                f"{str(net.torch_dtype).removeprefix('torch.')}: {way_out}.")
        raise ValueError(
            f"The kernel has {n_bad} non-finite entries: the network's tangent features "
            f"overflow in {str(net.torch_dtype).removeprefix('torch.')} at some of these "
            f"inputs (products beyond its range). {way_out}.")
    return K


def _checked_sums(sums, net: TrainedNetwork, X=None, Y=None) -> tuple:
    """The kernel's ``(K, dx, dy)`` as arrays, refused as :func:`_check_finite` refuses."""
    return tuple(_check_finite(to_numpy(t), net, X, Y) for t in sums)


def _own_sums(K, dx, dy, normalized, same=False):
    """``K`` and its diagonals ``dx``, ``dy``, normalized where ``normalized``: the
    cosines, and diagonals 1 where the feature has a direction and 0 where it is zero, as
    ``diag`` gives them (nan where its norm overflowed), so that
    ``dx_i + dy_j - 2 K_ij`` is the squared distance of the normalized features, a zero
    feature's the origin (at distance 1 from every unit feature, 0 from another zero)."""
    if not normalized:
        return K, dx, dy
    own = (torch.where(d.isfinite(), (d > 0).to(K.dtype), float("nan")) for d in (dx, dy))
    return _normalize(K, dx, dy, same=same), *own


def _normalize(K, dx, dy, same=False):
    """``K / sqrt(dx dy^T)``; ``same``: ``K`` is ``K(X, X)`` and ``dx`` its diagonal."""
    # Zero-norm features (a dead network at x) have no direction: their rows are 0.
    # A squared norm that overflowed (inf, or nan) is no zero norm: its rows are nan, for
    # the kernels' finiteness check (rsqrt(inf) = 0 read as a dead network's cosines 0).
    nan = float("nan")
    sx = torch.where(dx > 0, dx.clamp_min(0).rsqrt(), torch.zeros_like(dx))
    sx = torch.where(dx.isfinite(), sx, nan)
    sy = torch.where(dy > 0, dy.clamp_min(0).rsqrt(), torch.zeros_like(dy))
    sy = torch.where(dy.isfinite(), sy, nan)
    # The scales' outer product first: s_i s_j = s_j s_i, so a symmetric K stays exactly
    # symmetric ((K_ij s_i) s_j and (K_ji s_j) s_i round apart). Cosines lie in [-1, 1]
    # (Cauchy-Schwarz), which rounding overstepped by an ulp, and K(X, X)'s diagonal is
    # exactly 1 where the feature has a direction, as diag() gives it.
    out = (K * (sx[:, None] * sy[None, :])).clamp_(-1.0, 1.0)
    if same:
        out.diagonal().copy_(torch.where(dx.isfinite(), (dx > 0).to(out.dtype), nan))
    return out


_MEMORY = ("discrete", "continuous")


def _check_memory(memory):
    if not isinstance(memory, str) or memory not in _MEMORY:
        raise ValueError(f"memory must be 'discrete' or 'continuous', got {memory!r}.")


def _step_memory_weights(trajectory, begin: int = 0, end: int | None = None,
                         rates=None) -> np.ndarray:
    """Total weight of each optimizer step's gradient in the updates of steps ``< end``.

    Entry ``s - begin`` is ``W_s = sum_{t=s}^{end-1} coef_t m^(t-s)`` for
    ``begin <= s < end`` (``end=None``: the last step): how much the gradient taken at
    optimizer step ``s`` has moved the parameters by step ``end`` through the optimizer's
    first-moment memory ``m`` (``Trajectory.step_coefficients``), the memory that the
    decomposition's adjoint recursion carries, plus ``direct_s`` (Nesterov's own-gradient
    term, which skips the memory). The preconditioner ``D_t`` and weight decay are not
    part of it. ``rates`` (steps ``begin..end`` x columns): each step's ``coef_t`` and
    ``direct_t`` times its row, one column of weights each (a parameter group's step
    sizes relative to the step's, :func:`_carried_scales`).
    """
    coef, memory, direct = trajectory.step_coefficients(direct=True)
    stop = trajectory.n_steps if end is None else end
    coef, direct = coef[begin:stop], direct[begin:stop]
    if rates is not None:
        coef, direct = coef[:, None] * rates, direct[:, None] * rates
    if not memory:
        return coef + direct
    # W_s = coef_s + m W_{s+1}: a first-order recursion, run backwards over the steps.
    return lfilter([1.0], [1.0, -memory], coef[::-1], axis=0)[::-1] + direct


def path_weights(trajectory, start: int = 0, stop: int | None = None,
                 memory: str = "discrete") -> list[tuple[int, float]]:
    """Recorded points ``k`` in ``[start, stop)`` and their path-kernel weights ``w_k``.

    ``memory="discrete"`` (the default): ``w_k`` is the total weight that the gradients of
    the optimizer steps leaving point ``k`` receive in the parameters at the end of the
    range, through the optimizer's first-moment memory, exactly as the optimizer applied
    it: for SGD with heavy-ball momentum ``mu``,
    ``sum_{t>=s} lr_t mu^(t-s)`` up to the range's last step (with Nesterov momentum
    ``lr_s + mu sum_{t>=s} lr_t mu^(t-s)``: the step's own gradient enters its update
    once more, outside the buffer); for Adam / AdamW the
    bias-corrected ``sum_{t>=s} lr_t (1 - b1) b1^(t-s) / (1 - b1^(t+1))``, which gives
    the first gradients a total weight up to about 3 ``lr``; plain SGD and RMSprop
    ``lr_s``. A step whose gradient was clipped weighs that many times its factor
    (:attr:`~skpathkernel.Trajectory.gradient_scales`; "continuous" as well), the
    gradient the optimizer applied. This is the weighting of the decomposition's
    ``first_order`` formula and of its exact adjoint recursion, so that the path kernel,
    the first-order formula and the exact decomposition describe one object.

    ``memory="continuous"``: Domingos' continuous-time limit,
    ``w_k = learning_rates[k] * (steps[k + 1] - steps[k]) * m`` with
    ``m = 1 / (1 - momentum)`` for SGD with momentum (heavy-ball or Nesterov: both
    weigh a gradient ``lr / (1 - momentum)`` in all) and ``m = 1`` otherwise (Adam's
    first-moment weights sum to one far from the first and last steps). It ignores the
    bias correction and the end of training, where the last gradients had no time to act.

    Points run over those with a step leaving them (``0 .. len(trajectory) - 2``), with
    Python slice semantics for ``start`` and ``stop``; a point with ``record_every > 1``
    stands for the steps of its interval, each taking the interval's mean step size
    (:meth:`~skpathkernel.Trajectory.step_coefficients`). Where a schedule changes the
    step size inside an interval of a momentum or Adam path, ``w_k`` is therefore that
    Riemann sum's weight, not the sum of the every-step weights of the interval's steps
    (they differ by how the step sizes vary inside it).

    Parameters
    ----------
    trajectory : Trajectory
        A recorded path, e.g. a fitted estimator's ``trajectory_``.
    start : int or None, default=0
        First recorded point of the range (None: the first).
    stop : int or None, default=None
        End of the range (excluded); None runs to the last point with a step leaving it.
    memory : {"discrete", "continuous"}, default="discrete"
        How the optimizer's first-moment memory weights each step's gradients (above).

    Returns
    -------
    weights : list of (int, float)
        ``(k, w_k)`` for each recorded point of the range, in increasing ``k``.

    Examples
    --------
    Plain SGD weights each step by its learning rate:

    >>> import numpy as np
    >>> from skpathkernel import PathKernelMachine
    >>> from skpathkernel.kernels import path_weights
    >>> X = np.linspace(-1, 1, 10).reshape(-1, 1); y = np.sin(3 * X).ravel()
    >>> est = PathKernelMachine(hidden_layer_sizes=(8,), solver="sgd", max_iter=3,
    ...                         learning_rate_init=0.1, tol=None, random_state=0)
    >>> [(k, round(w, 6)) for k, w in path_weights(est.fit(X, y).trajectory_)]
    [(0, 0.1), (1, 0.1), (2, 0.1)]
    """
    _check_memory(memory)
    if not isinstance(trajectory, Trajectory):
        # An estimator (or an array) failed with an AttributeError about .steps.
        raise TypeError(f"trajectory must be a Trajectory, e.g. a fitted estimator's "
                        f"trajectory_; got {type(trajectory).__name__}.")
    # A bool would slice as 0 or 1, silently.
    check_index(start, "start", allow_none=True)
    check_index(stop, "stop", allow_none=True)
    steps = np.asarray(trajectory.steps)
    points = range(len(trajectory) - 1)[slice(start, stop)]
    if not points:
        return []
    if memory == "continuous":
        spec = trajectory.solver_spec
        m = 1.0 / (1.0 - spec.momentum) if spec.name == "sgd" and spec.momentum else 1.0
        # A clipped step's gradient was scaled by its recorded factor (1 when unclipped).
        scales = trajectory.gradient_scales
        return [(k, float(trajectory.learning_rates[k]) * m
                 * float(scales[steps[k] : steps[k + 1]].sum())) for k in points]
    begin, end = int(steps[points[0]]), int(steps[points[-1] + 1])
    W = _step_memory_weights(trajectory, begin, end) * trajectory.gradient_scales[begin:end]
    return [(k, float(W[steps[k] - begin : steps[k + 1] - begin].sum())) for k in points]


def _carried_scales(trajectory, weights, memory) -> dict[int, np.ndarray] | None:
    """The parameter groups' step size scales with which the path kernel weighs each
    point of ``weights`` (a whole range's :func:`path_weights`), or None where they are
    the point's own :meth:`~skpathkernel.Trajectory.step_size_scales` (no parameter
    groups, no momentum, "continuous" memory, or groups whose ratios do not change).

    Through momentum or Adam's first moment, a gradient moves the parameters in the
    updates of later steps, each taken at that step's own group step sizes: group ``g``
    gives the gradients of point ``k`` the total weight ``W_gk`` of
    :func:`_step_memory_weights` with every step's ``coef_t`` and ``direct_t`` times
    its group scale ``r_gt``, and its scale is ``W_gk / w_k``. The point's own scales
    ``r_gk`` instead were 0.16 off on a momentum-0.7 SGD path whose two groups followed
    different ``LambdaLR`` schedules (against the optimizer's replayed weights).
    Entry ``k``: the ``(n_groups,)`` scales of point ``k``.
    """
    group_lrs = getattr(trajectory, "_group_lrs", None)
    if memory != "discrete" or group_lrs is None or not weights:
        return None
    momentum = trajectory.step_coefficients(direct=True)[1]
    points = [k for k, _ in weights]
    lrs = np.asarray(trajectory.learning_rates, dtype=np.float64)[:, None]
    # Each point's group step sizes over learning_rates[k], as step_size_scales has them.
    ratios = np.divide(group_lrs, lrs, out=np.zeros_like(group_lrs), where=lrs != 0)
    if not momentum or np.all(ratios[points] == ratios[points[0]]):
        return None
    steps = np.asarray(trajectory.steps)
    begin, end = int(steps[points[0]]), int(steps[points[-1] + 1])
    r = ratios[np.searchsorted(steps, np.arange(begin, end), side="right") - 1]
    W = (_step_memory_weights(trajectory, begin, end, rates=r)
         * trajectory.gradient_scales[begin:end, None])
    return {k: W[steps[k] - begin : steps[k + 1] - begin].sum(axis=0) / w if w else ratios[k]
            for k, w in weights}


def _point_diagonal(trajectory, k: int, scales) -> torch.Tensor | None:
    """The path kernel's ``D_k`` at point ``k``: the optimizer's diagonal times the
    parameter groups' ``scales`` ((n_groups,), from :func:`_carried_scales`); None:
    :meth:`~skpathkernel.Trajectory.preconditioner`, with the point's own scales."""
    if scales is None:
        return trajectory.preconditioner(k)
    groups = list(trajectory._param_groups)
    return trajectory._preconditioner(k, trajectory._per_parameter(scales[groups]))


def _path_sum(net, X, Y, start, stop, output, *, gram, diag, memory="discrete",
              weights=None, scales=None):
    """Weighted sums over steps of Grams and/or diagonals: memory independent of T.

    ``weights``: the ``(point, w_k)`` pairs to sum when the caller has them (a range of a
    longer path, whose "discrete" weights depend on where the whole path ends), and
    ``scales`` their parameter groups' scales (:func:`_carried_scales`).
    """
    if weights is None:
        check_index(start, "start", allow_none=True)
        check_index(stop, "stop", allow_none=True)
        weights = path_weights(net.trajectory, start, stop, memory)
        scales = _carried_scales(net.trajectory, weights, memory)
    if not weights:
        raise ValueError(
            f"The path kernel's range of recorded points [start={start}, stop={stop}) is "
            f"empty (the trajectory has {len(net.trajectory) - 1} steps to sum)."
        )
    Xt, Yt = _tensors(net, X, Y)
    stacked = _stacked_sum(net, Xt, Yt, weights, output, gram=gram, diag=diag,
                           scales=scales)
    if stacked is not None:
        return stacked
    K = dx = dy = None
    # K(X, X) holds its own diagonal: no separate diagonal pass is needed.
    diag_from_gram = gram and diag and Yt is None
    # The autograd check for hidden reads runs once, at the path's first, middle and last
    # points, not at every step (the use watch still runs in every capture).
    picks = sorted({weights[0][0], weights[len(weights) // 2][0], weights[-1][0]})
    exclude = hidden_reads(net.module, [net.params_at(k) for k in picks],
                           [Xt] if Yt is None else [Xt, Yt], output=output,
                           memory_budget=net.memory_budget)
    for k, w in weights:
        module, params, kw = _step_setup(net, k, output, True,
                                         None if scales is None else scales[k])
        kw.update(exclude=exclude, check_hidden=False)
        if gram:
            part = tangent_gram(module, params, Xt, Yt, out_dtype=torch.float64,
                                blocks_last=True, **kw)
            K = part.mul_(w) if K is None else K.add_(part, alpha=w)
        if diag and not diag_from_gram:
            d = tangent_gram_diag(module, params, Xt, **kw).to(torch.float64).mul_(w)
            dx = d if dx is None else dx.add_(d)
            if Yt is not None:
                d = tangent_gram_diag(module, params, Yt, **kw).to(torch.float64).mul_(w)
                dy = d if dy is None else dy.add_(d)
    if diag_from_gram:
        dx = _gram_diagonal(K)
    return K, dx, dx if Yt is None else dy


# Rows on which the kernel of a thinned path estimates its Riemann error: the first
# training inputs (the call's rows for a network that keeps none).
THINNING_PROBE = 64
# The estimate of each path's thinned ranges, once per path, range, output and weighting:
# the kernel is called again and again inside SVC, GridSearchCV and the displays.
_THINNING_ESTIMATES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_THINNING_LOCK = threading.Lock()


def _thinning_error(net, X, start, stop, output, memory) -> tuple[int, float, str] | None:
    """``(record_every, estimate, rows)`` for a range whose recorded points stand for
    several steps each, where this call is the first to estimate it for the path (each
    path, range, output and weighting is estimated, and warned of, once), else None.

    Such a kernel is a Riemann sum: each point's step kernel stands for its interval's
    steps, ``K_h = sum_k w_k K_k``. The sum at twice the spacing puts each pair of
    points' weights on the pair's first point, ``K_2h = sum_i (w_2i + w_2i+1) K_2i`` (a
    last unpaired point keeps its own), so that both sums cover the same steps whatever
    the number of points or the length of the last interval; their difference
    ``K_2h - K_h = sum_i w_2i+1 (K_2i - K_2i+1)`` is the first-order rule's error at
    spacing ``h`` (against the integral; against the every-step sum about ``(h - 1) / h``
    of it), an estimate, not a bound. (The sums over the even and over the odd points
    alone, compared before, cover different steps unless the points are even in number
    with equal weights: five points recorded every 3 steps read 0.21 where the kernel was
    off by 0.0044.) Taken on ``K(R, R)`` for the first :data:`THINNING_PROBE` training
    inputs ``R`` (``rows`` says which), relative to the largest entry of ``K_h``, and
    kept with the path.
    """
    traj = net.trajectory
    weights = path_weights(traj, start, stop, memory)
    spans = np.diff(np.asarray(traj.steps))[[k for k, _ in weights]]
    if len(weights) < 2 or np.all(spans == 1):
        return None
    key = (start, stop, output, memory, len(traj))
    with _THINNING_LOCK:
        if key in _THINNING_ESTIMATES.setdefault(traj, {}):
            return None
    rows, what = ((net.X_fit, "training inputs") if net.X_fit is not None
                  else (X, "rows of the first call"))
    R = np.asarray(rows[:THINNING_PROBE])
    scales = _carried_scales(traj, weights, memory)
    second = weights[1::2]
    # The pairs' first points at their second points' weights, the second points, and
    # the first points at their own weights (K_h is the last two).
    left, right, rest = (
        _path_sum(net, R, None, None, None, output, gram=True, diag=False, weights=part,
                  scales=scales)[0]
        for part in ([(k, w) for (k, _), (_, w) in zip(weights[0::2], second)], second,
                     weights[0::2]))
    size = float((right + rest).abs().max())
    known = (int(spans.max()), float((left - right).abs().max()) / max(size, 1e-300),
             f"the first {len(R)} {what}")
    with _THINNING_LOCK:
        # Two threads may have estimated it at once: the first to keep it warns.
        first = key not in _THINNING_ESTIMATES.setdefault(traj, {})
        _THINNING_ESTIMATES[traj].setdefault(key, known)
    return known if first else None


def _forget_thinning(net, start, stop, output, memory) -> None:
    """Drop the estimate :func:`_thinning_error` kept for this range, so that the next
    call estimates and warns again."""
    traj = net.trajectory
    with _THINNING_LOCK:
        _THINNING_ESTIMATES.get(traj, {}).pop((start, stop, output, memory, len(traj)),
                                              None)


def _stacked_sum(net, Xt, Yt, weights, output, *, gram, diag, scales=None):
    """The path sum over blocks of points at once (:mod:`._tangent._stacked`), for a plain
    MLP on 2-D inputs; None where that route does not apply (the step-by-step sum then
    runs)."""
    traj = net.trajectory
    mlp = stacked_mlp(net.module, traj.names)
    if mlp is None or Xt.ndim != 2 or not Xt.is_floating_point() or \
            Xt.shape[1] != mlp.n_inputs or (Yt is not None and Yt.shape[1] != mlp.n_inputs):
        return None
    n_out = mlp.linears[-1].d_out
    full = output == "full"
    # K(X, X) holds its own diagonal: taken from it, so that a normalized Gram's
    # diagonal is exactly the normalized diag().
    own_diag = gram and diag and Yt is None
    if full and diag and not own_diag:
        return None  # the diagonal blocks alone: the step-by-step sum
    if full:
        outputs, scale = list(range(n_out)), 1.0
    elif output == "trace":
        outputs, scale = list(range(n_out)), 1.0 / n_out
    elif -n_out <= output < n_out:
        outputs, scale = [output % n_out], 1.0
    else:
        return None  # the engine names the problem
    layout, start = {}, 0
    for name, shape in zip(traj.names, traj.shapes):
        layout[name] = (start, int(np.prod(shape, dtype=np.int64)))
        start += layout[name][1]
    weighted = traj.solver_spec.name != "sgd" and len(traj) > 1
    if not weighted and any(traj.step_size_scales(k) is not None for k, _ in weights):
        # SGD whose parameter groups took their own step sizes: a diagonal at some steps
        # only, which the step-by-step sum applies per step.
        return None
    device, dtype = net.torch_device, net.torch_dtype

    def load(points):
        theta = torch.stack([traj.parameters(k) for k in points]).to(device, dtype)
        if not weighted:
            return theta, None
        # The last point has no step leaving it; it takes the last recorded state.
        D = torch.stack([_point_diagonal(traj, min(k, len(traj) - 2),
                                         None if scales is None else scales.get(k))
                         for k in points])
        return theta, D.to(device, dtype)

    # The route rebuilds the network from its layers: its forward must be the module's.
    first = weights[0][0]
    probe = Xt[:64]
    error = block_forward_error(mlp, layout, load([first])[0], net.module,
                                net.params_at(first), probe)
    if not error <= 100 * torch.finfo(dtype).eps:
        warnings.warn(
            f"The path kernel's stacked route computes outputs that differ from the "
            f"module's by {error:.2g} (relative); it falls back to the step-by-step sum.",
            RuntimeWarning, stacklevel=4)
        return None
    sums = stacked_path_sum(mlp, layout, load, weights, Xt, Yt, outputs=outputs,
                            trace_scale=scale, weighted=weighted,
                            memory_budget=net.memory_budget, gram=gram,
                            diag=diag and not own_diag, full=full)
    if sums is None or not own_diag:
        return sums
    K = sums[0]
    dx = _gram_diagonal(K)
    return K, dx, dx


def _split_path_sum(net, X, Y, start, stop, output, n_jobs, *, gram, diag, memory):
    """``_path_sum`` with the steps cut into one contiguous range per joblib worker.

    The weights are those of the whole range (with ``memory="discrete"`` they depend on
    its end); each task sums its points' weighted step kernels (reading only those
    points: on disk, its own chunk files) and the partial sums add up here, equal to the
    serial sum up to the order of the additions.
    """
    check_index(start, "start", allow_none=True)
    check_index(stop, "stop", allow_none=True)
    weights = path_weights(net.trajectory, start, stop, memory)
    if not weights:  # the serial sum says what is wrong
        return _path_sum(net, X, Y, start, stop, output, gram=gram, diag=diag)
    scales = _carried_scales(net.trajectory, weights, memory)
    shared = net.for_workers(by_reference=by_reference(n_tasks(n_jobs, len(weights))))
    parts = map_ranges(_range_sum, len(weights), n_jobs, weights, shared, X, Y, output, gram,
                       diag, scales)
    # K, dx, dy: each the sum of the tasks' parts (None where not computed).
    return tuple(None if terms[0] is None else functools.reduce(torch.add, terms)
                 for terms in zip(*parts))


def _range_sum(first, last, weights, net, X, Y, output, gram, diag, scales=None):
    # A joblib task: its own copy of the module (concurrent tasks on threads would share
    # the network's, which the engine hooks).
    return _path_sum(net.with_own_module(), X, Y, None, None, output, gram=gram, diag=diag,
                     weights=weights[first:last], scales=scales)


# --------------------------------------------------------------------------- kernels
# A kernel of fewer rows x columns x parameters x recorded points than this is computed
# on one torch thread: the Gram of the default network on digits' training set
# (1347 x 1347 x 8,970, 1.6e10) takes 0.09 s of CPU on one thread, and 0.37 s of CPU and
# 0.9 s wall on two threads of a 2-core machine that other processes share (0.65 s / 2.0 s
# for breast_cancer's 426 rows, against 0.013 s on one); the threads' wake-ups and stalls
# cost more than the products they split (training_threads does the same for the steps).
KERNEL_SINGLE_THREAD_WORK = 2**35


def kernel_threads(work: int) -> int | None:
    """Torch threads for ``work`` (rows x columns x parameters x points): 1 below
    ``KERNEL_SINGLE_THREAD_WORK``, else torch's own (a Dask worker's share)."""
    return 1 if work < KERNEL_SINGLE_THREAD_WORK else dask_worker_threads()


class _GramMemo:
    """The last Gram ``K(X, X)`` computed for a hyper-parameter search by one kernel
    object (a clone starts with its own).

    A search over the hyper-parameters of a kernel built around this one
    (``ConstantKernel() * PathKernel(est) + WhiteKernel()`` in a
    ``GaussianProcessRegressor``) asks for ``K(X, X, eval_gradient=True)`` at every
    optimizer step, and once more for the fit at the optimum (on its one clone of the
    kernel; another fit of the same kernel clones it again): without a memo each call
    recomputed a Gram that no hyper-parameter changes (35 s against 2.7 s for one
    path-kernel Gram of 331 diabetes points,
    ``benchmarks/results/user_trial_newuser-s51.md``). Only such calls store, so a plain
    ``K(X)`` keeps no second copy of its Gram.
    """

    def __init__(self):
        self.entry = None  # (network, its state, kernel parameters and budget, X, K)

    def lookup(self, estimator, net, params, X):
        entry = self.entry
        # The network by a weak reference: a memo must not keep a refitted estimator's old
        # network (its path, its temporary directory) alive.
        if (entry is None or entry[0]() is not _fitted_network(estimator, net)
                or entry[2] != (params, net.memory_budget)
                or not _same_rows(entry[3], X) or not entry[1].holds(net)):
            return None
        # A copy: GaussianProcessRegressor adds alpha to the diagonal in place.
        return entry[4].copy()

    def store(self, estimator, net, params, X, K):
        self.entry = (weakref.ref(_fitted_network(estimator, net)), _NetworkState(net),
                      (params, net.memory_budget), _copy_rows(X), K.copy())


def _fitted_network(estimator, net):
    """The network that ``net`` is (a copy of) for ``estimator``'s Gram.

    After ``set_params(memory_budget=...)`` on a fitted estimator, ``network_of`` returns
    a new copy of its ``network_`` with that budget at every call, which the memo's weak
    reference never found again (one Gram per optimizer step of a search, as without a
    memo). The memo keys the fitted network and the budget's value: blocks of another
    size round differently (a relative 3e-7 of a float32 path kernel's Gram), so a Gram
    of another budget is not the one a fresh call returns."""
    fitted = getattr(estimator, "network_", None)
    if (isinstance(fitted, TrainedNetwork) and fitted is not net
            and fitted.module is net.module and fitted.trajectory is net.trajectory):
        return fitted
    return net


class _NetworkState:
    """What a network's Gram reads besides the rows and the kernel's parameters: the path
    (its length: ``warm_start`` and ``partial_fit`` extend one), and from the module what
    the path does not hold, the tensors by value (``p.data`` edits keep their version
    counters): its buffers (BatchNorm's running statistics) and frozen parameters, and
    its layers, their modes and settings (a layer swapped, ``eps`` changed, ``train()``,
    whose Gram a fresh call refuses)."""

    def __init__(self, net):
        self.length, self.layout = len(net.trajectory), _module_layout(net.module)
        self.tensors = [t.detach().clone() for t in _unrecorded_tensors(net)]

    def holds(self, net) -> bool:
        if len(net.trajectory) != self.length or _module_layout(net.module) != self.layout:
            return False
        tensors = _unrecorded_tensors(net)
        return len(tensors) == len(self.tensors) and all(
            a.shape == b.shape and a.dtype == b.dtype and a.device == b.device
            and bool(torch.equal(a, b)) for a, b in zip(tensors, self.tensors))


def _module_layout(module):
    return tuple((name, type(m), id(m), m.training, m.extra_repr())
                 for name, m in module.named_modules())


def _unrecorded_tensors(net):
    recorded = set(net.trajectory.names)
    return [*(p for name, p in net.module.named_parameters() if name not in recorded),
            *net.module.buffers()]


def _copy_rows(X):
    return X.clone() if isinstance(X, torch.Tensor) else np.array(X, copy=True)


def _same_rows(A, B) -> bool:
    if type(A) is not type(B) or A.shape != B.shape or A.dtype != B.dtype:
        return False
    return bool(torch.equal(A, B)) if isinstance(A, torch.Tensor) else np.array_equal(A, B)


class _NetworkKernel(VersionedStateMixin, Kernel):
    """What TangentKernel and PathKernel share: validation, clone, gradient shape."""

    def is_stationary(self) -> bool:
        """Whether the kernel depends only on ``x - y``: never for a network's kernel.

        Returns
        -------
        stationary : bool
            False: the kernel depends on the inputs, not on their difference.
        """
        return False

    @property
    def requires_vector_input(self) -> bool:
        """Whether the kernel works only on fixed-length feature vectors: always True.

        Inputs of another form (images, token ids) are passed to the kernel as flat rows
        of ``n_features_in_`` values, reshaped to the network's input form.
        """
        return True

    def __sklearn_clone__(self):
        # Cloning must keep the fitted estimator (FrozenEstimator's pattern): the kernel
        # is a function of the trained network, it has nothing to refit. The copy starts
        # without the memo of the search's Gram (copy.copy leaves it out, as pickling
        # does): shared, threads fitting clones on different rows (GridSearchCV's folds)
        # evicted each other's Gram at every optimizer step.
        return copy.copy(self)

    def __getstate__(self):
        # The memo is a cache of this process's search, not part of the kernel.
        state = super().__getstate__()
        state.pop("_gram_memo", None)
        return state

    def set_params(self, **params):
        """Set the parameters of this kernel; ``estimator`` as a whole, not its own.

        The kernel is a function of the network already trained in ``estimator``, which
        every copy of the kernel shares (``clone`` keeps it): ``estimator__<name>``
        would change that estimator's parameter without refitting it, for every copy
        of the kernel, while their Grams stayed those of the fitted network. It is
        refused, as :class:`sklearn.frozen.FrozenEstimator` refuses it.

        Parameters
        ----------
        **params : dict
            Kernel parameters (``step``, ``output``, ``normalized``, ... or another
            fitted ``estimator``).

        Returns
        -------
        self : object
            The kernel.
        """
        nested = sorted(key for key in params if key.startswith("estimator__"))
        if nested:
            raise ValueError(
                f"Cannot set {', '.join(nested)}: {type(self).__name__} is the kernel of "
                "the network already trained in its estimator, which clone keeps and every "
                "copy shares; setting the estimator's parameters would not refit it. Set "
                "estimator= to another fitted estimator (in a search, in a FrozenEstimator, "
                "which the search's clone keeps fitted), or tune the trainer's parameters "
                "where it is fitted (TangentFeatureSVM's estimator__<name>).")
        return super().set_params(**params)

    def __repr__(self) -> str:
        params = ", ".join(
            f"{k}={v!r}" for k, v in self.get_params().items() if k != "estimator"
        )
        return f"{type(self).__name__}({type(self.estimator).__name__}, {params})"

    def _check_params(self):
        _check_normalized(self.normalized, _check_output(self.output))
        for name in ("step", "start", "stop"):
            if hasattr(self, name):
                # start and stop are a slice's bounds: None as in range(n)[None:stop].
                check_index(getattr(self, name), name, allow_none=name != "step")

    def __call__(self, X, Y=None, eval_gradient=False):
        """Return the kernel ``k(X, Y)`` and, optionally, its (empty) gradient.

        Parameters
        ----------
        X : array-like of shape (n_samples_X, n_features) or (n_samples_X, ...)
            In the form of the estimator's training inputs (``input_shape_``), or flat
            rows of ``n_features_in_`` values each.
        Y : array-like of shape (n_samples_Y, n_features) or (n_samples_Y, ...), default=None
            ``None`` evaluates ``k(X, X)``, as does ``X`` itself (the same object), both
            from the symmetry of ``k``: exactly symmetric.
        eval_gradient : bool, default=False
            The kernel has no tunable hyperparameter, so the gradient with respect to
            the (empty) ``theta`` has shape ``(n_samples_X, n_samples_X, 0)``. Only
            supported when ``Y`` is None. Such a call (a hyper-parameter search of a
            kernel built around this one, in ``GaussianProcessRegressor``) keeps a copy
            of its Gram and of ``X`` in this kernel object (not its clones), with a copy
            of the module's tensors that the path does not hold (buffers, frozen
            parameters), and the next ``k(X)`` of the same rows, network (with the same
            ``memory_budget``, which rounds differently in other blocks), module state
            and parameters returns a copy of it instead of recomputing it.

        Returns
        -------
        K : ndarray of shape (n_samples_X, n_samples_Y)
            Or ``(n_samples_X, n_samples_Y, C, C)`` for ``output="full"``: ``K[i, j]`` is
            the ``C x C`` block ``J(x_i) J(y_j)^T`` (:func:`full_to_matrix` makes it the
            ``(n_X * C, n_Y * C)`` matrix).
        K_gradient : ndarray of shape (n_samples_X, n_samples_X, 0), optional
            With ``output="full"``, ``K.shape + (0,)``.
        """
        if eval_gradient and Y is not None:
            raise ValueError("Gradient can only be evaluated when Y is None.")
        self._check_params()
        _refuse_matrix_consumer(self)
        # Y is X (SVC's fit calls kernel(X, X)): K(X, X), symmetric, as scikit-learn's
        # pairwise functions take it; the general route took 2.7 times as long for a
        # path kernel and gave a Gram asymmetric by round-off (1e-7 in float32).
        estimator, net, X, Y = _resolve(self.estimator, X, Y)
        memo = (self.__dict__.setdefault("_gram_memo", _GramMemo()) if eval_gradient
                else self.__dict__.get("_gram_memo"))
        params = self.get_params(deep=False)
        params.pop("estimator")
        K = (None if memo is None or Y is not None
             else memo.lookup(estimator, net, params, X))
        if K is None:
            work = len(X) * len(X if Y is None else Y) * net.n_params * self._n_points(net)
            # The lock first: a call waiting for the module keeps no thread limit in force
            # (while one is, threads that first use torch start from it; see
            # torch_threads).
            threads = kernel_threads(work)
            with running(net.module, warn_drawing_now), limit_torch_threads(threads):
                K = _check_finite(self._bind(net)._gram_blocks(X, Y), net, X, Y)
            if eval_gradient:
                memo.store(estimator, net, params, X, K)
        if eval_gradient:
            return K, np.empty(K.shape + (0,))
        return K

    def diag(self, X) -> np.ndarray:
        """Diagonal ``k(x, x)`` of the kernel, without computing the Gram.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features) or (n_samples, ...)
            In the form of the estimator's training inputs (``input_shape_``), or flat
            rows of ``n_features_in_`` values each.

        Returns
        -------
        K_diag : ndarray of shape (n_samples,)
            Or the ``(n_samples, C, C)`` blocks ``K[i, i]`` for ``output="full"``.
        """
        self._check_params()
        _refuse_matrix_consumer(self)
        _, net, X, _ = _resolve(self.estimator, X)
        with running(net.module, warn_drawing_now):
            d = _check_finite(self._bind(net)._diag_blocks(X), net, X)
        if self.normalized:
            # As in the Gram: 1 where the feature has a direction, 0 where it is zero (a
            # dead network at x), so that diag(X) equals the diagonal of k(X).
            return (d > 0).astype(np.float64)
        return d

    def _n_points(self, net: TrainedNetwork) -> int:
        """The recorded points the kernel sums over."""
        return 1

    def _bind(self, net: TrainedNetwork):
        # A copy that computes with the network itself: resolved once per call, and what
        # tasks on workers get instead of the estimator around it.
        kernel = copy.copy(self)
        kernel.estimator = net
        # The engine takes a plain int: a NumPy integer (np.argmax, a grid over
        # np.arange(C)) becomes the index it holds, on every route (diag's included).
        kernel.output = _check_output(self.output)
        return kernel

    # The methods below run on a bound kernel: self.estimator is a TrainedNetwork.
    def _gram_blocks(self, X, Y):
        if n_row_blocks(self.n_jobs, X) == 1:
            return self._gram(X, Y)
        # Rows of the raw Gram through joblib (K(X, X) gives up its symmetry), then the
        # normalisation here, with the same diagonals as the serial path.
        K = np.vstack(map_row_blocks(_raw_gram_rows, X, self.n_jobs, self._for_workers(),
                                     X if Y is None else Y))
        if Y is None:
            # Both triangles came from different blocks, rounded apart (1.5e-7 in
            # float32): their mean is exactly symmetric, as the serial K(X) is (for
            # output="full", K[j, i] is the transposed block K[i, j]^T).
            K = (K + K.transpose((1, 0) + tuple(range(K.ndim - 1, 1, -1)))) / 2
        if self.normalized:
            if Y is None:
                dx = dy = K.diagonal().copy()
            else:
                dx, dy = self._diag_blocks(X), self._diag_blocks(Y)
            K = to_numpy(_normalize(*map(torch.from_numpy, (K, dx, dy)), same=Y is None))
        return K

    def _diag_blocks(self, X):
        kernel = self if n_row_blocks(self.n_jobs, X) == 1 else self._for_workers()
        return np.concatenate(map_row_blocks(_diag_rows, X, self.n_jobs, kernel))

    def _for_workers(self):
        # Tasks get the on-disk trajectory by reference, leaving this one's directory
        # temporary (pickling the trajectory itself would keep it, see _storage), and
        # loky processes an in-memory one as the name of its shared files (the callers
        # run more than one row block).
        return self._bind(self.estimator.for_workers(by_reference=local_processes()))


# joblib tasks (module level, so that they pickle to workers by reference)
def _raw_gram_rows(X_rows, kernel, Y):
    return _own_module(kernel)._raw_gram(X_rows, Y)


def _diag_rows(X_rows, kernel):
    return _own_module(kernel)._diag(X_rows)


def _own_module(kernel):
    # Concurrent tasks can share one network (threads, a Dask worker's thread pool) and
    # the engine hooks the module it runs: each task gets its own copy of the module.
    return kernel._bind(kernel.estimator.with_own_module())


class TangentKernel(_NetworkKernel):
    """Empirical tangent kernel of a trained network at one recorded point.

    ``K(x, x') = J_k(x) J_k(x')^T`` with ``J_k(x) = d f(x; theta_k) / d theta`` the
    tangent features at point ``step`` of the estimator's recorded trajectory (the
    learned tangent features at the default ``step=-1``). For a network with ``C > 1``
    outputs, ``output="trace"`` gives ``trace(J(x) J(x')^T) / C``; an int selects one
    output's kernel; ``output="full"`` gives every ``C x C`` block (see Notes).

    Computed without forming the Jacobian for ``nn.Linear`` layers (other layers go
    through a chunked ``torch.func`` fallback), in blocks bounded by the estimator's
    ``memory_budget``, on its device and dtype; returned as float64.

    Parameters
    ----------
    estimator : fitted skpathkernel estimator, RecordedNetwork, TrainedNetwork, Pipeline or search
        Kept as is (not refitted by ``clone``); its ``network_`` is read at every call.
        A fitted :class:`~sklearn.pipeline.Pipeline` ending in one stands for its last
        step, on the inputs the steps before it transform: ``X`` and ``Y`` are raw
        inputs, passed through ``pipe[:-1].transform`` at every call, so that
        ``SVC(kernel=...)`` fits on the pipeline's inputs. A search refitted on the whole
        data (``GridSearchCV``, ``RandomizedSearchCV``, ``refit=True``) stands for its
        ``best_estimator_``, a pipeline or not, and a ``FrozenEstimator`` for the
        estimator it holds (a pipeline too). Wrappers whose network saw other inputs or
        targets (a bag, one estimator per output, ``TransformedTargetRegressor``) are
        refused with a ``TypeError`` naming the estimator inside.
    step : int, default=-1
        Recorded point of ``estimator.trajectory_``; negative counts from the end.
    output : "trace", "full" or int, default="trace"
        Scalar summary of the ``C x C`` kernel blocks, the output to use, or "full":
        the blocks themselves, an ``(n_X, n_Y, C, C)`` array (Notes).
    normalized : bool, default=False
        Return ``K(x, x') / sqrt(K(x, x) K(x', x'))`` (cosine similarity of tangent
        features); rows of zero-norm features are 0.
    n_jobs : int, default=None
        Number of joblib workers for Grams and diagonals: the rows of ``X`` are split
        into one block per worker, run with ``Parallel(n_jobs)``, so the same call fans
        out to loky processes or, under ``joblib.parallel_config(backend="dask")``, to a
        Dask cluster. ``None`` means 1 unless in a joblib context; ``-1`` all workers.
        Each task runs torch with ``max(1, cpu_count // n_jobs)`` threads. The result
        equals the serial one up to round-off (the blocks of ``K(X, X)`` do not use its
        symmetry). Not a hyperparameter: it does not appear in ``theta``.

    See Also
    --------
    PathKernel : The optimizer-weighted sum of step kernels along the trajectory.
    step_kernel : One step's Gram, optionally preconditioned.
    full_to_matrix : The ``(n_X * C, n_Y * C)`` matrix of ``output="full"``.

    Notes
    -----
    ``output="full"`` returns ``K`` of shape ``(n_X, n_Y, C, C)`` with ``K[i, j, c, d]
    = <d f_c(x_i) / d theta, d f_d(y_j) / d theta>`` (with ``D_k`` and the sum over
    steps for the path kernel), the layout of neural-tangents' ``trace_axes=()``;
    :func:`full_to_matrix` turns it into the ``(n_X * C, n_Y * C)`` matrix of
    multi-output kernel regression, :func:`matrix_to_full` back. It is computed by the
    same structured engine and memory budget as the trace, at about ``C`` times its
    cost or less (more at large ``n`` for a one-hidden-layer network's path kernel with
    SGD, whose trace sums the layer below the output over the outputs in one product
    where the blocks need ``C (C + 1) / 2``); ``diag(X)`` returns the ``(n_X, C, C)``
    blocks ``K[i, i]``. It is not a scalar kernel: ``normalized=True`` is refused, and
    scikit-learn's kernel methods (``SVC``, ``KernelRidge``, ``GaussianProcessRegressor``,
    the ``+`` and ``*`` of kernels), which need a 2-D Gram, get a ``ValueError`` when they
    call it.

    Examples
    --------
    >>> import numpy as np
    >>> from sklearn.svm import SVR
    >>> from skpathkernel import PathKernelMachine
    >>> from skpathkernel.kernels import TangentKernel
    >>> X = np.linspace(-1, 1, 30).reshape(-1, 1); y = np.sin(3 * X).ravel()
    >>> est = PathKernelMachine(hidden_layer_sizes=(16,), max_iter=20, tol=None, dtype="float64",
    ...                         random_state=0).fit(X, y)
    >>> kernel = TangentKernel(est)
    >>> K = kernel(X)
    >>> K.shape, bool(np.allclose(K, K.T))
    ((30, 30), True)
    >>> bool(np.allclose(np.diag(K), kernel.diag(X)))
    True
    >>> SVR(kernel=kernel).fit(X, y).predict(X[:2]).shape
    (2,)

    The ``C x C`` blocks of a classifier with three classes:

    >>> from skpathkernel import PathKernelClassifier
    >>> from skpathkernel.kernels import full_to_matrix
    >>> Xc = np.random.default_rng(0).normal(size=(12, 2)); yc = np.arange(12) % 3
    >>> clf = PathKernelClassifier(hidden_layer_sizes=(8,), max_iter=5, tol=None,
    ...                            dtype="float64", random_state=0).fit(Xc, yc)
    >>> K = TangentKernel(clf, output="full")(Xc)
    >>> K.shape, full_to_matrix(K).shape
    ((12, 12, 3, 3), (36, 36))
    >>> bool(np.allclose(np.trace(K, axis1=2, axis2=3) / 3, TangentKernel(clf)(Xc)))
    True
    """

    def __init__(self, estimator, step=-1, output="trace", normalized=False, n_jobs=None):
        self.estimator = estimator
        self.step = step
        self.output = output
        self.normalized = normalized
        self.n_jobs = n_jobs

    # X and Y come checked by __call__ (on workers, rows of the checked X).
    def _gram(self, X, Y):
        return _step_gram(self.estimator, X, Y, self.step, _check_output(self.output),
                          False, self.normalized)

    def _raw_gram(self, X, Y):
        return _step_gram(self.estimator, X, Y, self.step, _check_output(self.output),
                          False, False)

    def _sums(self, X, Y):
        """``K(X, Y)`` and both diagonals as the kernel and its ``diag`` give them, in one
        pass; refused where they overflowed."""
        return _checked_sums(_step_sums(self.estimator, X, Y, self.step,
                                        _check_output(self.output), False, self.normalized,
                                        diag=True), self.estimator, X, Y)

    def _diag(self, X):
        Xt, _ = _tensors(self.estimator, X, None)
        module, params, kw = _step_setup(self.estimator, self.step, self.output, False)
        return to_numpy(tangent_gram_diag(module, params, Xt, **kw).to(torch.float64))


class PathKernel(_NetworkKernel):
    """Path kernel of a trained network: the optimizer-weighted sum of step kernels.

    ``K(x, x') = sum_k w_k J_k(x) D_k J_k(x')^T`` over the recorded points
    ``k in [start, stop)`` of the estimator's trajectory (each one a step leaving it),
    with ``D_k`` the optimizer's diagonal preconditioner at that step (identity for SGD,
    ``1 / (sqrt(v_hat) + eps)`` for Adam / AdamW, ``1 / (sqrt(v) + eps)`` for RMSprop)
    and ``w_k`` the step's weight (:func:`path_weights`): with ``memory="discrete"``
    (default) the total weight that the optimizer gave the step's gradient up to the end
    of the range, through its momentum / first-moment memory, as the decomposition's
    ``first_order`` and ``exact`` methods weight it (for SGD with heavy-ball momentum
    ``mu`` that is ``sum_{t>=k} lr_t mu^(t-k)``; for Adam the bias-corrected first-moment
    weights, up to about 3 ``lr`` for the first steps); with ``memory="continuous"``
    Domingos' continuous-time limit ``lr_k m``, ``m = 1 / (1 - mu)`` for heavy-ball SGD
    and 1 otherwise. The two agree for plain SGD and RMSprop. Parameter groups with
    their own step sizes (a :class:`~skpathkernel.PathRecorder` loop) scale each group's
    part of ``D_k``: with "discrete" memory by the group's step sizes in the updates the
    step's gradient entered, which differ from the step's own where the groups follow
    different schedules. With ``record_every > 1``
    each recorded point stands for the steps of its interval (Riemann sum): the first
    call on a path's range warns, with an estimate of that sum's error (its difference
    from the sum at twice the spacing, every other point standing for its pair's steps,
    on the first 64 training inputs; about 1.5 times the cost of the kernel of 64 rows).
    The estimate, and the warning, come once per path, range, ``output`` and ``memory``,
    however many times SVC, GridSearchCV or a display call the kernel (a copy of the path
    that a process-based joblib task unpickles is another path to it).

    The cost is linear in the number of steps and the memory independent of it: step
    Grams are accumulated one at a time, each in memory-bounded blocks.
    ``output="full"`` gives the ``(n_X, n_Y, C, C)`` blocks as :class:`TangentKernel`
    does (see its Notes).

    Parameters
    ----------
    estimator : fitted skpathkernel estimator, RecordedNetwork, TrainedNetwork, Pipeline or search
        Kept as is (not refitted by ``clone``); its ``network_`` is read at every call.
        A fitted Pipeline ending in one, or a refitted search, as :class:`TangentKernel`
        takes it: the network inside, on ``X`` and ``Y`` through the steps before it.
    start, stop : int or None, default=0, None
        Range of recorded points, with Python slice semantics over the points
        ``0 .. len(trajectory_) - 2`` (the last point has no step leaving it).
    output : "trace", "full" or int, default="trace"
        Scalar summary of the ``C x C`` kernel blocks, the output to use, or "full":
        the blocks themselves, an ``(n_X, n_Y, C, C)`` array (Notes).
    normalized : bool, default=False
        Return ``K(x, x') / sqrt(K(x, x) K(x', x'))``.
    n_jobs : int, default=None
        Number of joblib workers for Grams and diagonals: the rows of ``X`` are split
        into one block per worker, run with ``Parallel(n_jobs)``, so the same call fans
        out to loky processes or, under ``joblib.parallel_config(backend="dask")``, to a
        Dask cluster. ``None`` means 1 unless in a joblib context; ``-1`` all workers.
        Each task runs torch with ``max(1, cpu_count // n_jobs)`` threads. The result
        equals the serial one up to round-off (the blocks of ``K(X, X)`` do not use its
        symmetry). Not a hyperparameter: it does not appear in ``theta``.
    split : {"rows", "steps"}, default="rows"
        What ``n_jobs`` splits. "rows": the rows of ``X``, each task summing every
        step (for many rows). "steps": the recorded points, cut into one contiguous
        range per worker, each task summing its range's step kernels over all of ``X``
        (reading only its own chunk files of an on-disk trajectory, which workers on
        other machines must reach at the same path) and the partial sums added here
        (for long paths). Both equal the serial sum up to round-off; the user guide's
        "Scaling" page says when each pays.
    memory : {"discrete", "continuous"}, default="discrete"
        How a step's gradient is weighted through the optimizer's memory (see above and
        :func:`path_weights`). "discrete" is the default because it is the weighting the
        recorded run actually applied, so the kernel is the one of the decomposition's
        ``first_order`` formula; "continuous" is the gradient-flow limit of the formulas
        of Domingos (2020) and Guo, He & Morel (2026).

    See Also
    --------
    TangentKernel : The kernel at one recorded point.
    path_weights : The weights ``w_k``.

    Notes
    -----
    Domingos' path kernel [1]_, with the optimizer's weighting of Guo, He & Morel [2]_;
    the user guide's "Theory" page derives both.

    References
    ----------
    .. [1] P. Domingos, "Every Model Learned by Gradient Descent Is Approximately a Kernel
       Machine", arXiv:2012.00152, 2020.
    .. [2] J. Guo, R. Y. He and J.-M. Morel, "On Interpolation Formulas Describing Neural
       Network Generalization", 2026.

    Examples
    --------
    >>> import numpy as np
    >>> from sklearn.kernel_ridge import KernelRidge
    >>> from skpathkernel import PathKernelMachine
    >>> from skpathkernel.kernels import PathKernel
    >>> X = np.linspace(-1, 1, 30).reshape(-1, 1); y = np.sin(3 * X).ravel()
    >>> est = PathKernelMachine(hidden_layer_sizes=(16,), solver="adam", max_iter=10, tol=None,
    ...                         random_state=0).fit(X, y)
    >>> kernel = PathKernel(est)
    >>> K = kernel(X)
    >>> K.shape, bool(np.all(np.linalg.eigvalsh(K) > -1e-6 * K.max()))
    ((30, 30), True)
    >>> KernelRidge(kernel=kernel, alpha=1e-3).fit(X, y).predict(X[:2]).shape
    (2,)
    """

    def __init__(self, estimator, start=0, stop=None, output="trace", normalized=False,
                 n_jobs=None, split="rows", memory="discrete"):
        self.estimator = estimator
        self.start = start
        self.stop = stop
        self.output = output
        self.normalized = normalized
        self.n_jobs = n_jobs
        self.split = split
        self.memory = memory

    def _check_params(self):
        super()._check_params()
        _check_memory(self.memory)
        if self.split not in ("rows", "steps"):
            raise ValueError(f"split must be 'rows' or 'steps', got {self.split!r}.")

    def _n_points(self, net: TrainedNetwork) -> int:
        return len(range(len(net.trajectory))[self.start:self.stop])

    def _sum(self, X, Y, *, gram, diag):
        if self.split == "steps":
            return _split_path_sum(self.estimator, X, Y, self.start, self.stop, self.output,
                                   self.n_jobs, gram=gram, diag=diag, memory=self.memory)
        return _path_sum(self.estimator, X, Y, self.start, self.stop, self.output,
                         gram=gram, diag=diag, memory=self.memory)

    def _gram_blocks(self, X, Y):
        K = self._gram(X, Y) if self.split == "steps" else super()._gram_blocks(X, Y)
        self._warn_thinned(X)
        return K

    def _warn_thinned(self, X):
        """Warn of a thinned path's Riemann sum at the first call on its range."""
        thinned = _thinning_error(self.estimator, X, self.start, self.stop, self.output,
                                  self.memory)
        if thinned is not None:
            # Once per path and range, not at every call: the estimate is the path's, and
            # Python's once-per-line filter does not hold under scikit-learn, whose
            # catch_warnings blocks reset its registry (type_of_target's, in every
            # classifier's fit and score; one around each GridSearchCV task): the SVC
            # example showed it 12 times for 22 calls, once per task.
            every, estimate, rows = thinned
            try:
                warnings.warn(
                    f"PathKernel: the path was recorded every {every} optimizer steps (at "
                    "most), so the kernel is a Riemann sum, each recorded point standing for "
                    "its interval's steps, not the sum over every step. It and its sum at "
                    "twice the spacing (every other recorded point, standing for its pair's "
                    f"steps) differ by {estimate:.2g} of the kernel's largest entry (on "
                    f"{rows}), an estimate of that sum's error, "
                    "not a bound. Refit with record_every=1 (trajectory_storage='disk' keeps "
                    "long paths) for the every-step kernel.",
                    UserWarning, stacklevel=caller_stacklevel())
            except Warning:
                # A filter that makes it an error raises at every call, as Python's own
                # registry lets it: kept as said, the next call returned silently.
                _forget_thinning(self.estimator, self.start, self.stop, self.output,
                                 self.memory)
                raise

    def _diag_blocks(self, X):
        return self._diag(X) if self.split == "steps" else super()._diag_blocks(X)

    def _gram(self, X, Y):
        K, dx, dy = self._sum(X, Y, gram=True, diag=self.normalized)
        if self.normalized:
            K = _normalize(K, dx, dy, same=Y is None)
        return to_numpy(K)

    def _raw_gram(self, X, Y):
        return to_numpy(self._sum(X, Y, gram=True, diag=False)[0])

    def _diag(self, X):
        _, dx, _ = self._sum(X, None, gram=False, diag=True)
        return to_numpy(dx)

    def _sums(self, X, Y):
        """``K(X, Y)`` and both diagonals as the kernel and its ``diag`` give them, from
        one walk over the path; refused where they overflowed."""
        sums = _checked_sums(_own_sums(*self._sum(X, Y, gram=True, diag=True),
                                       self.normalized), self.estimator, X, Y)
        self._warn_thinned(X)
        return sums


class NetworkKernelsMixin:
    """``tangent_kernel_`` and ``path_kernel_`` of anything that exposes ``network_``."""

    @property
    def tangent_kernel_(self) -> TangentKernel:
        """:class:`~skpathkernel.kernels.TangentKernel` at the final parameters."""
        network_of(self)  # fitted, as check_is_fitted says otherwise
        return TangentKernel(self)

    @property
    def path_kernel_(self) -> PathKernel:
        """:class:`~skpathkernel.kernels.PathKernel` over the whole recorded path."""
        network_of(self)
        return PathKernel(self)


KERNELS.update(tangent=TangentKernel, path=PathKernel)
