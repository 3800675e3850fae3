"""The numpydoc of the read-only verbs, written once.

:class:`~skpathkernel.TrainedNetwork`, the estimators and
:class:`~skpathkernel.RecordedNetwork` document ``decompose``, ``attribute`` and
``self_influence`` with the same text: each fills in how it takes ``X`` and ``y``, what
it adds, and its examples. The text is set as the method's ``__doc__`` when the class is
defined, so that ``help``, numpydoc and sphinx render it as written there.
"""

from __future__ import annotations

from string import Template

__all__ = ["ATTRIBUTE", "DECOMPOSE", "SELF_INFLUENCE", "shared_doc"]


def shared_doc(template: str, **fields: str):
    """Decorator: the method's docstring is ``template`` with ``${name}`` filled in.

    Every field the template names must be given (an empty string leaves nothing), so
    that a template and its users cannot drift apart silently.
    """
    text = Template(template).substitute(**fields)

    def decorate(method):
        method.__doc__ = text
        return method

    return decorate


DECOMPOSE = """Decompose every prediction over the training points.

``f(x; theta_T) = f(x; theta_0) + sum_i a_i(x) + a_reg(x)``, where ``a_i(x)`` is
how much training point ``i`` moved the prediction at ``x`` along the recorded path
and ``a_reg(x)`` is what no training point owns (weight decay).${note}

Parameters
----------
X : ${X}
method : {"exact", "first_order", "second_order"}, default="exact"
    "exact" integrates each step's Jacobian over the segment by Gauss-Legendre
    quadrature, with nodes added per step until its measured error is under
    ``tol``, and reproduces the network to floating-point precision for every
    solver. "first_order" is Domingos' formula with the optimizer's weighting
    (error O(lr)); "second_order" adds the curvature term by Hessian-vector
    products (error O(lr^2)). Both report their true ``error``.
weighting : {"realized", "expected"}, default="realized"
    "realized" credits each step to the samples of its batch, with their weights
    in its loss (1/B, or ``s_i / sum_B s`` with ``sample_weight``);
    "expected" credits each step to every sample it could have drawn, by its
    probability of being in the batch times its weight (1/N, or ``s_i / sum s``
    with ``sample_weight``): the expected representation of Guo, He & Morel
    (2026). The samples a step could draw are those of the ``fit`` or
    ``partial_fit`` call that took it (after a ``warm_start`` fit or
    ``partial_fit`` on new data, not the points received later); on a
    :class:`PathRecorder` path, all N, each 1/N (it ignores the loop's batch
    weights: a ``UserWarning`` says so). Equal to "realized" for full-batch
    training, approximate (with its measured ``error``) for minibatches.
n_nodes : int, default=None
    A fixed number of Gauss-Legendre nodes for every step of "exact", without
    error control; a ``ConvergenceWarning`` says when the steps' measured
    quadrature errors add up to more than 1e-10 of the largest ``|f|`` in float64
    (1e-4 in float32), the allowance of the exact decomposition's closure check. None
    (default) chooses them per step for ``tol``; passing both is an error.
    A fixed count is not limited by ``memory_budget`` (the chosen counts are): each
    step holds ``n_nodes`` captures of a block of queries, which a large count can
    take past the budget. Ignored by the other methods (as SVC's ``degree`` by its
    other kernels).
tol : float, default=None
    Relative tolerance of "exact": each step's quadrature error, measured as
    ``|J_bar_t(x) dtheta_t - (f(x; theta_{t+1}) - f(x; theta_t))|`` over the
    queries and outputs, is held under its share of ``tol * S`` (``S`` the
    largest ``|f|`` along the path; shares proportional to the steps' changes
    of f), so that the quadrature errors add up to at most ``tol * S``. None:
    1e-12 in float64, 1e-6 in float32 (near each dtype's round-off floor: ``error``
    is at most ``tol * S``, often at the floor). A step that cannot meet it within 64
    nodes (a relu network, very large steps), or whose residual is not finite
    (the network overflowed or is undefined on the step), raises a
    ``ConvergenceWarning`` naming the step; so does a ``tol`` below the round-off
    floor of the path's dtype that the steps' summed residuals then miss.
    ``error`` is always the achieved one. Each contribution's error,
    ``contribution_error``, is checked against ``tol * S`` too; in float32, where it
    counts the float32 products' round-off, against ``1e-5 * S`` with None (their
    round-off floor; the nodes are still chosen for 1e-6), and an explicit ``tol``
    under that round-off gets a ``PrecisionWarning`` naming ``dtype="float64"``.
    Ignored by the other methods.
n_jobs : int, default=None
    Query blocks on joblib workers (Dask under
    ``joblib.parallel_config(backend="dask")``; an on-disk trajectory travels as a
    reference to its directory, one in memory, to loky workers, as a temporary
    directory of mapped files written once). An adaptive exact call chooses its nodes
    per chunk of queries (a power of two near a quarter of them, at most 32; on plain
    SGD paths near half of them, at most 128, so there at most two blocks up to 256
    queries) and cuts the blocks at chunk boundaries, so the result agrees with the
    serial one to 1e-12 relative in float32 as in float64 (the warnings judge the
    joined result); the other methods' blocks are balanced by rows and agree with it to
    the dtype's rounding. Plain SGD paths with few queries next to their batches give
    each worker a range of steps for every query instead; a range first replays the
    node choice of the steps the serial call walks before it (where ``tol`` exceeds
    1e-12), so it agrees with the serial result to 1e-12 relative in float32 as in
    float64.
    ``None`` means 1 unless in a ``joblib.parallel_config`` context.${extra_params}

Returns
-------
result : Decomposition
    ``initial`` (n, C), ``contributions`` (n, n_train, C), ``regularization``
    (n, C), ``prediction`` (n, C) and ``error`` (float), C the network outputs
    (logits for multi-class classifiers, the margin for binary ones); for
    "exact", ``n_nodes`` and ``step_errors`` per step, ``tol``, and
    ``contribution_error`` (a single contribution's error: its quadrature error,
    measured by the rule with a node more per step, plus in float32 an estimate of
    its round-off) and ``contribution_tol`` (what that is checked against, relative
    to ``S``, and warned of over); on a thinned path,
    ``replay_error`` (None elsewhere). The training axis of ``contributions`` is the
    rows of ``X_fit_`` (an estimator's ``train_indices_`` maps them to the ``X`` given
    to ``fit``).${raises}

Notes
-----
Cost: per recorded step, the layers' factors of the queries at each node and of
the step's batch; plain SGD then needs a Gram of factors (as a tangent kernel),
momentum / Adam / RMSprop one (n C) x P x B product with an adjoint buffer of
n C P values that carries the optimizer's memory backwards over the steps, so
memory does not grow with the number of steps; blocks under ``memory_budget``.
Exact on a thinned path too (``record_every`` k > 1): the steps between two recorded
points are replayed from the record (batches, step sizes, clip factors, weight
decay; the first moments from a checkpointed replay from the initialization) and
each optimizer step is split as on a path recorded at every step (``n_nodes`` and
``step_errors`` per optimizer step); ``replay_error`` is the replay's mismatch with
the recorded points, and the result warns where it is above round-off. Where the
steps cannot be replayed (a step with an empty batch, a layer drawing at random in
training mode) they take their batches' gradients at the interval's first point:
``error`` is the reconstruction error this leaves, and the result warns, saying
why and stating it relative to the largest change of the output since
initialization (it bounds the contributions' sum, not each contribution).${examples}
"""

