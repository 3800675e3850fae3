"""Counterfactual attribution: the recorded path differentiated with respect to each point.

Give training point ``i`` a weight ``w_i`` in the loss of every step whose batch holds it,
each step's loss being the weighted mean over its batch, of the step's total weight,
``L_t(theta; w) = S_t sum_{i in B_t} w_i beta_i l_i(theta) / sum_{i in B_t} w_i beta_i``
(``beta_i`` the point's recorded weight in the step's loss,
:meth:`Trajectory.batch_weights <skpathkernel.Trajectory.batch_weights>`: ``1 / |B_t|``
for a mean, ``1 / (n_ranks * shard size)`` under DDP with unequal shards,
``s_i / sum_{B_t} s`` with sample weights ``s``, or a loop's own loss coefficients,
``PathRecorder.set_batch(indices, weights)``; ``S_t = sum_{i in B_t} beta_i``, the step's
total weight: 1 but for a loop's own coefficients, or 0 for a batch whose weights are all
0, which has no data gradient and whose points score 0 there; a batch whose weights sum to
0 without all being 0 has no such mean, and is refused), so that ``w_i = 0`` is the
training without ``i`` (for an estimator's path,
``metrics.retrain_on_subsets(protocol="replay")``). The score of point ``i`` at query
``x`` is ``d m(x; theta_T(w)) / d w_i`` at ``w = 1``: how the trained output moves, to
first order, when the point is down-weighted or removed (unrolled differentiation;
SGD-influence, Hara et al. 2019; MAGIC, Ilyas & Engstrom 2025).

Every supported optimizer is a map ``s_{t+1} = U_t(s_t, d_t)`` of its state
``s = (theta, m, v)`` (first and second moments where it keeps them) and the step's
gradient ``d_t = c_t g_t + lambda theta_t``, elementwise in everything but ``d_t``:
``g_t = grad L_t(theta_t)``, ``lambda`` each parameter's L2 weight decay (its optimizer
group's; AdamW's is decoupled, inside ``U_t``), and ``c_t`` the recorded gradient factor
(:attr:`Trajectory.gradient_scales <skpathkernel.Trajectory.gradient_scales>`). Each
parameter steps with its group's step size (an elementwise ``lr`` in ``U_t``).

Norm clipping. ``clip_grad_norm_`` makes ``c_t = min(1, M / (|g_t| + e))`` (``e = 1e-6``,
torch's), and ``c_t`` depends on the weights through ``g_t``: on a clipped step
(``c_t < 1``), ``d c_t = -c_t (g_t . d g_t) / (|g_t| (|g_t| + e))``, so that
``d (c_t g_t) = P_t d g_t`` with the symmetric
``P_t = c_t (I - kappa_t g_t g_t^T)``, ``kappa_t = 1 / (|g_t| (|g_t| + e))`` (on an
unclipped step ``P_t = I``; at ``|g_t| + e = M`` exactly the derivative is one-sided and
the unclipped side is taken). ``M`` is not needed: ``c_t`` and ``g_t`` give it. The same
``P_t`` carries the dependence of ``d_t`` on ``theta_t``: ``d d_t / d theta_t =
P_t H_t + lambda``. Holding ``c_t`` constant instead would be the derivative of another
training (off by 0.7 relative on the tests' clipped path).

With ``w = 1``, ``d g_t / d w_i = beta_i (grad l_i - g_t / S_t)``. The adjoint
``a_t = d m / d s_t`` starts at ``(grad_theta m(x; theta_T), 0, 0)`` and runs backwards
over the steps:

- ``u_t = (dU_t / d d)^T a_{t+1}``, the adjoint of the step's gradient (elementwise), and
  ``v_t = P_t u_t = c_t (u_t - kappa_t g_t (g_t . u_t))`` (``u_t`` when unclipped);
- ``score_i += beta_i (grad l_i . v_t - sum_{j in B_t} beta_j grad l_j . v_t / S_t)``
  for ``i`` in ``B_t``;
- ``a_t = (dU_t / d s)^T a_{t+1} + H_t v_t + lambda u_t`` on the parameters, ``H_t`` the
  Hessian of the step's loss.

The products ``grad l_i . v`` of every batch point and ``H_t v`` of a plain MLP (an
``nn.Sequential`` of Linear layers and elementwise activations) are taken by hand
(:mod:`._mlp_products`: the R-operator's tangents of all the queries in a few GEMMs per
layer, with the step's gradient from the same pass), 1.2-1.8x faster than forward over
reverse and 1.2-4.3x faster than the double backward
(``benchmarks/results/unrolled_routes-mlp*.md``). Other networks take one
forward-over-reverse pass, batched over the queries (vmap): the ``jvp`` in direction ``v``
of ``theta -> (sum_i beta_i grad l_i(theta), (l_i(theta))_i)`` is
``(H_t v, (grad l_i . v)_i)``. Small steps, float64 convolutional networks and layers that
forward-mode AD or vmap cannot take use one double backward instead: with
``g(beta) = sum_i beta_i grad l_i(theta)``, the gradient of ``g . v`` is ``grad l_i . v``
with respect to ``beta_i`` and ``H_t v`` with respect to ``theta`` (one per query where
the batched one fails, as GroupNorm's does); ``g`` is the step's own gradient, its graph
kept, so that route runs the batch forward and backward once a step. Forward over reverse
measured 1.36-1.62x faster on a small float32 CNN (whose convolution and pooling double
backward has no batching rule, so vmap loops over the queries) and 1.06-1.20x on MLPs; the
double backward is taken where the step's work is small, where forward over reverse's
fixed cost per step dominates (1.2-2.7x faster on small MLPs), and on float64 CNNs
(:func:`forward_over_reverse`). No per-sample gradient is formed, for any layer. The
optimizer's first moment after a step is read from consecutive recorded points
(``theta_t - theta_{t+1}`` is the step), its second moment is recorded.

Standardized targets. A regressor's ``normalize_y`` trains on ``t_j = (y_j - mu) / s``,
the weighted mean and standard deviation of its first fit's targets, which a refit with
other weights takes anew. The sweep then also differentiates the trained output with
respect to the targets, ``d (grad l_i . v) / d y_i`` from each route's tangents (a plain
MLP's output tangents ``J_i v``, the ``jvp``'s outputs, or the targets as a leaf of the
double backward) times the loss's ``d^2 l / df dy``, summed over the points as
``sum_j d m / d t_j`` and ``sum_j t_j d m / d t_j`` per query and output; the moments'
own derivatives give the rest in closed form (:func:`_restandardize`).

The clip's derivative assumes the L2 norm of every recorded parameter's gradient (torch's
default ``norm_type``) and one ``max_norm``; factors that imply different ones (a constant
factor, another norm) are reported by a warning.

Cost per step: one forward-backward of the batch, then per query one Hessian-vector
product (a forward-over-reverse pass or a double backward). Memory: the adjoint, a few
``(queries, P)`` buffers, whatever the number of steps; the path is read backwards, chunk
by chunk from disk.

Thinned paths (``record_every > 1``): the steps between two recorded points are replayed
forward from the first (batches and every step's step size are recorded, see
:attr:`Trajectory.step_learning_rates <skpathkernel.Trajectory.step_learning_rates>`) and
kept for the interval only; the replay's mismatch with the next recorded point is
reported. Solvers
whose first moment is not recorded (SGD with momentum, Adam, AdamW) are first replayed from
the initialization to recover it at each recorded point, checkpointed: the replay's state
is kept at every ``sqrt(n_points)``-th point and the moments of one segment at a time are
replayed again from its checkpoint (about ``2 sqrt(n_points)`` (P,) vectors in memory, and
one more forward replay of the path per query block).

Precision. On a float32 (or lower) path of Adam, AdamW or RMSprop, each step's gradient
``d_t`` is taken in float64 at the recorded point (the inputs and targets as the training
took them), the products and the adjoint in the path's dtype: the scores are the
derivative of the training map at the recorded states, to float32 round-off against
autograd through a float64 replay held at the record (``tests/_reference.py``). The
second moment's adjoint, divided by ``sqrt(v)``, multiplies ``d_t``, which cancels over the
batch where ``v`` is tiny; with ``d_t`` in float32 the scores missed that derivative by up
to 3.5e-2 of the largest (GRADIENT_DTYPE). That sensitivity is the problem's, not only the
sweep's: a float64 retraining from the same start, rounded otherwise, moves the scores as
much. A probe row (a +-1 combination of a block's queries) is swept with ``d_t`` in the
path's dtype, and its change is reported (``AttributionScores.gradient_sensitivity``) and
warned of from 3.2e-4 (the change it estimates may then reach 1e-3).

Stability. The adjoint's growth along the path measures how far training amplifies a
perturbation of the parameters. A path past the edge of stability (lr x sharpness > 2)
amplifies it exponentially; there, removing one point changes the trained network by
more than any first-order derivative predicts, and a warning says so.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from functools import cached_property

import numpy as np
import torch
from torch.func import grad, jvp, vmap

from .._checkpoint import functional_call
from .._device import forward_input
from .._memory import retained_heap, rows_per_block
from .._modules import copy_module
from .._parallel import by_reference, map_row_blocks, n_row_blocks
from .._path._training import mode_dependent_layers
from .._path._trajectory import Trajectory
from .._second_order import FORWARD_AD, check_twice_differentiable, twice_differentiable
from .._tangent import contracted_features, stacked_mlp
from .._warnings import caller_stacklevel, worse, worst
from ._mlp_products import MLPStep

__all__ = ["AttributionScores", "PrecisionWarning", "Replay", "UnstablePathWarning",
           "check_replayable", "check_unrollable", "replay_limit", "unrolled_scores",
           "warn_tied_padding"]

# The adjoint's norm may grow by this factor along the path before the first-order
# counterfactual is reported untrustworthy. Measured on 1000 digits (pixels / 16), SGD,
# batch 128, tanh, 20 queries: stable paths, where the derivative predicts single
# removals to LDS 0.98-0.997 and half subsets to 0.77-0.97, grow by at most 1.8
# ((64, 64, 64) at lr 0.1 for 30 epochs; (64, 64) at lr 0.5 for 10); the chaotic path of
# (64, 64, 64) at lr 0.5 for 10 epochs (single removals: LDS 0.12, each moving a margin by
# 0.07 where the derivative says 0.10) grows by 29 (median over the queries) to 73.
GROWTH_LIMIT = 10.0
# The same for Adam and AdamW, whose preconditioned steps grow the adjoint on paths whose
# removals it still predicts. On the defaults benchmark's data sets (300 points, the
# default classifier and regressor, 3 seeds) and at larger learning_rate_init, Adam paths
# of growth 12.6 to 57.1 predicted single removals to a median Spearman of 0.634 to 0.96
# (0.914 at 12.8 on breast cancer, where 10 warned), no worse than those under 10 (0.162
# to 0.977: Adam's own non-linearity, which no growth flags). Of the 8 failing paths
# (median under 0.5), 4 grew under 10 and 4 by 159 to 1.4e4 (learning_rate_init 0.01 and
# 0.03: Spearman 0.506 to -0.0354, signs right for 0.5 to 0.683 of the removals); a limit
# of 10 flagged those 4 and 7 of the 28 sound paths, 100 the same 4 and one sound path
# (growth 304, Spearman 0.732) (benchmarks/audit_unstable_growth.py,
# benchmarks/results/unstable_growth.md). SGD's failing paths grew from 15.4 and its sound
# ones by at most 2.94, so SGD keeps 10. AdamW's update is Adam's with a decoupled decay
# (not measured apart); RMSprop, not measured, keeps 10.
ADAPTIVE_GROWTH_LIMIT = 100.0
ADAPTIVE_SOLVERS = ("adam", "adamw")
# The step's batched work (queries x batch x activation values per sample) from which
# forward over reverse outran the double backward: at 1.3 million (a (256,) MLP, 80
# queries, batch 32) the double backward took 0.82 of its time, at 3.3 million (batch 80)
# 1.43 times, float64, one thread (benchmarks/results/unrolled_routes-small.md); see
# forward_over_reverse.
FORWARD_WORK = 2e6
#: Plain MLPs (``nn.Sequential`` of Linear layers and elementwise activations) take their
#: tangent products by hand (:mod:`._mlp_products`) on either route's place.
MLP_PRODUCTS = True
# The dtype of each step's gradient on Adam's, AdamW's and RMSprop's paths of lower
# precision. The adjoint of the second moment is divided by sqrt(v), large where v is tiny,
# and multiplies the step's gradient, a sum over the batch that cancels for those
# parameters, so that float32's rounding of it moved the default classifier's scores
# (standardised digits, epsilon=1e-8) by up to 3.5e-2 to 3.8e-2 (by route) of the largest
# score from the derivative at its recorded points (1.6e-3 on raw pixels); with the
# gradient alone in float64 (the point, inputs and targets as recorded), up to 2.3e-6 and
# 3.8e-7, the products and the adjoint in float32 (benchmarks/audit_unrolled_float32.py,
# benchmarks/results/unrolled_float32.md). SGD's adjoint does not read the gradient.
GRADIENT_DTYPE = torch.float64
# The scores warn when float32 gradients may move them by more than REPLAY_LIMIT's float32
# level, 1e-3: AttributionScores.gradient_sensitivity, an estimate, read 0.32 to 1.8 times
# the queries' largest change on the audit's paths (benchmarks/results/unrolled_float32.md),
# so the warning fires from 1e-3 times the lowest of those.
SENSITIVITY_LIMIT = 0.32 * 1e-3
# Relative mismatch between the modelled and the recorded training steps above which the
# scores are reported to differentiate another training (round-off: about 1e-6 to 1e-4
# relative in float32, see replay_error).
REPLAY_LIMIT = 1e-3
# The same in float64, whose replays match the record to about 1e-15: 1e-3 let a float64
# Adam path stored with float16 compression pass silently (replay_error 5.3e-4) while its
# scores missed the derivative of the training by 4.6e-3 (RMSprop: 2.7e-4 and 7.3e-3;
# benchmarks/results/exact_audit.md). The mismatch does not bound the scores' error either
# way: 9-27 times it on those paths, 130-400 times below it on others (a review's SGD,
# momentum and Adam paths), so a compressed path always warns.
REPLAY_LIMIT_FLOAT64 = 1e-9
# torch.nn.utils.clip_grad_norm_'s factor is max_norm / (norm + 1e-6).
CLIP_EPS = 1e-6


class UnstablePathWarning(UserWarning):
    """The recorded path amplifies perturbations: first-order counterfactuals fail there.

    Issued by ``attribute(method="unrolled")`` and ``self_influence()`` when a query's
    ``growth`` (see :class:`AttributionScores`) is above 10, or above 100 on an Adam or
    AdamW path, whose growth of 12.6 to 57.1 came with single removals predicted as well
    as on its paths of smaller growth (``benchmarks/results/unstable_growth.md``).

    Examples
    --------
    >>> import warnings
    >>> from skpathkernel import UnstablePathWarning
    >>> with warnings.catch_warnings():
    ...     warnings.simplefilter("error", UnstablePathWarning)
    ...     try:
    ...         warnings.warn("growth 40", UnstablePathWarning)
    ...     except UnstablePathWarning as w:
    ...         print(type(w).__name__, w)
    UnstablePathWarning growth 40
    """


class PrecisionWarning(UserWarning):
    """A result is limited by floating-point precision (float32 rounding), not wrong.

    Issued by ``attribute(method="unrolled")`` and ``self_influence()`` on a float32 path
    of Adam, AdamW or RMSprop when rounding each step's gradient to float32 moves the
    scores by more than 3.2e-4 of their size (``AttributionScores.gradient_sensitivity``),
    or when the module cannot take those gradients in float64 to measure that; and by
    ``decompose(method="exact")`` (and ``attribute``, ``explain``) on a float32 path
    when a single contribution's error exceeds what it is checked against because of
    its estimated round-off (the round-off alone is over, or the quadrature's part
    alone is under) (``Decomposition.contribution_tol``: an explicit ``tol``; 1e-5 of
    the path's largest ``|f|`` with ``tol=None``; ``contribution_error`` includes it;
    ``dtype="float64"`` removes it). The numbers in the message change from call to
    call, so Python's once-per-location filter does not collapse them: a service that
    calls these methods in a loop can silence this class alone, and keep every other
    warning.

    Examples
    --------
    >>> import warnings
    >>> from skpathkernel import PrecisionWarning
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     warnings.filterwarnings("ignore", category=PrecisionWarning)
    ...     warnings.warn("moved by 0.0041 of their size", PrecisionWarning)
    ...     warnings.warn("something else", UserWarning)
    >>> [str(w.message) for w in caught]
    ['something else']
    """


class AttributionScores(np.ndarray):
    """Attribution scores ``(n_queries, n_train)`` with what the unrolled method measured.

    An ``ndarray`` (float64) returned by ``method="unrolled"`` (the other methods return a
    plain ndarray) and by ``self_influence()``, with what the call measured. The measures
    describe this array as returned: its copies (``copy()``, :mod:`copy`, pickling) and
    ``view()`` keep them, and operations in place (``+=``, item assignment, ``sort()``)
    leave them as measured. Every array or scalar derived from it is what the same
    operation gives on ``np.asarray(scores)``, a plain ``numpy.ndarray`` or NumPy scalar
    without measures: an index or slice, a reduction (``max()``, ``sum(axis=1)``),
    ``argsort()``, a comparison, arithmetic (``-scores``), ``reshape`` or ``.T``, a NumPy
    function (``np.sort``, ``np.percentile``). Nothing tells whether such an array still
    holds the same queries in the same order (``influence[order]``, ``scores.T``) or whose
    measures a combination of two calls' scores would carry, so no measure goes with it;
    take chosen queries' measures explicitly, ``scores.growth[rows]``.

    Attributes
    ----------
    growth : ndarray of shape (n_queries,) or None
        Largest ratio, over the steps, of the adjoint's norm at a step to its norm at the
        end of training: how far the path amplifies a perturbation of the parameters
        made at that step, for each query's output: about 1 to 2 on stable paths, tens
        and more on chaotic ones (a warning fires above 10; on Adam's and AdamW's paths,
        whose steps grow it more where they still predict removals, above 100).
    amplification : ndarray of shape (n_steps,) or None
        Each step's one-step amplification of the adjoint, ``|a_t| / |a_{t+1}|``
        (geometric mean over the queries, NaN where no query's adjoint is nonzero);
        above 1 where the step amplifies perturbations.
    replay_error : float or None
        How far the training that the scores differentiate (each step's loss gradient
        recomputed from the declared loss, inputs and targets, and the optimizer's rule)
        misses the recorded path, relative: each recorded move against the modelled
        training's from the recorded point, its optimizer state (the momentum buffer,
        Adam's first moment) the modelled gradients' carried from the first step (root
        of the summed squares over the steps, relative to the moves'). An error that
        the state carries, such as an L2 term added to the loss by hand, is so read
        summed over the steps that carry it (about ``1 / (1 - momentum)``), not once;
        a direction's round-off, ``1 / lr`` of its move's, cancels but on its own step,
        so that a schedule's tiny steps do not amplify it while their gradients, which
        reach the later steps through the state, are still checked. On a thinned path
        also each replayed interval against its next recorded point. Under Adam, AdamW
        and RMSprop the step size is each parameter's, the rate over its root second
        moment: a mismatch of the gradient (an L2 term
        added to the loss by hand) moves a parameter of small second moment, and the
        scores, by more (read in the gradient's units, an L2 term of 1e-3 read 2e-4 to
        4e-4 while the scores missed the training's derivative by 2e-3 to 0.35). A
        second moment is read no finer than the dtype's rounding of the step's largest
        gradient over the warning's limit, so that the rounding alone cannot reach the
        limit: a parameter whose gradient is its rounding (an attention layer's key
        bias, which the softmax cancels) is moved by it, in the record, by steps the
        float64 gradient cannot reproduce. The recorded points' own rounding (at most
        ``eps / 2`` of each parameter, which enters the sum on its own step alone) is
        taken out at that largest: the value is at most the mismatch of the
        training's (the triangle inequality), so that moves known to little more than
        their rounding (plain SGD at a rate of 1e-5, moving each parameter by about
        1e-5 of itself, read 5.4e-3 with it) are no mismatch.
        0 or round-off level when the record is complete, with any learning-rate
        schedule; a warning fires above 1e-3
        in float32, above 1e-9 in float64, and on any path stored with
        ``trajectory_compression`` (whose rounded points left the scores an error from
        1/400 to 27 times this mismatch on the paths measured: the mismatch does not
        bound it).
    gradient_sensitivity : float or None
        On a float32 path of Adam, AdamW or RMSprop, whose scores take each step's
        gradient in float64 at the recorded point: an estimate of how far they move,
        relative to their size, when the gradient takes float32's rounding instead. A
        probe, a random +-1 combination of each block of queries, is swept again with
        float32 gradients; its largest change over the largest root sum of squares of
        the block's scores at a training point, the worst block reported (so it
        depends a little on the blocks, ``memory_budget`` and ``n_jobs``). 0.3 to 1.8
        times the queries' own largest change on the paths measured, 1e-3 to 3e-2 on
        Adam paths with ``epsilon=1e-8`` on digits, where the second moment's adjoint,
        divided by ``sqrt(v)``, multiplies gradients that cancel over the batch; about
        1e-6 with ``epsilon=1e-4``. A float64 retraining from the same start moved the
        scores about as much there, so the scores may mean no more than this. A warning
        fires above 3.2e-4, where the queries' own change may reach 1e-3. None on
        float64 paths, on SGD's (whose adjoint does not read the gradient), where the
        module could not run in float64, and where ``memory_budget`` holds a single
        query's adjoint (the probe takes a row of it); NaN with NaN scores.

    Parameters
    ----------
    shape, dtype, buffer, offset, strides, order
        As :class:`numpy.ndarray`'s: the scores are not built by hand but returned by
        ``attribute(method="unrolled")``.

    Examples
    --------
    >>> import numpy as np
    >>> from skpathkernel import AttributionScores, PathKernelMachine
    >>> X = np.linspace(-1, 1, 20).reshape(-1, 1); y = np.sin(3 * X).ravel()
    >>> est = PathKernelMachine(hidden_layer_sizes=(8,), solver="sgd", max_iter=3,
    ...                         learning_rate_init=0.1, tol=None, dtype="float64",
    ...                         random_state=0).fit(X, y)
    >>> scores = est.attribute(X[:2], method="unrolled")
    >>> isinstance(scores, AttributionScores), scores.shape, scores.growth.shape
    (True, (2, 20), (2,))
    >>> bool(scores.replay_error < 1e-6)
    True
    """

    growth: np.ndarray | None = None
    amplification: np.ndarray | None = None
    replay_error: float | None = None
    gradient_sensitivity: float | None = None
    _MEASURES = ("growth", "amplification", "replay_error", "gradient_sensitivity")

    def __array_finalize__(self, obj):
        # Reached by copies and views of the whole array (what derives another array runs
        # on the plain one, below); a view of other rows, made by NumPy's C API, loses
        # the growth of the rows it no longer has.
        self._take_measures(obj)
        rows = self.shape[0] if self.ndim else 0
        if self.growth is not None and len(self.growth) != rows:
            self.growth = None

    def __array_ufunc__(self, ufunc, method, *inputs, out=None, **kwargs):
        if out is not None:
            kwargs["out"] = _plain(out)
        result = getattr(ufunc, method)(*_plain(inputs), **kwargs)
        if out is None:
            return result
        # An operation in place returns its output itself: ``scores += 1`` rebinds
        # ``scores`` to what this returns.
        results = result if isinstance(result, tuple) else (result,)
        kept = tuple(r if o is None else o for r, o in zip(results, out))
        return kept if isinstance(result, tuple) else kept[0]

    def __array_function__(self, func, types, args, kwargs):
        return func(*_plain(args), **_plain(kwargs))

    def __getitem__(self, key):
        return self.view(np.ndarray)[key]

    def _take_measures(self, other) -> AttributionScores:
        """Take ``other``'s measures (None where it has none); returns ``self``."""
        for name in self._MEASURES:
            setattr(self, name, getattr(other, name, None))
        return self

    def __reduce__(self):
        base = super().__reduce__()
        return base[0], base[1], (base[2], tuple(getattr(self, n) for n in self._MEASURES))

    def __setstate__(self, state):
        base, measured = state
        # Scores pickled before gradient_sensitivity was measured hold three.
        measured = (*measured, *(None,) * (len(self._MEASURES) - len(measured)))
        for name, value in zip(self._MEASURES, measured):
            setattr(self, name, value)
        super().__setstate__(base)


class _OnPlain:
    """An ndarray attribute read on the plain array: what it derives carries no measures.

    Methods and properties (``argsort``, ``reshape``, ``T``) that make an array of the
    subclass through NumPy's C API without a ufunc, which ``__array_ufunc__`` and
    ``__array_function__`` do not see. On the class, ndarray's own.
    """

    def __init__(self, name):
        self.name = name

    def __get__(self, obj, owner=None):
        return getattr(np.ndarray if obj is None else obj.view(np.ndarray), self.name)

    def __set__(self, obj, value):  # ``scores.real = ...`` writes the scores' memory
        setattr(obj.view(np.ndarray), self.name, value)


for _name in ("T", "mT", "argmax", "argmin", "argpartition", "argsort", "astype", "byteswap",
              "compress", "conj", "conjugate", "diagonal", "dot", "flat", "flatten", "getfield",
              "imag", "ravel", "real", "repeat", "reshape", "squeeze", "swapaxes", "take",
              "transpose"):
    if hasattr(np.ndarray, _name):  # mT: NumPy >= 2
        setattr(AttributionScores, _name, _OnPlain(_name))
del _name


def _plain(value):
    """``value`` with each :class:`AttributionScores` in it, in tuples and lists and dicts
    too (NumPy's arguments), as a plain ndarray view."""
    if isinstance(value, AttributionScores):
        return value.view(np.ndarray)
    if isinstance(value, (tuple, list)):
        return (tuple if isinstance(value, tuple) else list)(_plain(v) for v in value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    return value


# --------------------------------------------------------------------------- solvers
# One pair of pure functions per solver, elementwise on (P,) or (Q, P) tensors:
# ``step`` is torch.optim's update (used to replay unrecorded steps), ``adjoint`` its
# transposed Jacobian. ``s``: the state after the step (theta is the parameters before it,
# ``nxt`` after it); ``a``: the adjoint of the state after the step.
@dataclass
class _Step:
    """One optimizer step's values: what the adjoint of the update reads."""

    theta: torch.Tensor       # parameters before the step
    nxt: torch.Tensor         # parameters after it
    lr: float | torch.Tensor  # (P,) when parameter groups took their own step sizes
    count: float              # the optimizer's step count after the step (Adam)
    v: torch.Tensor | None    # the second moment after the step (Adam, RMSprop)
    batch: np.ndarray
    weights: np.ndarray       # each batch point's weight in the step's loss
    scale: float              # the factor the loss gradient was multiplied by (clipping)
    decay: float | torch.Tensor = 1.0  # AdamW's decoupled factor 1 - lr * weight_decay
    decay64: float | torch.Tensor = 1.0  # the same from float64 step sizes (move's)

    @cached_property
    def move(self) -> torch.Tensor:
        """``(lr / bc1) m / den``, Adam's step, read from the recorded points (read by the
        adjoint, the probe's and the replay check): AdamW's decay taken in float64, whose
        rounding in float32 (``|theta|`` against a step much smaller) moved the scores
        of a float32 path by 3.5e-5 of the largest."""
        if isinstance(self.decay64, float) and self.decay64 == 1.0:
            # Exact where nxt is within a factor 2 of theta (Sterbenz): all but sign
            # changes.
            return self.theta - self.nxt
        return (self.decay64 * self.theta.double() - self.nxt.double()).to(self.theta.dtype)


def _nesterov(spec) -> bool:
    return spec.name == "sgd" and bool(spec.nesterov) and spec.momentum != 0.0


def _sgd_step(spec, theta, state, d, lr, count, decay):
    buf = d if state.get("m") is None else spec.momentum * state["m"] + d
    # ``decay``: AdamW's alone (1 here), in every rule's signature.
    if spec.momentum == 0.0:
        return theta - lr * d, {}
    if _nesterov(spec):
        return theta - lr * (d + spec.momentum * buf), {"m": buf}
    return theta - lr * buf, {"m": buf}


def _sgd_adjoint(spec, step: _Step, a, d):
    a_m = a["m"] if "m" in a else 0.0
    if _nesterov(spec):
        # theta' = theta - lr (d + mu buf), buf = mu m + d: buf reaches theta' scaled by
        # mu, and d reaches it both directly and through buf.
        a_buf = a["theta"] * (-step.lr * spec.momentum) + a_m
        u = a_buf - step.lr * a["theta"]
    else:
        a_buf = u = a["theta"] * -step.lr + a_m
    pre = {"theta": a["theta"]}
    if spec.momentum != 0.0:
        pre["m"] = spec.momentum * a_buf
    return u, pre


# The adjoints are (Q, P): each fresh one costs a pass and page faults, so the rules below
# make as few as they can, never writing to their inputs.
def _plus(x: torch.Tensor | None, a: torch.Tensor, c) -> torch.Tensor:
    """``x + a * c`` (``a * c`` where ``x`` is None), one new tensor."""
    return a * c if x is None else torch.addcmul(x, a, torch.as_tensor(c, dtype=a.dtype))


def _scaled(a: torch.Tensor, c) -> torch.Tensor:
    """``c * a``, ``a`` itself where ``c`` is the number 1."""
    return a if isinstance(c, float) and c == 1.0 else c * a


def _adam_step(spec, theta, state, d, lr, count, decay):
    b1, b2 = spec.beta_1, spec.beta_2
    theta = theta * decay
    m = (1.0 - b1) * d if state.get("m") is None else b1 * state["m"] + (1.0 - b1) * d
    v = (1.0 - b2) * d * d if state.get("v") is None else b2 * state["v"] + (1.0 - b2) * d * d
    den = v.sqrt() / math.sqrt(1.0 - b2**count) + spec.epsilon
    return theta - lr / (1.0 - b1**count) * m / den, {"m": m, "v": v}


def _adam_adjoint(spec, step: _Step, a, d):
    b1, b2 = spec.beta_1, spec.beta_2
    bc1, sbc2 = 1.0 - b1**step.count, math.sqrt(1.0 - b2**step.count)
    decay = step.decay
    root = step.v.sqrt()
    den = root / sbc2 + spec.epsilon
    # d theta' / d v = move / den / (2 sqrt(bc2 v)); zero where v is (no gradient yet).
    dv = torch.where(root > 0, step.move / (den * 2.0 * sbc2 * root.clamp_min(1e-300)), 0.0)
    a_m = _plus(a.get("m"), a["theta"], -step.lr / bc1 / den)
    a_v = _plus(a.get("v"), a["theta"], dv)
    u = (a_v * (2.0 * (1.0 - b2) * d)).add_(a_m, alpha=1.0 - b1)
    # a_m and a_v are this step's own: scaled in place.
    return u, {"theta": _scaled(a["theta"], decay), "m": a_m.mul_(b1), "v": a_v.mul_(b2)}


def _rmsprop_step(spec, theta, state, d, lr, count, decay):
    alpha = spec.rmsprop_alpha
    v = (1.0 - alpha) * d * d if state.get("v") is None else alpha * state["v"] + (
        1.0 - alpha) * d * d
    return theta - lr * d / (v.sqrt() + spec.epsilon), {"v": v}


def _rmsprop_adjoint(spec, step: _Step, a, d):
    alpha = spec.rmsprop_alpha
    root = step.v.sqrt()
    den = root + spec.epsilon
    # d theta' / d v = lr d / den^2 / (2 sqrt(v)), with the step's own gradient d, not
    # the recorded move (lr d / den in the training's rounding of d).
    dv = torch.where(root > 0, step.lr * d / den / (den * 2.0 * root.clamp_min(1e-300)), 0.0)
    a_v = _plus(a.get("v"), a["theta"], dv)
    u = (a["theta"] * (-step.lr / den)).addcmul_(a_v, 2.0 * (1.0 - alpha) * d)
    return u, {"theta": a["theta"], "v": a_v.mul_(alpha)}


def _implied(spec, step: _Step, d: torch.Tensor
             ) -> tuple[torch.Tensor, float, float, float | torch.Tensor]:
    """What the recorded move says the optimizer's averaged direction was, how the model
    builds it, ``direction_t = memory * direction_{t-1} + gain * d_t`` (the SGD buffer,
    Adam's first moment, RMSprop's gradient itself), and each parameter's step size, the
    move over the direction (Adam's and RMSprop's preconditioned). ``d`` is the
    modelled gradient ``d_t``, which a Nesterov move holds outside its buffer. NaN on
    parameters whose group took no step (step size 0): their move says nothing of the
    direction."""
    lr = step.lr
    if isinstance(lr, torch.Tensor):
        lr = torch.where(lr > 0, lr, torch.nan)
    if spec.name == "sgd":
        move = (step.theta - step.nxt) / lr
        if _nesterov(spec):  # move = d + mu buf
            return (move - d) / spec.momentum, float(spec.momentum), 1.0, step.lr
        return move, float(spec.momentum), 1.0, step.lr
    root = step.v.sqrt()
    # A gradient is known to the rounding of its sums, whose terms may be as large as the
    # step's largest gradient: a second moment read finer than that rounding over the
    # limit would let the rounding alone reach it. An attention layer's key bias, whose
    # gradient the softmax cancels to its float32 rounding (1e-9), is moved by it by
    # steps of 1e-3 to 1e-2 of the rate, which the float64 gradient (1e-19) cannot
    # reproduce: read finer, a complete float32 record of an encoder warned (2e-2).
    dtype = step.v.dtype
    limit = REPLAY_LIMIT_FLOAT64 if dtype == torch.float64 else REPLAY_LIMIT
    floor = torch.finfo(dtype).eps * d.abs().amax() / limit
    if spec.name == "rmsprop":
        return ((step.theta - step.nxt) * (root + spec.epsilon) / lr, 0.0, 1.0,
                step.lr / (root + spec.epsilon).clamp_min(floor))
    den = root / math.sqrt(1.0 - spec.beta_2**step.count) + spec.epsilon
    bc1 = 1.0 - spec.beta_1**step.count
    return (step.move * den * bc1 / lr, float(spec.beta_1),
            1.0 - spec.beta_1, step.lr / (den.clamp_min(floor) * bc1))


def _replay_check(check, direction: torch.Tensor | None, memory: float,
                  modelled: torch.Tensor | None, lr: float | torch.Tensor | None):
    """One step of the replay check, last step first: ``(off, size, check)``, the sums
    0-d float64 tensors on the step's device.

    The check reads, at every step ``t``, the recorded direction ``direction_t`` against
    the modelled training's own: its state carried from the first step,
    ``sum_{s <= t} memory^(t - s) gain d_s``, in the step's move (``lr_t`` times it):
    ``off`` sums ``lr_t^2 e_t^2``, ``e_t = sum_{s <= t} memory^(t - s) r_s`` with the
    per-step residual ``r_s = direction_s - memory direction_{s-1} - gain d_s``, and
    ``size`` ``lr_t^2 direction_t^2``. A direction's round-off, ``1 / lr_s`` of its
    move's, cancels from every ``e_t`` but its own step's, weighted by ``lr_s``: a
    schedule's tiny steps do not amplify it, while their gradients, which reach the
    later steps through the state, are checked there. Running backwards, the squares
    are summed as a quadratic form in the residuals: ``W_t = lr_t^2 + memory^2
    W_{t+1}`` and ``B_t = memory (W_{t+1} r_{t+1} + B_{t+1})`` give
    ``sum_t lr_t^2 e_t^2 = sum_t W_t r_t^2 + 2 r_t B_t``, summed in float64: the terms of
    a tiny step's direction, large, cancel in it. The residuals themselves are formed in
    the path's dtype, then widened: a tiny step's direction is at most about twice its
    state (its move rounds to 0 or to one unit in the last place), so that difference
    loses nothing the sum needs.

    ``check`` is the step after ``t``'s: ``(direction, modelled, lr^2, W, B)`` (None at
    the last step); ``direction`` None closes the first step. ``modelled``: the step's
    ``gain * d_t``; ``lr``: its step size, a float or a (P,) tensor (parameter groups;
    Adam's and RMSprop's, preconditioned)."""
    if direction is not None:
        # A group that took no step (NaN in ``direction``) is read by no check: its
        # weight is 0 and the residuals of the steps either side cancel its direction.
        if isinstance(lr, torch.Tensor):
            read = (lr > 0) & (lr < math.inf)  # and a step size over no gradient (inf)
            direction = torch.where(read, direction, 0.0)
            weight = torch.where(read, lr.double() ** 2, 0.0)
        else:
            direction = direction if lr > 0 else torch.zeros_like(direction)
            weight = float(lr) ** 2 if lr > 0 else 0.0
    if check is None:
        zero = torch.zeros((), dtype=torch.float64, device=direction.device)
        return zero, zero, (direction, modelled, weight, 0.0, 0.0)
    later, gains, later_weight, W, B = check
    residual = later - gains
    if direction is not None:
        residual.sub_(direction, alpha=memory)
    residual = residual.double()
    W = later_weight + memory**2 * W
    carried = W * residual
    if isinstance(B, torch.Tensor):
        carried += B
        off = torch.dot(residual, carried + B)
    else:
        off = torch.dot(residual, carried)
    size = (later * later * later_weight).sum(dtype=torch.float64) \
        if isinstance(later_weight, torch.Tensor) \
        else torch.dot(later, later).double() * later_weight
    if direction is None:
        return off, size, None
    return off, size, (direction, modelled, weight, W, carried.mul_(memory))


def _rounding(spec, step: _Step) -> torch.Tensor:
    """A bound on the squared rounding of the recorded move that the replay check reads,
    summed over the parameters (0-d float64): half a unit in the last place of each
    recorded parameter after the step, at most ``eps / 2`` of it (and, under AdamW, of
    its decayed value before it), over the momentum for Nesterov, whose check reads the
    move less the gradient over it. It enters the check's sum only on its own step (see
    :func:`_replay_check`). Norms, not each parameter's unit in the last place: that
    took 2.5 times the check's own time."""
    points = [step.nxt]
    if not (isinstance(step.decay, float) and step.decay == 1.0):
        points.append(step.theta)
    if isinstance(step.lr, torch.Tensor):  # a group that took no step is not read
        points = [torch.where(step.lr > 0, x, 0.0) for x in points]
    bound = sum(x.norm(dtype=torch.float64) for x in points) \
        * (torch.finfo(step.nxt.dtype).eps / 2)
    if _nesterov(spec):
        bound = bound / spec.momentum
    return bound**2


_SOLVERS = {
    "sgd": (_sgd_step, _sgd_adjoint),
    "adam": (_adam_step, _adam_adjoint),
    "adamw": (_adam_step, _adam_adjoint),
    "rmsprop": (_rmsprop_step, _rmsprop_adjoint),
}


def _first_moment(spec) -> bool:
    return spec.name in ("adam", "adamw") or (spec.name == "sgd" and spec.momentum != 0.0)


# --------------------------------------------------------------------------- checks
def _batch_sizes(traj: Trajectory) -> np.ndarray:
    return np.array([len(batch) for batch in traj.batches])


def check_unrollable(traj: Trajectory, module: torch.nn.Module) -> None:
    """Refuse, before any work, a path the unrolled derivative cannot be taken along."""
    check_replayable(traj, module)
    if traj._batch_weights is not None:
        # Re-weighting a point keeps its step's total weight S_t (the step's loss
        # S_t sum_i w_i beta_i l_i / sum_i w_i beta_i): a batch whose weights cancel to 0
        # (to their rounding) without all being 0 has no such mean, and 1 / S_t would
        # blow its scores up.
        beta, starts = traj._batch_weights, traj._batch_offsets[:-1]
        total = np.add.reduceat(beta, starts)
        size = np.add.reduceat(np.abs(beta), starts)
        zero = (size > 0) & (np.abs(total) <= np.diff(traj._batch_offsets)
                              * np.finfo(np.float64).eps * size)
        if zero.any():
            t = int(np.flatnonzero(zero)[0])
            raise ValueError(
                f"method='unrolled' re-weights a point within its step's loss, keeping the "
                f"sum of the step's batch weights, but the weights of {int(zero.sum())} "
                f"step(s) sum to 0 without all being 0 (first: step {t}, weights sum "
                f"{total[t]:.3g} of absolute sum {size[t]:.3g}; "
                "recorder.set_batch(indices, weights)): no weighted mean is defined there. "
                "The decomposition (decompose, attribute with another method) splits "
                "such a path.")


def check_replayable(traj: Trajectory, module: torch.nn.Module,
                     what: str = "method='unrolled'") -> None:
    """Refuse a path whose training steps :class:`Replay` cannot make again, naming
    ``what`` replays them."""
    # In eval mode they are what the path was trained with: fit and PathRecorder refuse
    # them in training mode.
    moving = [name for name, layer, _ in mode_dependent_layers(module) if layer.training]
    if moving:
        raise ValueError(
            f"{what} replays every training step, but the layer(s) {moving[:3]} "
            "are in training mode, where dropout draws random masks, BatchNorm mixes "
            "the batch and spectral normalisation moves its singular vectors, which the "
            "recorded path does not hold. Put the module in eval mode "
            "(module.eval()) as it was trained.")
    spec = traj.solver_spec
    if spec.name not in _SOLVERS:
        raise ValueError(f"{what} supports the solvers {sorted(_SOLVERS)}; the "
                         f"path was recorded with {spec.name!r}.")
    missing = [key for key in spec.state_keys if key not in traj.state_keys]
    if missing:
        raise ValueError(f"{what} needs the optimizer state {missing} at every "
                         f"recorded step ({spec.name} scales its steps by it); the path "
                         "does not record it.")
    if traj.n_steps == 0:
        raise ValueError(f"{what} needs a path with at least one optimizer step.")
    empty = np.flatnonzero(_batch_sizes(traj) == 0)
    if len(empty):
        raise ValueError(
            f"{what} replays every step's batch, but {len(empty)} of "
            f"{traj.n_steps} steps declare none (first: step {int(empty[0])}); record "
            "with PathRecorder(..., n_samples=len(X_train)) and recorder.set_batch(indices) "
            "at every step.")


# --------------------------------------------------------------------------- the sweep
class Replay:
    """A recorded path's training steps as the optimizer took them, replayed.

    Each step's gradient ``d_t`` from the declared loss, inputs and targets, and the
    optimizer's rule (``_SOLVERS``) with every step's recorded step size, clip factor and
    weight decay. On a thinned path (``record_every > 1``) an interval is replayed forward
    from its first recorded point (:meth:`interval`), its mismatch with the next recorded
    point kept in ``replay_error``; the first moments, which are not recorded, from a
    checkpointed forward replay of the whole path (:meth:`replay_moments`). The unrolled
    sweep (:class:`_Path`) and the exact decomposition of a thinned path
    (:class:`._decomposition.EveryStep`) read the path through it.
    """

    def __init__(self, module, traj, X, Y, loss, device, moments=None):
        self.module, self.traj, self.X, self.Y, self.loss = module, traj, X, Y, loss
        self.device = device
        self.spec = traj.solver_spec
        self.replay_error = 0.0
        # Each parameter's weight decay (its optimizer group's), L2 added to the gradient
        # after clipping or, for AdamW, decoupled.
        wd64 = traj.weight_decays()
        wd64 = float(self.spec.weight_decay) if wd64 is None else wd64.to(device=device)
        wd = wd64 if isinstance(wd64, float) else wd64.to(traj.dtype)
        adamw = self.spec.name == "adamw"
        self.coupled, self.coupled64 = (0.0, 0.0) if adamw else (wd, wd64)
        self.decoupled, self.decoupled64 = (wd, wd64) if adamw else (0.0, 0.0)
        self.scales = traj.gradient_scales
        self.step_lrs = traj.step_learning_rates
        self._moments = moments  # replay_moments' checkpoints
        self._segment: dict[int, torch.Tensor | None] = {}
        self.end_moment: torch.Tensor | None = None  # see interval
        self._module64: torch.nn.Module | None = None

    @property
    def needs_moments(self) -> bool:
        """A thinned path of a solver whose first moment is not recorded."""
        return bool(np.any(np.diff(self.traj.steps) != 1)) and _first_moment(self.spec)

    def params(self, k: int) -> torch.Tensor:
        return self.traj.parameters(k).to(self.device)

    def losses(self, theta, batch: np.ndarray, targets=None, outputs: bool = False):
        """The batch's per-sample losses at the flat ``theta`` (P,) or at the parameters
        ``theta`` as a mapping of name to tensor; in float64 when ``theta`` is, on a path
        of another dtype (the inputs and targets the training saw, in float64).
        ``targets``: the batch's targets (a leaf to differentiate), else the recorded
        ones; ``outputs``: also return the network's outputs (B, C)."""
        params = theta if isinstance(theta, dict) else self.traj.unflatten(theta)
        rows = torch.as_tensor(batch, device=self.device)
        module, X = self.module, self.X[rows]
        Y = self.Y[rows] if targets is None else targets
        if next(iter(params.values())).dtype != self.traj.dtype:
            if self._module64 is None:  # its buffers (a BatchNorm's statistics) too
                self._module64 = copy_module(self.module).to(GRADIENT_DTYPE)
            module, X, Y = self._module64, _in_gradient_dtype(X), _in_gradient_dtype(Y)
        out = functional_call(module, params, (forward_input(X),)).reshape(len(batch), -1)
        losses = self.loss.per_sample(out, Y)
        return (losses, out) if outputs else losses

    def weights(self, t: int) -> torch.Tensor:
        """Step ``t``'s batch weights as the loss applies them (``1 / |B|``: the mean)."""
        return torch.as_tensor(self.traj.batch_weights(t), dtype=self.traj.dtype,
                               device=self.device)

    def gradient(self, theta: torch.Tensor, t: int) -> torch.Tensor:
        """``d_t``: step ``t``'s loss gradient times its clip factor, plus coupled decay."""
        theta = theta.detach().requires_grad_(True)
        (g,) = torch.autograd.grad(self.losses(theta, self.traj.batch(t)), theta,
                                   grad_outputs=self.weights(t), allow_unused=True)
        g = torch.zeros_like(theta) if g is None else g
        return float(self.scales[t]) * g.detach() + self.coupled * theta.detach()

    def lr(self, j: int, t: int, dtype: torch.dtype | None = None) -> float | torch.Tensor:
        """The step size of step ``t`` (of interval ``j``): its own, as recorded, per
        parameter (in ``dtype``, the path's by default) when groups took their own."""
        lr = float(self.step_lrs[t])
        scales = self.traj._step_size_scales_at(t, j)
        return lr if scales is None else lr * scales.to(device=self.device,
                                                        dtype=dtype or self.traj.dtype)

    def decay(self, lr, exact: bool = False) -> float | torch.Tensor:
        """AdamW's decoupled decay factor ``1 - lr * weight_decay`` (1 for the others);
        ``exact``: from float64 weight decays (``lr`` in float64 too)."""
        if self.spec.name != "adamw":
            return 1.0
        return 1.0 - lr * (self.decoupled64 if exact else self.decoupled)

    def _state(self, k: int):
        """The optimizer state after the step leaving point k, as recorded."""
        state = self.traj.optimizer_state(k)
        v = next((state[key].to(self.device) for key in self.spec.state_keys), None)
        return v, float(state["step"])

    def start(self, j: int):
        """The recorded second moment and step count of the step leaving point ``j``
        (None and the step's count for SGD)."""
        if self.spec.state_keys:
            return self._state(j)
        return None, float(int(self.traj.steps[j]) + 1)

    def interval(self, j, theta=None, end=None, v=None, count=None, moment=None,
                 marks=None) -> list[tuple]:
        """Interval ``j``'s steps replayed forward from its first point: ``(t, theta_t,
        theta_{t+1}, count, v)`` of each (``v`` the second moment after the step), and
        its mismatch with the next recorded point taken into ``replay_error``; the first
        moment at its end is kept in ``end_moment``. The arguments not given are read
        from the record, ``moment`` (the first moment at point ``j``, which a caller
        replaying intervals in order holds: ``end_moment`` of the one before) from the
        replay's checkpoints. ``marks``: the checkpoints of :meth:`take` instead of the
        steps (an empty list returned)."""
        if self._moments is not None and moment is None:
            moment = self._moment(j)
        out, state = self._run(j, moment, theta, end, v, count, keep=marks is None,
                               marks=marks)
        self.end_moment = state.get("m")
        return out

    def _run(self, j, moment, theta=None, end=None, v=None, count=None, keep=False,
             marks=None):
        """Interval ``j`` from its recorded point with the first moment ``moment``: its
        steps (with ``keep``) and the optimizer state after it. The second moment starts
        from the record (both :meth:`interval` and the moments' replay, so that the
        first moments they give agree to the last bit). ``marks``: see :meth:`take`."""
        theta = self.params(j) if theta is None else theta
        end = self.params(j + 1) if end is None else end
        if count is None:
            v, count = self.start(j)
        first, last = int(self.traj.steps[j]), int(self.traj.steps[j + 1])
        state = {} if moment is None else {"m": moment}
        d = None
        if v is not None:
            # The recorded second moment is the one after the interval's first step:
            # undo that step's update so that the replay makes it again.
            d = self.gradient(theta, first)
            decay = self.spec.beta_2 if self.spec.name in ("adam", "adamw") \
                else self.spec.rmsprop_alpha
            state["v"] = ((v - (1.0 - decay) * d * d) / decay).clamp_min(0.0)
        if marks is not None:
            marks["count"] = count
        start = theta
        out, theta, state = self.take(j, theta, state, count, first, last, d, keep, marks)
        scale = float((end - start).norm()) or 1.0
        self.replay_error = worse(self.replay_error, float((theta - end).norm()) / scale)
        return out, state

    def take(self, j, theta, state, count, t0, t1, d=None, keep=False, marks=None):
        """Steps ``t0`` to ``t1 - 1`` of interval ``j`` from ``theta`` (the parameters
        before step ``t0``) and ``state`` (the optimizer's), ``count`` that of the
        interval's first step and ``d`` step ``t0``'s gradient where already taken:
        ``(out, theta, state)``, ``out`` the steps' ``(t, theta_t, theta_{t+1}, count,
        v)`` with ``keep``. ``marks`` (a dict, with an ``every``): the parameters and
        state before each ``every``-th step of the interval, from which :meth:`take`
        takes them again to the last bit (the same operations in the same order)."""
        step_fn = _SOLVERS[self.spec.name][0]
        first, every = int(self.traj.steps[j]), None if marks is None else marks["every"]
        out = []
        for t in range(t0, t1):
            if every is not None and (t - first) % every == 0:
                marks[t] = theta, state
            # The first step's gradient is the one the undo took.
            d = self.gradient(theta, t) if t > t0 or d is None else d
            c = count + (t - first)
            lr = self.lr(j, t)
            nxt, state = step_fn(self.spec, theta, state, d, lr, c, self.decay(lr))
            if keep:
                out.append((t, theta, nxt, c, state.get("v")))
            theta = nxt
        return out, theta, state

    def _advance(self, j: int, m: torch.Tensor | None) -> torch.Tensor:
        """The replay's first moment at point ``j + 1``: interval ``j`` replayed forward
        from recorded point ``j`` with the first moment ``m``."""
        return self._run(j, m)[1]["m"]

    def replay_moments(self) -> tuple[int, dict[int, torch.Tensor | None]]:
        """Checkpoints of the forward replay that recovers the first moments: the replay's
        first moment at every ``every``-th recorded point, ``every`` about the square
        root of the number of intervals. The moments in between are replayed again from
        the checkpoint before them, one segment at a time (:meth:`_moment`), so that about
        ``2 sqrt(n_points)`` (P,) vectors are held, not one a recorded point."""
        n = len(self.traj) - 1
        every = math.isqrt(max(n - 1, 0)) + 1  # ceil(sqrt(n))
        m = None
        checkpoints = {0: m}
        for j in range(every * ((n - 1) // every)):
            m = self._advance(j, m)  # each interval restarts on its recorded point
            if (j + 1) % every == 0:
                checkpoints[j + 1] = m
        return every, checkpoints

    def _moment(self, j: int) -> torch.Tensor | None:
        """The replay's first moment at recorded point ``j`` (None: no step taken yet).
        A segment is replayed whole from its checkpoint when one of its points is asked
        for, and kept until a point of another is: the unrolled sweep asks for the points
        last first, the decomposition's reference outputs first first, each a segment at
        a time."""
        if j not in self._segment:
            every, checkpoints = self._moments
            start = j - j % every
            stop = min(start + every, len(self.traj) - 1)
            m = checkpoints[start]
            self._segment = {}
            for i in range(start, stop):
                self._segment[i] = m
                if i < stop - 1:
                    m = self._advance(i, m)
        return self._segment[j]


class _Path(Replay):
    """The recorded path as the adjoint reads it: each step's values, last step first.

    With every step recorded they are read from the trajectory; on a thinned path each
    interval is replayed forward from its first point (and the first moments, which are
    not recorded, from a forward replay of the whole path).
    """

    def __init__(self, module, traj, X, Y, loss, device, moments=None, work=math.inf,
                 targets=False):
        super().__init__(module, traj, X, Y, loss, device, moments)
        # The targets' products too (unrolled_scores' ``standardized``).
        self.targets = targets
        # The route of _tangent_products; turned off for good by layers that forward-mode
        # AD or vmap cannot take.
        self.forward_ad = forward_over_reverse(module, traj.dtype, work)
        # A plain MLP takes the products by hand (:mod:`._mlp_products`), whatever the work.
        self.mlp = (stacked_mlp(module, traj.names)
                    if MLP_PRODUCTS and X.is_floating_point() and X.ndim == 2 else None)
        sizes = [math.prod(shape) for shape in traj.shapes]
        starts = np.cumsum([0, *sizes[:-1]])
        self.layout = {n: (int(a), int(b)) for n, a, b in zip(traj.names, starts, sizes)}
        self.scratch: dict = {}  # the products' buffers, reused at every step
        # Adam's and RMSprop's adjoint multiplies each step's gradient by the second
        # moment's adjoint, divided by sqrt(v): see GRADIENT_DTYPE.
        self.exact_gradient = bool(self.spec.state_keys) and traj.dtype != GRADIENT_DTYPE
        self.fallback: str | None = None  # why the module did not run in float64
        self.batched_double_backward = True
        self.graph_checked = False  # check_twice_differentiable, once a call

    def step(self, theta, nxt, j, count, v, t) -> _Step:
        lr = self.lr(j, t)
        return _Step(theta, nxt, lr, count, v, self.traj.batch(t),
                     self.traj.batch_weights(t), float(self.scales[t]), self.decay(lr),
                     self.decay(self.lr(j, t, torch.float64), exact=True))

    def steps(self):
        """``_Step`` of every optimizer step, last first."""
        traj = self.traj
        nxt = self.params(len(traj) - 1)
        for j in reversed(range(len(traj) - 1)):
            theta = self.params(j)
            first, last = int(traj.steps[j]), int(traj.steps[j + 1])
            v, count = self.start(j)
            if last - first == 1:
                yield self.step(theta, nxt, j, count, v, first)
            else:
                yield from reversed([self.step(a, b, j, c, w, t) for t, a, b, c, w
                                     in self.interval(j, theta, nxt, v, count)])
            nxt = theta


def forward_over_reverse(module: torch.nn.Module, dtype: torch.dtype,
                         work: float = math.inf) -> bool:
    """Whether :func:`_tangent_products` takes forward over reverse (else the double
    backward), by what measured faster, one thread (``benchmarks/results/unrolled_ab.md``,
    ``unrolled_routes.md``, ``unrolled_routes-small.md``).

    ``work``: the step's batched products, queries x batch x activation values per
    sample (:func:`_query_work` for each query). Forward over reverse pays a fixed cost per step
    (the vmapped jvp's transforms, torch's Python decompositions for jvp) that the double
    backward does not: below ``FORWARD_WORK`` the double backward was faster (MLPs of
    widths 4-256 in float64, 1.2-2.7x; in float32 1.1-2.0x, though one earlier run of
    the tiny float32 MLP had forward over reverse 1.09x faster), above it forward over
    reverse in float32 (1.07-1.62x at 3.5-11.7 million), even in float64 (0.97-1.09x).
    Convolutional networks in float64 take the double backward at any size: their
    convolutions (no oneDNN kernel in float64) with the queries folded into batch and
    channels ran 0.88x and 1.00x the double backward's loop over the queries in two runs.
    """
    convolutional = any(isinstance(layer, torch.nn.modules.conv._ConvNd)
                        for layer in module.modules())
    return work >= FORWARD_WORK and not (dtype == torch.float64 and convolutional)


def _batch_graph(path: _Path, step: _Step):
    """The step's gradient ``d_t``, the same in the path's rounding when ``d_t`` is
    taken in float64 (else None; see GRADIENT_DTYPE), the norm of its loss gradient, and
    its pullback.

    The pullback takes the adjoints ``u`` (Q, P) of ``d_t`` to each batch point's score
    share (Q, B), to ``H v`` (Q, P), ``v = (d d_t / d g)^T u`` (see the module doc:
    ``c u`` unclipped, ``c (u - g (g . u) / (|g| (|g| + 1e-6)))`` clipped), and, where
    ``path.targets``, to the batch targets' share ``beta_i d (grad l_i . v) / d y_i``
    (Q, B, C) (else None), by :func:`_tangent_products`.
    """
    batch = step.batch
    beta = torch.as_tensor(step.weights, dtype=step.theta.dtype, device=step.theta.device)
    if path.mlp is not None:
        # A plain MLP's forward and backward by hand, kept for its products.
        rows = torch.as_tensor(batch, device=path.device)
        graph = MLPStep(path.mlp, path.layout, step.theta.detach(), path.X[rows],
                        path.Y[rows], path.loss, beta, path.scratch, targets=path.targets)
        g = graph.gradient
    else:
        # The double backward differentiates this very gradient again: its graph is kept
        # for the pullback, which saves that route a forward-backward of the batch per
        # step.
        keep = not path.forward_ad
        graph = _gradient_graph(path, step.theta, batch, beta, keep, path.targets)
        g = graph[2]
        graph = graph if keep else None
    rounded = g
    theta = step.theta.detach()
    if path.exact_gradient:
        g = _exact_gradient(path, step, g)
    flat = torch.zeros_like(theta) if g is None else g.detach()
    norm = float(flat.double().norm())
    if flat.dtype == theta.dtype:
        d = step.scale * flat + path.coupled * step.theta
        rounded = None
    else:
        # d_t in float64, its weight decay too (where it cancels the gradient, its
        # rounding counted as much), rounded once after the sums that lose digits: the
        # adjoint only multiplies it, in the path's dtype (the audit's scores the same
        # with the adjoint in float64).
        d = (step.scale * flat + path.coupled64 * theta.double()).to(theta.dtype)
        flat = flat.to(theta.dtype)
        # The probe's: the same step with the gradient summed in the path's rounding.
        if rounded is not None:
            rounded = step.scale * rounded.detach() + path.coupled * step.theta
    # clip_grad_norm_ leaves an unclipped gradient as it is (factor exactly 1); a factor
    # below 1 is max_norm / (|g| + 1e-6), which moves with g.
    clipped = step.scale < 1.0 - 16 * torch.finfo(theta.dtype).eps and norm > 0
    kappa = 1.0 / (norm * (norm + CLIP_EPS)) if clipped else 0.0
    beta64 = beta.double()
    # A batch whose weights sum to 0 (zero sample weights) has no data gradient, and no
    # point's weight multiplier can change that (every w_i * s_i stays 0): share 0, not 0/0.
    total = float(beta64.sum())

    def pullback(U: torch.Tensor):
        V = step.scale * U
        if kappa:
            V = V - (step.scale * kappa) * (U @ flat)[:, None] * flat
        if g is None:  # the loss does not depend on the parameters
            return (U.new_zeros((len(U), len(batch)), dtype=torch.float64),
                    torch.zeros_like(U), None)
        HV, D, E = _tangent_products(path, theta, batch, beta, V, graph)
        D = D.double()
        if total == 0.0:
            return D.new_zeros(D.shape), HV, E
        return beta64 * (D - (D @ beta64)[:, None] / total), HV, E

    return d, rounded, norm, pullback


def _exact_gradient(path: _Path, step: _Step, rounded):
    """The step's loss gradient in float64 at its recorded point (see GRADIENT_DTYPE), its
    batch weights in float64 too; ``rounded``, the route's own gradient, for a module that
    cannot run in float64 (recorded in ``path.fallback``, which the call warns of)."""
    beta = torch.as_tensor(step.weights, dtype=GRADIENT_DTYPE, device=path.device)
    try:
        return _gradient_graph(path, step.theta.to(GRADIENT_DTYPE), step.batch, beta,
                               False)[2]
    except torch.OutOfMemoryError:
        raise
    except (RuntimeError, TypeError) as exc:  # TypeError: an op refusing the dtype
        path.exact_gradient = False
        path.fallback = f"{type(exc).__name__}: {exc}"
        return rounded


def _in_gradient_dtype(values: torch.Tensor) -> torch.Tensor:
    return values.to(GRADIENT_DTYPE) if values.is_floating_point() else values


def _tangent_products(path: _Path, theta, batch, beta, V, graph=None):
    """``H v`` (Q, P) and every batch point's ``grad l_i . v`` (Q, B) for each row ``v``
    of ``V``, ``H`` the Hessian of ``sum_i beta_i l_i`` at ``theta``; where
    ``path.targets``, also ``beta_i d (grad l_i . v) / d y_i`` (Q, B, C), else None.

    Forward over reverse: one ``jvp`` of ``theta -> (sum_i beta_i grad l_i, (l_i)_i)``
    in direction ``v`` gives both (the outputs' tangents ``J_i v`` too, which the
    loss's ``d^2 l_i / df_i dy_i`` takes to the targets' products), vmapped over the
    queries, where
    :func:`forward_over_reverse` chose it (the double backward of convolution and
    pooling has no batching rule, so vmap loops over the queries there). Layers that
    forward-mode AD or vmap cannot take fall back to the double backward, which
    differentiates ``graph`` (:func:`_gradient_graph`) when the step kept one.
    """
    if isinstance(graph, MLPStep):
        return graph.products(V)
    traj = path.traj
    names = traj.names
    # One primal per parameter, each a copy: forward-mode AD gives a view's tangent its
    # base's size, and the recorded point is a view of the whole stored path (a
    # (Q, n_points, P) fill per parameter and step; 4x the MLP's time when it was).
    primals = tuple(t.clone() for t in traj.unflatten(theta.detach()).values())

    def weighted(params):
        losses, out = path.losses(dict(zip(names, params)), batch, outputs=True)
        return (losses * beta).sum(), (losses, out)

    gradient = grad(weighted, has_aux=True)

    def products(*tangents):
        (_, (_, out)), (hv, (dl, dout)) = jvp(gradient, (primals,), (tangents,))
        return torch.cat([h.reshape(-1) for h in hv]), dl, out, dout

    if path.forward_ad:
        try:
            with FORWARD_AD:
                HV, D, out, Jv = vmap(products)(*traj.unflatten(V).values())
            E = None
            if path.targets:  # the outputs (the same for every query) and their tangents
                rows = torch.as_tensor(batch, device=path.device)
                cross = path.loss.target_hessian(out[0].detach(), path.Y[rows])
                E = torch.einsum("qbc,bct->qbt", Jv, cross * beta[:, None, None])
            return HV, D, E
        except (RuntimeError, NotImplementedError):
            path.forward_ad = False  # decided once: the same layers at every step
    if graph is None:
        graph = _gradient_graph(path, theta, batch, beta, targets=path.targets)
    return _double_backward(path, *graph, V)


def _gradient_graph(path: _Path, theta, batch, beta, create_graph: bool = True,
                    targets: bool = False):
    """``(theta, beta, g, y)``: ``g(beta) = sum_i beta_i grad l_i(theta)`` (None where
    the loss does not depend on the parameters) and, with ``create_graph``, the leaves
    that require grad and ``g``'s graph for :func:`_double_backward`; ``targets``: the
    batch's targets ``y`` are a leaf of it too (else None)."""
    theta = theta.detach().requires_grad_(True)
    beta = beta.detach().requires_grad_(create_graph)
    y = None
    if targets and create_graph:
        y = path.Y[torch.as_tensor(batch, device=path.device)].detach().requires_grad_(True)
    (g,) = torch.autograd.grad(path.losses(theta, batch, targets=y), theta,
                               grad_outputs=beta, create_graph=create_graph,
                               allow_unused=True)
    return theta, beta, g, y


def _double_backward(path: _Path, theta, beta, g, y, V):
    """:func:`_tangent_products` by reverse over reverse, for the layers forward-mode AD
    cannot take: with ``g(beta) = sum_i beta_i grad l_i(theta)`` and its graph
    (:func:`_gradient_graph`), the gradient of ``g . v`` is ``grad l_i . v`` with respect
    to ``beta_i``, ``H v`` with respect to ``theta`` and the targets' products with
    respect to the targets ``y`` (where they are a leaf), one double backward for every
    query at once."""
    E = None if y is None else V.new_zeros((len(V), *y.shape))
    if g is None:  # the loss does not depend on the parameters
        return torch.zeros_like(V), V.new_zeros((len(V), len(beta))), E
    leaves = (beta, theta) if y is None else (beta, theta, y)
    if not path.graph_checked:  # the same layers at every step
        check_twice_differentiable(g)
        path.graph_checked = True
    if path.batched_double_backward:
        try:
            D, HV, *Ey = torch.autograd.grad(g, leaves, grad_outputs=V,
                                             is_grads_batched=True, allow_unused=True,
                                             retain_graph=True)
        except RuntimeError:
            # Some layers' double backward has a wrong batching rule (GroupNorm's
            # raises a size mismatch): one double backward per query.
            path.batched_double_backward = False
    if not path.batched_double_backward:
        rows = [torch.autograd.grad(g, leaves, grad_outputs=v, allow_unused=True,
                                    retain_graph=True) for v in V]
        D = None if rows[0][0] is None else torch.stack([r[0] for r in rows])
        HV = None if rows[0][1] is None else torch.stack([r[1] for r in rows])
        Ey = [None if y is None or rows[0][2] is None else torch.stack([r[2] for r in rows])]
    if Ey and Ey[0] is not None:
        E = Ey[0].reshape(E.shape)
    D = V.new_zeros((len(V), len(beta))) if D is None else D
    return torch.zeros_like(V) if HV is None else HV, D, E


def _query_gradients(module, traj, theta, Xq, Wq, budget) -> torch.Tensor:
    """``grad_theta (w_q . f(x_q; theta))`` for every query, (Q, P): the tangent engine's
    one backward pass seeded with the weights (the decomposition's contracted route).

    Not ``vmap(grad(...))``: torch.func's ``grad`` imports torch._dynamo on its first
    call (1.5-2 s, once per process), which the double-backward route never needs."""
    return contracted_features(module, traj.unflatten(theta), Xq, Wq, memory_budget=budget)


def _block(module, traj, X, Y, loss, Xq, Wq, device, query_work, budget, moments,
           probe=True, targets=False):
    """Scores (Qb, N) float64, growth (Qb,), the per-step sums of the adjoint's log
    one-step amplification and their counts (n_steps,), the replay error, each step's
    loss-gradient norm, the probe's gradient sensitivity (None where not probed), why
    the module fell back, and with ``targets`` the targets' sums (see
    :func:`unrolled_scores`), two (Qb, C) float64 arrays (else None).

    The stability measures are accumulated along the sweep: nothing of size
    ``(n_steps, Qb)`` is kept.
    """
    spec = traj.solver_spec
    adjoint_fn = _SOLVERS[spec.name][1]
    path = _Path(module, traj, X, Y, loss, device, moments, len(Xq) * query_work,
                 targets)
    theta_T = path.params(len(traj) - 1)
    a = {"theta": _query_gradients(module, traj, theta_T, Xq, Wq, budget).detach()}
    # The probe: a combination of the queries with signs +-1 as a last row, its steps
    # taken with the gradient in the path's rounding (see GRADIENT_DTYPE). Its relative
    # change was within the queries' own (from 0.1 to 10 times each other's) on the
    # paths measured; the first query alone was at their low end.
    Q, probe = len(Xq), probe and path.exact_gradient and len(Xq) > 0
    if probe:
        signs = np.random.RandomState(0).choice([-1.0, 1.0], size=Q)
        signs = torch.as_tensor(signs, dtype=a["theta"].dtype, device=device)
        a["theta"] = torch.cat([a["theta"], (signs @ a["theta"])[None]])
    N = traj.n_samples
    scores = torch.zeros((len(a["theta"]), N), dtype=torch.float64, device=device)
    prev = a["theta"][:Q].norm(dim=1).double()
    final = torch.where(prev > 0, prev, torch.nan)  # NaN: an output without parameters
    growth = prev / final
    log_sum = torch.zeros(traj.n_steps, dtype=torch.float64, device=device)
    count = torch.zeros(traj.n_steps, dtype=torch.float64, device=device)
    norms = np.zeros(traj.n_steps)  # each step's loss-gradient norm, for the clip check
    # sum_i d m / d y_i and sum_i y_i d m / d y_i, summed over the steps as they come.
    Y2 = Y.reshape(len(Y), -1)
    shift = scale = None
    if targets:
        shift = torch.zeros((len(a["theta"]), Y2.shape[1]), dtype=torch.float64,
                            device=device)
        scale = torch.zeros_like(shift)
    # The recorded moves against the modelled training's, one step behind (the sweep runs
    # backwards and step t's residual needs step t-1's direction). Summed over the
    # steps, so that the round-off of the tiny steps of a converged run does not count
    # for more than their share. The direction a move implies is the move over its step
    # size, holding the move's round-off times 1 / lr: each step's mismatch is weighted
    # by its own step size (Adam's and RMSprop's per parameter: a mismatch in the first
    # moment of a parameter of small second moment moves it, and the scores, by more;
    # an L2 term by hand read 4e-4 in the first moment's units, silent, with the scores
    # 9e-2 off), and is the modelled state's, the residuals carried through the first
    # moment (_replay_check), in which a direction's round-off cancels but on its own
    # step. A schedule's tiny steps (OneCycleLR's last at 1e-4 of the initial rate, a
    # warm-up from 1e-6 of it) made a complete float32 record mismatch by 1e-2
    # unweighted, a false warning. Each step's residual alone against the recorded
    # state, not the modelled one, read an error the momentum carries over about
    # 1 / (1 - momentum) steps once: an L2 term of 1e-3 by hand under momentum 0.9 read
    # 7.9e-4, silent, with the scores 2e-3 off (benchmarks/results/replay_silences.md).
    pending, off, size = None, 0.0, 0.0
    rounding = torch.zeros((), dtype=torch.float64, device=device)
    # The recorded points are finite (the mismatch's nansum would skip a NaN one): each
    # step's end here, the first point after the sweep; on the device, read once.
    finite = torch.ones((), dtype=torch.bool, device=device)
    # Every step allocates the same temporaries: freed, large ones stay in the heap for
    # the next (see retained_heap); what the sweep made is freed inside, and what the
    # call returns (scores, allocated before) is not the heap's to keep.
    step_bytes = (len(a["theta"]) * _products_bytes(module, traj, query_work)
                  if torch.device(device).type == "cpu" else 0)
    with retained_heap(step_bytes):
        for back, step in enumerate(path.steps()):
            t = traj.n_steps - 1 - back
            finite &= torch.isfinite(step.nxt).all()
            d, rounded, norms[t], pullback = _batch_graph(path, step)
            direction, memory, gain, size_t = _implied(spec, step, d)
            step_off, step_size, pending = _replay_check(pending, direction, memory,
                                                         gain * d, size_t)
            off, size = off + step_off, size + step_size
            rounding += _rounding(spec, step)
            before = a
            u, a = adjoint_fn(spec, step, a, d)
            if probe and rounded is not None:
                u_probe, a_probe = adjoint_fn(
                    spec, step, {k: v[Q:] for k, v in before.items()}, rounded)
                u[Q:] = u_probe
                for key, value in a_probe.items():
                    a[key][Q:] = value
            del before
            share, HV, E = pullback(u)
            del pullback  # and the graph it holds, before the next step builds its own
            rows = torch.as_tensor(step.batch, device=device)
            scores.index_add_(1, rows, share)
            if E is not None:
                E = E.double()
                shift += E.sum(1)
                scale += torch.einsum("qbc,bc->qc", E, Y2[rows].double())
            # HV is the products' own (Q, P): the new adjoint, in place.
            a["theta"] = HV.add_(a["theta"])
            if isinstance(path.coupled, torch.Tensor):
                a["theta"].addcmul_(u, path.coupled)
            elif path.coupled:
                a["theta"].add_(u, alpha=path.coupled)
            norm = a["theta"][:Q].norm(dim=1).double()
            growth = torch.fmax(growth, norm / final)  # fmax: NaN only where both are
            ratio = norm / prev  # |a_t| / |a_{t+1}|
            ok = (prev > 0) & (ratio > 0)
            log_sum[t] = torch.where(ok, ratio.log(), 0.0).sum()
            count[t] = ok.sum()
            prev = norm
        if pending is not None:  # the first step: no direction before it
            step_off, step_size, _ = _replay_check(pending, None, memory, None, None)
            off, size = off + step_off, size + step_size
            finite &= torch.isfinite(step.theta).all()
        a = u = share = HV = E = pending = step = None
        path.scratch.clear()
    off, size, rounding = float(off), float(size), float(rounding)
    # The recorded points' own rounding, which enters the sum on its step alone, is no
    # mismatch: read less its largest (the triangle inequality), what remains is at most
    # the training's. Read with it, a complete float32 record of plain SGD at lr 1e-5
    # (moves of 1e-5 of the parameters, whose rounding is 6e-8 of them) read 5.4e-3 and
    # warned while its scores met central differences of the training to 1.6e-7.
    # max: the quadratic form's rounding may take a zero sum below 0.
    mismatch = (max(math.sqrt(max(off, 0.0)) - math.sqrt(rounding), 0.0) / math.sqrt(size)
                if size > 0 else 0.0) if bool(finite) else math.nan
    scores = scores.cpu().numpy()
    sensitivity = None
    if probe and path.exact_gradient:  # not measured where the module fell back
        # Against the combination's size whatever the signs (its scores may cancel):
        # each point's root sum of squares over the queries. NaN through NaN scores.
        top = np.sqrt((scores[:Q] ** 2).sum(0)).max()
        change = np.abs(scores[Q] - signs.cpu().numpy() @ scores[:Q]).max()
        sensitivity = float(change / top) if top > 0 or np.isnan(top) else 0.0
    sums = None if shift is None else (shift[:Q].cpu().numpy(), scale[:Q].cpu().numpy())
    return (scores[:Q], growth.cpu().numpy(), log_sum.cpu().numpy(),
            count.cpu().numpy(), worse(path.replay_error, mismatch), norms, sensitivity,
            path.fallback, sums)


def _query_work(module, traj, X) -> int:
    """A query's share of a step's batched products: the largest batch times the values
    every submodule outputs for one sample (a forward pass with hooks)."""
    sizes = []
    hooks = [m.register_forward_hook(lambda m, i, o: sizes.append(
        o.numel() if isinstance(o, torch.Tensor) else 0)) for m in module.modules()]
    try:
        with torch.no_grad():
            functional_call(module, traj.unflatten(traj.parameters(0).to(X.device)),
                            (forward_input(X[:1]),))
    finally:
        for h in hooks:
            h.remove()
    return int(_batch_sizes(traj).max()) * sum(sizes)


def _products_bytes(module, traj, query_work) -> int:
    """A query's share of a step's tangent products: their intermediates, a few per
    activation value and batch sample."""
    # The forward route keeps about 1.8x the double backward's (peak memory of 100
    # queries on a small CNN, 410 against 231 MiB; 188 against 154 MiB on an MLP). The
    # forward route's factor wherever it may be taken: the route depends on the block
    # size that this estimate sets.
    per_activation = 11 if forward_over_reverse(module, traj.dtype) else 6
    return per_activation * query_work * traj.dtype.itemsize


def _row_bytes(module, traj, query_work) -> int:
    """Bytes a query needs: the adjoint's buffers and its share of a batched backward."""
    # Six (P,) buffers (adjoint, moments, gradient adjoint, products) besides the products.
    return (6 * traj.n_params * traj.dtype.itemsize
            + _products_bytes(module, traj, query_work) + 8 * traj.n_samples)


def _run_rows(rows, net, X, Y, Xq, Wq, block, diagonal, moments, query_work, probe,
              targets=False):
    """One task's query blocks: scores, growth, the summed per-step log amplification and
    counts (one (n_steps,) pair a task, whatever the number of blocks), replay error,
    each step's loss-gradient norm (the same in every block), the gradient sensitivity,
    why the module fell back, and the targets' sums (None without ``targets``)."""
    # A module of this task's own: functional_call swaps the parameters it is given into
    # the module for the call, so tasks on joblib threads sharing one would compute with
    # each other's (silently wrong scores, or a crash).
    module, traj = copy_module(net.module), net.trajectory
    device = net.torch_device
    rows = np.asarray(rows)
    scores, growth, sums = [], [], []
    log_sum, count = np.zeros(traj.n_steps), np.zeros(traj.n_steps)
    error, norms, sensitivity, fallback = 0.0, None, None, None
    for start in range(0, len(rows), block):
        r = rows[start:start + block]
        with twice_differentiable():
            s, g, logs, n, e, norms, sens, why, ts = _block(
                module, traj, X, Y, net.loss, Xq[r], Wq[r], device, query_work,
                net.memory_budget, moments, probe=probe, targets=targets)
        if sens is not None:
            sensitivity = worse(sensitivity or 0.0, sens)
        fallback = fallback or why
        if diagonal:  # query q is training point rows[q]: keep its own score only
            s = s[np.arange(len(r)), r][:, None]
        scores.append(s)
        growth.append(g)
        sums.append(ts)
        log_sum += logs
        count += n
        error = worse(error, e)
    if not scores:
        return None
    sums = (tuple(np.concatenate(part) for part in zip(*sums)) if targets else None)
    return (np.concatenate(scores), np.concatenate(growth), log_sum, count, error, norms,
            sensitivity, fallback, sums)


def unrolled_scores(net, X, Y, Xq, weights, *, n_jobs=None, diagonal: bool = False,
                    standardized=None) -> AttributionScores:
    """The counterfactual scores ``d (w_q . f(x_q; theta_T)) / d w_i`` (see module doc).

    ``net``: a TrainedNetwork; ``X, Y``: its training inputs and targets as tensors;
    ``Xq``: the queries as a tensor; ``weights``: (Q, C) the contracted output of each
    query. Query blocks fit ``net.memory_budget`` and run on ``n_jobs`` joblib workers.
    ``diagonal``: the queries are the training points themselves, and each keeps only
    its own score (self-influence, shape (N, 1)). ``standardized``: None, or
    ``(outputs, n_rows, constant)`` for a regressor whose targets were standardized by
    the weighted mean and standard deviation of the first ``n_rows`` training targets
    (``normalize_y``): the scores then also carry those moments' dependence on the
    weights (:func:`_restandardize`); ``outputs`` (Q, C) are the network's at the
    queries, ``constant`` (C,) marks the columns only centered (no spread).
    """
    traj = net.trajectory
    # The warnings name the method the user called: self_influence's said
    # "attribute(method='unrolled')", which the user had not called.
    what = "self_influence()" if diagonal else "attribute(method='unrolled')"
    check_unrollable(traj, net.module)
    warn_tied_padding(net.module, traj, X, analysis=what)
    Wq = torch.as_tensor(np.asarray(weights), dtype=traj.dtype, device=Xq.device)
    query_work = _query_work(net.module, traj, X)
    row_bytes = _row_bytes(net.module, traj, query_work)
    block = rows_per_block(net.memory_budget, row_bytes, "The unrolled attribution's adjoint")
    path = _Path(net.module, traj, X, Y, net.loss, net.torch_device)
    # Each block's probe row (see _block) is one row of the budget's; a budget of one
    # row takes the scores without it.
    probe = path.exact_gradient and block > 1
    if probe:
        block -= 1
    elif path.exact_gradient:
        warnings.warn(
            f"{what}: memory_budget={int(net.memory_budget):,} "
            "bytes holds one query's adjoint, and measuring the scores' sensitivity to "
            "float32 gradients (AttributionScores.gradient_sensitivity, None here) takes "
            f"another: raise it to at least {2 * row_bytes:,} bytes to measure it.",
            UserWarning, stacklevel=caller_stacklevel(),
        )
    moments = path.replay_moments() if path.needs_moments else None
    rows = np.arange(len(Xq))
    shared = net.for_workers(by_reference=by_reference(n_row_blocks(n_jobs, rows)))
    parts = [p for p in map_row_blocks(_run_rows, rows, n_jobs, shared, X, Y, Xq, Wq, block,
                                       diagonal, moments, query_work, probe,
                                       standardized is not None) if p is not None]
    if parts:
        scores = np.concatenate([p[0] for p in parts])
        if standardized is not None:
            sums = [np.concatenate(part) for part in zip(*(p[8] for p in parts))]
            scores = _restandardize(scores, *sums, np.asarray(weights, dtype=np.float64),
                                    net, *standardized, diagonal=diagonal)
        growth = np.concatenate([p[1] for p in parts])
        log_sum = np.sum([p[2] for p in parts], axis=0)
        count = np.sum([p[3] for p in parts], axis=0)
        with np.errstate(divide="ignore", invalid="ignore"):
            amplification = np.where(count > 0, np.exp(log_sum / np.maximum(count, 1)),
                                     np.nan)
    else:
        scores = np.zeros((0, 1 if diagonal else traj.n_samples))
        growth = np.zeros(0)
        amplification = np.ones(traj.n_steps)
    result = scores.view(AttributionScores)
    result.growth = growth
    result.amplification = amplification
    result.replay_error = worst((p[4] for p in parts), 0.0)
    probed = [p[6] for p in parts if p[6] is not None]
    result.gradient_sensitivity = worst(probed) if probed else None
    _warn(result, traj, what)
    _warn_sensitivity(result, traj, next((p[7] for p in parts if p[7]), None), what)
    if parts:
        _check_clipping(traj, parts[0][5], what, net.module)
    return result


def _restandardize(scores, shift, scale, weights, net, outputs, n_rows, constant, *,
                   diagonal=False) -> np.ndarray:
    """The scores of a regressor whose targets are standardized by moments that move
    with the weights (``normalize_y``: a refit with other sample weights standardizes
    anew).

    With ``t_j = (y_j - mu(w)) / s(w)`` the network's targets and ``p = mu + s f`` its
    prediction, the weighted moments of the first ``n_rows`` points (``s_i`` their
    sample weights, ``W`` their sum) move as ``d mu / d w_i = s_i s t_i / W`` and
    ``d s / d w_i = s_i s (t_i^2 - 1) / (2 W)`` (0 for a constant column, whose scale
    stays 1), so that the explained ``m = sum_c a_c p_c`` (``Wq_c = a_c s_c``, the
    weights the sweep contracted the outputs with) moves by, beyond the scores held at
    the fit's moments,

        (s_i / W) sum_c [t_ic (Wq_c - S_c) + (t_ic^2 - 1) / 2 (Wq_c f_c - R_c)]

    where ``S_c = sum_j d m / d t_jc`` and ``R_c = sum_j t_jc d m / d t_jc`` through the
    training (the sweep's ``shift`` and ``scale``, (Q, C)). Checked against finite
    differences of refits with ``sample_weight`` (``tests/test_unrolled_normalize_y.py``).
    """
    T = np.asarray(net.y_fit[:n_rows], dtype=np.float64).reshape(n_rows, -1)
    w = (np.ones(n_rows) if net.sample_weight is None
         else np.asarray(net.sample_weight[:n_rows], dtype=np.float64))
    share = w / w.sum()
    half = (T**2 - 1.0) / 2.0
    half[:, np.asarray(constant, dtype=bool).reshape(-1)] = 0.0
    mean_part = weights - shift
    scale_part = weights * np.asarray(outputs, dtype=np.float64) - scale
    if diagonal:  # query q is training point q: its own row
        q = np.arange(min(n_rows, len(scores)))
        scores = scores.copy()
        scores[q, 0] += share[q] * ((mean_part[q] * T[q]).sum(1)
                                    + (scale_part[q] * half[q]).sum(1))
        return scores
    scores = scores.copy()
    scores[:, :n_rows] += share * (mean_part @ T.T + scale_part @ half.T)
    return scores


def _check_clipping(traj: Trajectory, norms: np.ndarray, what: str,
                    module: torch.nn.Module) -> None:
    """Warn when the recorded gradient factors are not one ``clip_grad_norm_``'s.

    The scores differentiate a factor below 1 as ``max_norm / (|g| + 1e-6)`` (the L2 norm
    of the loss gradient): each clipped step implies its ``max_norm``. A constant
    factor of another origin, another norm or a changing ``max_norm`` shows as clipped
    steps that disagree on it, or an unclipped step whose norm is above it. So does the
    fine-tuning slip of ``clip_grad_norm_(module.parameters())`` with parameters outside
    the record holding a ``.grad`` (frozen ones' left from pretraining, or ones the
    optimizer is not given): its norm counts them, so they are named.
    """
    scales = traj.gradient_scales
    eps = 16 * float(torch.finfo(traj.dtype).eps)
    clipped = scales < 1.0 - eps
    if not clipped.any():
        return
    implied = scales[clipped] * (norms[clipped] + CLIP_EPS)
    top = float(implied.max())
    spread = (top - float(implied.min())) / top
    above = norms[~clipped] + CLIP_EPS > top * (1.0 + REPLAY_LIMIT)
    if spread > REPLAY_LIMIT or above.any():
        larger = (f", and {int(above.sum())} unclipped steps have a larger norm"
                  if above.any() else "")
        recorded = set(traj.names)
        held = [n for n, p in module.named_parameters()
                if n not in recorded and p.grad is not None]
        outside = "" if not held else (
            f" Parameters outside the record hold gradients ({', '.join(held[:3])}"
            f"{', ...' if len(held) > 3 else ''}): a clip_grad_norm_ over "
            "module.parameters() counts them in its norm (and scales them), which the "
            "scores do not differentiate. Clip over the parameters the optimizer trains, "
            "or set the others' .grad to None (module.zero_grad(set_to_none=True) "
            "before recording; a frozen parameter's .grad is left from before it was "
            "frozen).")
        warnings.warn(
            f"{what}: the recorded gradient factors "
            "(Trajectory.gradient_scales) are not those of one "
            "clip_grad_norm_(max_norm) with the L2 norm: the clipped steps imply max_norm "
            f"from {float(implied.min()):.6g} to {top:.6g}"
            f"{larger}. "
            "The scores differentiate each factor as max_norm / (norm + 1e-6) with its "
            "step's own max_norm, which is the derivative of the training only for an L2 "
            f"norm clip (with a max_norm that changed between steps).{outside}",
            UserWarning, stacklevel=caller_stacklevel(),
        )


def warn_tied_padding(module: torch.nn.Module, traj: Trajectory, X: torch.Tensor,
                      analysis: str = "attribute(method='unrolled')",
                      results: str = "scores") -> None:
    """Warn of an ``nn.Embedding`` whose ``padding_idx`` row the network also reads
    another way (its weight tied to an output layer's): ``analysis``'s ``results`` miss
    what the lookups read from it. (The exact decomposition's closure check measures
    that miss; the approximate ones have no tolerance to show it.)

    torch's embedding backward gives the padding row a zero gradient, as if the lookup
    did not read it, which holds the row still where the lookup is its only use. Read
    elsewhere too, the row moves with the training points, and the output's derivative
    misses what the lookup reads from it: unrolled scores 3e-3 to 2e-2 off finite
    differences of the training on a tied network, silently
    (``benchmarks/results/layers_audit.md``). The other use shows as a nonzero gradient
    of the row (the lookup gives it none): one backward pass over a few training inputs
    at the path's end.
    """
    padded = [(name, layer) for name, layer in module.named_modules()
              if isinstance(layer, torch.nn.Embedding) and layer.padding_idx is not None]
    if not padded:
        return
    leaf = traj.parameters(-1).to(X.device).detach().clone().requires_grad_(True)
    params = traj.unflatten(leaf)
    with torch.enable_grad():
        out = functional_call(module, dict(params), (forward_input(X[:8]),))
        (g,) = torch.autograd.grad(out.sum(), leaf, allow_unused=True)
    if g is None:
        return
    grads = traj.unflatten(g)
    # A frozen embedding (not on the path) never moves.
    names = {id(p): name for name, p in module.named_parameters() if name in grads}
    read = [(name or "(the module)", layer.padding_idx) for name, layer in padded
            if id(layer.weight) in names
            and bool(grads[names[id(layer.weight)]][layer.padding_idx].ne(0).any())]
    if read:
        name, index = read[0]
        warnings.warn(
            f"{analysis}: the embedding {name!r} has padding_idx={index}, "
            "whose row torch's backward gives a zero gradient (as if its lookups did not "
            "read it), but the network also reads that row another way (its weight is "
            "tied to another layer's), so the row moved with the training points and the "
            f"{results} miss what the lookups read from it. Build the embedding without "
            f"padding_idx (mask the padding tokens' outputs instead) for exact {results}.",
            UserWarning, stacklevel=caller_stacklevel(),
        )


def _warn(result: AttributionScores, traj: Trajectory, what: str) -> None:
    # NaN: a query whose output does not depend on the parameters; inf: an adjoint that
    # overflowed, which is growth beyond any limit.
    growth = result.growth[~np.isnan(result.growth)]
    growth = float(growth.max()) if growth.size else 0.0
    adaptive = traj.solver in ADAPTIVE_SOLVERS
    limit = ADAPTIVE_GROWTH_LIMIT if adaptive else GROWTH_LIMIT
    # Scores made non-finite by a non-finite recorded point (a NaN replay error) are the
    # record's fault, which the replay warning below names; not a sign of instability.
    broken_record = result.replay_error is not None and np.isnan(result.replay_error)
    if growth > limit or (not np.isfinite(np.asarray(result)).all()
                          and not broken_record):
        amp = np.nan_to_num(result.amplification, nan=0.0, posinf=np.inf)
        worst = np.argsort(-amp, kind="stable")[:5]
        steps = ", ".join(f"{int(t)} (x{amp[t]:.2f})" for t in sorted(worst) if amp[t] > 1)
        lr = float(np.max(traj.learning_rates)) if len(traj.learning_rates) else float("nan")
        # Adam's step is about the learning rate whatever the gradient's scale, so a
        # smaller one alone may need more epochs; SGD with momentum kept the growth of
        # the default network under 3 (benchmarks/results/unstable_growth.md).
        # Worded for the estimators and for an own loop recorded by PathRecorder alike.
        remedy = (f"a smaller learning rate (the largest was {lr:g}: an estimator's "
                  "learning_rate_init, with more max_iter if the fit needs them), or SGD "
                  "with momentum,"
                  if adaptive else f"a smaller learning rate (the largest was {lr:g})")
        # Non-finite scores warn whatever the finite growth reads (an overflowed adjoint
        # is growth past any limit): the message must not cite a limit it is under.
        how = (f"by up to {growth:.3g}x (AttributionScores.growth, above {limit:g} on "
               f"{traj.solver}'s paths)" if growth > limit else
               "past floating-point range: some scores are not finite (the finite "
               f"AttributionScores.growth reads up to {growth:.3g}x)")
        warnings.warn(
            f"{what}: the recorded path amplifies perturbations of "
            f"the parameters {how}: training ran at or past the edge of "
            "stability, where removing training points changes the trained network "
            "non-linearly, so these exact derivatives may not predict retraining even for "
            f"single removals. The steps that amplify most: {steps or 'none alone'}. "
            "metrics.retrain_on_subsets(protocol='replay') measures how far they do. "
            f"Train with {remedy} for scores that predict retraining.",
            UnstablePathWarning, stacklevel=caller_stacklevel(),
        )
    # NaN: a replay through a non-finite recorded point, which matches nothing.
    if result.replay_error is not None and not result.replay_error <= replay_limit(traj):
        thinned = (f" (recorded every {traj.record_every} steps, so also replaying the "
                   "unrecorded steps between recorded points)" if traj.record_every > 1
                   else "")
        if traj.compression is not None:
            cause = (f"the path is stored with trajectory_compression="
                     f"{traj.compression!r}, whose points are rounded steps of the "
                     "training, so the scores differentiate the rounded path, with an "
                     "error this mismatch does not bound (measured from 1/400 to 27 "
                     "times it). Store the path without compression for exact scores.")
        else:
            cause = ("the training step depended on something the record does not hold "
                     "(gradient clipping, a loss, inputs or targets other than the "
                     "declared ones, a step size that changed inside an interval of a "
                     "path saved before every step's was kept, "
                     "randomness), so the scores differentiate another training than the "
                     "one that happened. Declare the loss and data the optimizer saw, and "
                     "record every step.")
        warnings.warn(
            f"{what}: the training steps as the scores model them "
            f"miss the recorded path by {result.replay_error:.2g} relative "
            f"(AttributionScores.replay_error){thinned}: {cause}",
            UserWarning, stacklevel=caller_stacklevel(),
        )


def _warn_sensitivity(result: AttributionScores, traj: Trajectory,
                      fallback: str | None, what: str) -> None:
    """Warn of scores that float32 gradients move by more than SENSITIVITY_LIMIT (NaN:
    a broken record, which the replay warning names), or that could not take their
    gradients in float64 (``fallback``: why)."""
    spec, dtype = traj.solver_spec, str(traj.dtype).removeprefix("torch.")
    cure = (f"the second moment's adjoint, divided by sqrt(v), amplifies the rounding of "
            f"gradients that cancel over the batch where v is small against "
            f"epsilon={spec.epsilon:g}; a larger epsilon (1e-4 left 1e-6 on the paths "
            "measured)")
    if fallback is not None:
        warnings.warn(
            f"{what}: the module does not run in float64 "
            f"({fallback}), so each step's gradient is taken in {dtype}, as the training "
            f"took it, and the scores' sensitivity to its rounding is not measured: on "
            f"{spec.name} paths it moved scores by up to a few % of the largest, where "
            f"{cure} keeps them to round-off.",
            PrecisionWarning, stacklevel=caller_stacklevel(),
        )
        return
    sensitivity = result.gradient_sensitivity
    if sensitivity is None or not sensitivity > SENSITIVITY_LIMIT:
        return
    warnings.warn(
        f"{what}: these scores of a {dtype} {spec.name} path "
        f"move by {sensitivity:.2g} of their size when each step's gradient is rounded "
        f"to {dtype} (AttributionScores.gradient_sensitivity, an estimate; the scores "
        "take it in float64 at the recorded points), and a training's own rounding can "
        "move them as much (a float64 retraining from the same start did, on the paths "
        f"measured): they may mean no more than that. The cause: {cure} or "
        "dtype='float64' give scores that mean every digit.",
        PrecisionWarning, stacklevel=caller_stacklevel(),
    )


def replay_limit(traj: Trajectory) -> float:
    """The ``replay_error`` above which the scores warn: the dtype's (1e-3 in float32,
    1e-9 in float64), and 0 for a compressed path, whose rounded points the scores can
    only differentiate approximately, by an error the mismatch does not bound."""
    if traj.compression is not None:
        return 0.0
    return REPLAY_LIMIT_FLOAT64 if traj.dtype == torch.float64 else REPLAY_LIMIT