ATTRIBUTE = """Training-data attribution scores: how much each training point moved each output.

A score matrix of the shape the attribution literature uses (TRAK, TracIn,
influence functions): ``scores[q, i]`` is training point ``i``'s share of the
scalar output ``m`` at query ``q``, read from :meth:`decompose`:
``scores[q, i] = w_q . a_i(x_q)`` with ``w_q`` the weights of the explained output.
Positive: the point pushed the output up. That share describes the training
that happened; it is not what removing the point would change, which
``method="unrolled"`` (below) predicts to first order. The linear datamodeling
score (:func:`skpathkernel.metrics.linear_datamodeling_score`) measures how well
any of the scores, summed over a subset of the training set, rank the outputs of
the network retrained on it.${note}

Two questions, two kinds of score:

- ``method="unrolled"``: the counterfactual. ``scores[q, i]`` is the derivative
  ``d m(x_q; theta_T) / d w_i`` at ``w = 1`` of the trained output with respect
  to the weight ``w_i`` of point ``i`` in the loss of every step whose batch
  holds it (each step's loss the weighted mean over its batch, times the sum of
  the batch's recorded weights: 1 but for a recorded loop's own loss
  coefficients, ``PathRecorder.set_batch(indices, weights)``; for an estimator
  fitted with ``sample_weight`` ``s``, ``w_i`` scales ``s_i``, so the score is
  ``s_i * d m / d s_i``, 0 for a point of weight 0), taken exactly
  through every recorded step of the training that happened (unrolled
  differentiation: the optimizer's whole state, Hessian-vector products of
  every step). Summed over a subset, it predicts to first order the output of
  the network retrained on that subset along the same path
  (:func:`~skpathkernel.metrics.retrain_on_subsets` with ``protocol="replay"``).
  A regressor's targets standardized by ``normalize_y=True`` are standardized
  anew by such a refit (and by the replay): the scores include how the weighted
  mean and scale move with ``w_i`` and how the trained output moves with the
  targets they shift, so that they are the derivative of refits with
  ``sample_weight`` (against finite differences of such refits, 5.9e-11 on a
  12-point regression where the largest score was 0.43; holding the mean and
  scale at the fit's values missed them by 0.032).
  The result is an :class:`~skpathkernel.AttributionScores` whose ``growth``
  measures how far the path amplifies perturbations; when that is large
  (training at or past the edge of stability) an
  :class:`~skpathkernel.UnstablePathWarning` says that no first-order score
  predicts retraining there. Cost per step: one forward-backward of the batch
  and about one Hessian-vector product per query; memory does not grow with
  the number of steps.

The other methods describe the realized path, from the decomposition:

- ``method="exact", weighting="realized"`` (default): the exact split of the
  realized path. ``initial + scores.sum(1) + regularization`` is the output
  of the trained network up to the quadrature error that :meth:`decompose`
  reports as ``error`` (floating-point level for small steps; large Adam steps
  need more ``n_nodes``).
- ``weighting="expected"``: every point credited at every step of its fit
  call with weight ``1/N`` over that call's N points (``s_i / sum s`` with
  ``sample_weight``): Guo, He & Morel's expected representation; the same as
  realized for full-batch training.
- ``method="first_order", weighting="expected"``: the path-kernel form, Domingos'
  kernel machine ``sum_t lr_t / N K_t(x, x_i) (-dl/df)``: TracIn over every
  step, with the optimizer's preconditioner. With momentum or Adam the gradient
  of step ``s`` enters every later update ``t``, each read with its own step's
  Jacobian, ``sum_{t>=s} c_t m^(t-s) J_t(x) D_t J_s(x_i)^T``: the path kernel's
  ``w_s K_s(x, x_i)`` only on a network linear in its parameters.

Parameters
----------
X : ${X}
y : ${y}
method : {"exact", "first_order", "second_order", "unrolled"}, default="exact"
    "unrolled": the counterfactual derivative (above); the others: see
    :meth:`decompose`.
weighting : {"realized", "expected"}, default="realized"
    See :meth:`decompose`; "unrolled" takes the realized batches.
output : "margin", int or array-like of float, default=None
    The scalar output explained. "margin" is TRAK's
    ``log(p_y / (1 - p_y)) = f_y - logsumexp_{k != y} f_k``: exact for binary
    classifiers (the margin is the network's output up to its sign); for several
    classes the exact split of its linear part at the final logits,
    ``f_y - sum_{k != y} q_k f_k`` with ``q`` the softmax over the other classes,
    which is how much each point moved the margin to first order in the logits.
    A multilabel classifier's margin is the sum of its labels' binary margins,
    ``sum_k s_k f_k`` with ``s_k = +1`` for a label that is on, ``-1`` for one that
    is off: linear in the logits, so its split is exact.
    An int ``k`` explains output column ``k`` (logit ``k``). Weights ``w`` of
    shape (n_outputs,) (every query) or (n_queries, n_outputs) (one row per query)
    explain the weighted sum of the outputs ``sum_c w_c f_c(x)`` (a difference of
    two logits, a weighted combination of classes, a generated sample's values)
    without wrapping the module: its scores are that sum of the per-output scores,
    and a one-hot ``w`` is the int output. A regressor's outputs are in the units
    of ``y``, as an int output's (each times its ``normalize_y`` scale): ``w``
    weighs the predictions. A list or array is always weights, never output
    indices: ``output=[0, 1]`` on two outputs is output 1, and on one output (a
    binary classifier's single logit, ``n_outputs_ = 1``) ``[1]`` is that output and
    ``[0]``, all zero, is refused. Weights of another shape, all zero, complex, NaN or
    infinite ones, are refused with a ``ValueError``. ${output_default}
n_nodes : int, default=None
    Quadrature nodes per step for "exact", see :meth:`decompose`; ignored by the
    other methods.
tol : float, default=None
    Relative quadrature tolerance of "exact", see :meth:`decompose`; ignored by the
    other methods.
n_jobs : int, default=None
    Query blocks (each within ``memory_budget``) on joblib workers; the same scores
    as serial ("unrolled"), or to ``tol`` ("exact", whose blocks choose their
    quadrature nodes on their own). ``None`` means 1 unless in a
    ``joblib.parallel_config`` context.

Returns
-------
scores : ndarray of shape (n_queries, n_train)
    Float64 (an :class:`~skpathkernel.AttributionScores` for "unrolled"); column ``i``
    is row ``i`` of ``X_fit_`` (an estimator's ``train_indices_`` maps it to the ``X``
    given to ``fit``).

See Also
--------
skpathkernel.metrics.linear_datamodeling_score : Scores against retraining.
skpathkernel.metrics.retrain_on_subsets : The retrained models it needs.
self_influence : Each training point's unrolled score for its own output.${examples}
"""

SELF_INFLUENCE = """Each training point's counterfactual score for its own output.

``d m(x_i; theta_T) / d w_i`` for every training point ``i``: the diagonal of
``attribute(X_train, y_train, method="unrolled")``, how much down-weighting the
point in training would move its own output (${label}). Points the rest of the
data does not explain, mislabeled ones among them, tend to score high. As a ranking
of suspected mislabels it was measured no better than scores that take a small
fraction of its time (the training loss summed over the recorded path, cross-validated
probabilities of the given label), and worse where the network memorised the flipped
labels: see the user guide's "Self-influence" section before cleaning data with it.

Parameters
----------
output : "margin", int or array-like of float, default=None
    As in :meth:`attribute`; the queries are the training points, so output
    weights are of shape (n_outputs,) or (n_train, n_outputs), one row per row of
    ``X_fit_``.
n_jobs : int, default=None
    Query blocks on joblib workers.

Returns
-------
self_influence : AttributionScores of shape (n_train,)
    Float64, one per row of ``X_fit_`` (an estimator's ``train_indices_`` maps them to
    the ``X`` given to ``fit``); ``growth`` as in :meth:`attribute`.${examples}
"""
