"""PathKernelMachine and PathKernelClassifier: a trained network and its kernel machine."""

from __future__ import annotations

import numpy as np
import torch
from scipy.special import expit, softmax
from sklearn.base import ClassifierMixin, RegressorMixin, TransformerMixin
from sklearn.preprocessing import LabelEncoder
from sklearn.utils._param_validation import StrOptions
from sklearn.utils.metaestimators import available_if
from sklearn.utils.multiclass import check_classification_targets, type_of_target
from sklearn.utils.validation import check_is_fitted

from ._attribution import label_codes
from ._base import (
    BasePathKernelNetwork,
    declare_feature_dtype,
    in_target_units,
    keep_previous_fit_on_error,
    tangent_feature_names,
)
from ._device import to_tensor
from ._network import check_decompose_args, network_of
from ._params import network_params_doc

__all__ = ["PathKernelClassifier", "PathKernelMachine"]

_SHARED_PARAMS_DOC = network_params_doc()

_NORMALIZE_Y_DOC = """
    normalize_y : bool, default=True
        For regression targets: train the network on ``(y - mean) / scale`` (mean and
        standard deviation of the samples trained on, per output; a constant target is
        only centered), so that one step size suits targets of any scale. Predictions are
        ``mean + scale * f(x)`` and :meth:`decompose`'s terms are mapped back to the units
        of ``y`` exactly; ``loss_curve_``, the kernels and the tangent features are those
        of the network ``f`` itself. ``False`` trains on ``y`` as given (MLPRegressor's
        behaviour). Ignored for class labels."""

_FITTED_ATTRS_DOC = """
    network_ : TrainedNetwork
        The trained network and its recorded path (module, trajectory, loss, dtype,
        device, training inputs and targets), which the kernels, the decomposition and
        the displays read; ``module_``, ``trajectory_``, ``device_``, ``n_params_`` and
        ``X_fit_`` are its attributes.
    module_ : torch.nn.Module
        The trained network (on ``device_``).
    trajectory_ : Trajectory
        The recorded optimisation path. It ends at the last step taken, or with
        ``early_stopping`` at the best-scoring epoch: the network ``module_`` is.
    loss_curve_ : list of float
        Mean training loss of each epoch run.
    best_loss_ : float or None
        The lowest of ``loss_curve_``; None with ``early_stopping``.
    validation_scores_ : list of float or None
        With ``early_stopping``, the score of the network on the held-out samples after
        each epoch (accuracy for classifiers, R^2 otherwise); None without.
    best_validation_score_ : float or None
        The best of ``validation_scores_``, the model kept; None without early stopping.
    n_iter_ : int
        Epochs run.
    t_ : int
        Optimizer steps taken (``trajectory_.n_steps`` is fewer when early stopping
        kept an earlier epoch).
    n_params_ : int
        Number of trainable parameters P.
    n_outputs_ : int
        Network outputs C.
    device_ : str
        Device the network lives on.
    X_fit_ : ndarray of shape (n_samples_trained, n_features) or (n_samples_trained, ...)
        The samples trained on, in the order of X (all of X unless ``early_stopping``
        held some out), as the network takes them (floats, or int64 token ids): the
        kernel machine's representation is over them.
    n_features_in_ : int
        Number of features seen during fit: for ``(n_samples, ...)`` inputs, the number
        of values per sample, ``prod(input_shape_)``.
    input_shape_ : tuple of int
        Trailing shape of ``X`` at fit (``(n_features,)`` for 2-D ``X``); every method
        that takes ``X`` expects this shape.
    feature_names_in_ : ndarray of shape (`n_features_in_`,)
        Names of features seen during fit, when X has string column names.
"""


class _KernelMachineMixin(TransformerMixin):
    """transform / decompose / explain: the trained network as a kernel machine."""

    def __sklearn_tags__(self):
        return declare_feature_dtype(super().__sklearn_tags__(), self)

    def get_feature_names_out(self, input_features=None):
        """Names of the tangent features: ``"<parameter>[<index>]"``, e.g. ``"0.weight[3]"``.

        With several outputs, ``"out<c>:<parameter>[<index>]"``.
        """
        check_is_fitted(self)
        return tangent_feature_names(self.trajectory_, self.n_outputs_)

    def decompose(self, X, *, method="exact", weighting="realized", n_nodes=None, tol=None):
        """Decompose every prediction over the training points.

        ``f(x; theta_T) = f(x; theta_0) + sum_i a_i(x) + a_reg(x)``, where ``a_i(x)`` is
        how much training point ``i`` moved the prediction at ``x`` along the recorded path
        and ``a_reg(x)`` is what no training point owns (weight decay).

        Parameters
        ----------
        X : array-like of shape (n_queries, n_features) or (n_queries, ...)
            In the form of the training inputs (``input_shape_``).
        method : {"exact", "first_order", "second_order"}, default="exact"
            "exact" integrates each step's Jacobian over the segment by Gauss-Legendre
            quadrature, with nodes added per step until its measured error is under
            ``tol``, and reproduces the network to floating-point precision for every
            solver. "first_order" is Domingos' formula with the optimizer's weighting
            (error O(lr)); "second_order" adds the curvature term by Hessian-vector
            products (error O(lr^2)). Both report their true ``error``.
        weighting : {"realized", "expected"}, default="realized"
            "realized" credits each step to the samples of its batch (weight 1/B);
            "expected" credits every sample at every step (weight 1/N), the expected
            representation of Guo, He & Morel (2026): equal for full-batch training,
            approximate (with its measured ``error``) for minibatches.
        n_nodes : int, default=None
            A fixed number of Gauss-Legendre nodes for every step of "exact", without
            error control. None (default) chooses them per step for ``tol``.
        tol : float, default=None
            Relative tolerance of "exact": each step's quadrature error, measured as
            ``|J_bar_t(x) dtheta_t - (f(x; theta_{t+1}) - f(x; theta_t))|`` over the
            queries and outputs, is held under its share of ``tol * S`` (``S`` the
            largest ``|f|`` along the path; shares proportional to the steps' changes
            of f), so that the quadrature errors add up to at most ``tol * S``. None:
            1e-12 in float64, 1e-6 in float32 (below each dtype's round-off floor, so
            that ``error`` sits at that floor). A step that cannot meet it within 64
            nodes (a relu network, very large steps) raises a ``ConvergenceWarning``
            naming the step; ``error`` is always the achieved one. Ignored by the other
            methods.

        Returns
        -------
        result : Decomposition
            ``initial`` (n, C), ``contributions`` (n, n_train, C), ``regularization``
            (n, C), ``prediction`` (n, C) and ``error`` (float), C the network outputs
            (logits for multi-class classifiers, the margin for binary ones); for
            "exact", ``n_nodes`` and ``step_errors`` per step, and ``tol``.

        Notes
        -----
        Cost: per recorded step, the layers' factors of the queries at each node and of
        the step's batch; plain SGD then needs a Gram of factors (as a tangent kernel),
        momentum / Adam / RMSprop one (n C) x P x B product with an adjoint buffer of
        n C P values that carries the optimizer's memory backwards over the steps, so
        memory does not grow with the number of steps; blocks under ``memory_budget``.
        Exact with ``record_every=1``; on a thinned path (k > 1) the steps between two
        recorded points take their batches' gradients at the first of them, and the
        result warns and reports the reconstruction error this leaves.

        Examples
        --------
        >>> import numpy as np
        >>> from skpathkernel import PathKernelMachine
        >>> X = np.linspace(-1, 1, 12).reshape(-1, 1); y = X.ravel() ** 2
        >>> est = PathKernelMachine(hidden_layer_sizes=(8,), solver="adam", max_iter=20,
        ...                         dtype="float64", random_state=0).fit(X, y)
        >>> res = est.decompose(X[:3])
        >>> res.contributions.shape
        (3, 12, 1)
        >>> bool(res.error < 1e-10)
        True
        """
        check_decompose_args(method, weighting, n_nodes, tol)
        X = self._validate_X(X)
        # Every step needs the queries' Jacobians: one query's must fit the budget.
        self._check_feature_row_fits("decompose")
        mean, scale = getattr(self, "_y_mean", None), getattr(self, "_y_scale", None)
        # The network's loss is the one it was trained with: set_params(loss=...) after
        # fit must not change what the fitted path is decomposed with.
        return network_of(self).decompose(
            X, method=method, weighting=weighting, n_nodes=n_nodes, tol=tol,
            units=lambda res: in_target_units(res, mean, scale))

    def transform(self, X):
        """Tangent features phi(x) = d f(x; theta_T) / d theta at the final parameters.

        Returns
        -------
        phi : ndarray of shape (n_samples, `n_params_`) or (n_samples, `n_outputs_` * `n_params_`)
            One row per sample, columns in ``trajectory_`` flat order, in the network's
            dtype. For several outputs, the flattened Jacobian divided by
            ``sqrt(n_outputs_)``, whose inner products are the trace kernel.
        """
        return self._tangent_features(X)

    def attribute(self, X, y=None, *, method="exact", weighting="realized", output=None,
                  n_nodes=None, tol=None, n_jobs=None):
        """Training-data attribution scores: how much each training point moved each output.

        A score matrix of the shape the attribution literature uses (TRAK, TracIn,
        influence functions): ``scores[q, i]`` is training point ``i``'s share of the
        scalar output ``m`` at query ``q``, read from :meth:`decompose`:
        ``scores[q, i] = w_q . a_i(x_q)`` with ``w_q`` the weights of the explained output.
        Positive: the point pushed the output up. Summed over a subset of the training
        set, the scores predict the output of the network retrained on it; the linear
        datamodeling score (:func:`skpathkernel.metrics.linear_datamodeling_score`)
        measures how well.

        Two questions, two kinds of score:

        - ``method="unrolled"``: the counterfactual. ``scores[q, i]`` is the derivative
          ``d m(x_q; theta_T) / d w_i`` at ``w = 1`` of the trained output with respect
          to the weight ``w_i`` of point ``i`` in the loss of every step whose batch
          holds it (each step's loss the weighted mean over its batch), taken exactly
          through every recorded step of the training that happened (unrolled
          differentiation: the optimizer's whole state, Hessian-vector products of
          every step). Summed over a subset, it predicts to first order the output of
          the network retrained on that subset along the same path
          (:func:`~skpathkernel.metrics.retrain_on_subsets` with ``protocol="replay"``).
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
        - ``weighting="expected"``: every point credited at every step with weight
          ``1/N`` (Guo, He & Morel's expected representation); the same as realized for
          full-batch training.
        - ``method="first_order", weighting="expected"``: the path-kernel form, Domingos'
          kernel machine ``sum_t lr_t / N K_t(x, x_i) (-dl/df)``: TracIn over every
          step, with the optimizer's preconditioner.

        Parameters
        ----------
        X : array-like of shape (n_queries, n_features)
        y : array-like of shape (n_queries,), default=None
            Classifiers: the queries' labels, whose margin is explained; None explains
            the margin of the predicted class. Regressors: ignored.
        method : {"exact", "first_order", "second_order", "unrolled"}, default="exact"
            "unrolled": the counterfactual derivative (above); the others: see
            :meth:`decompose`.
        weighting : {"realized", "expected"}, default="realized"
            See :meth:`decompose`; "unrolled" takes the realized batches.
        output : "margin" or int, default=None
            The scalar output explained. "margin" (the classifiers' default) is TRAK's
            ``log(p_y / (1 - p_y)) = f_y - logsumexp_{k != y} f_k``: exact for binary
            classifiers (the margin is the network's output up to its sign); for several
            classes the exact split of its linear part at the final logits,
            ``f_y - sum_{k != y} q_k f_k`` with ``q`` the softmax over the other classes,
            which is how much each point moved the margin to first order in the logits.
            An int ``k`` explains output column ``k`` (logit ``k``; the regressors'
            default is 0, required for several outputs).
        n_nodes : int, default=None
            Quadrature nodes per step for "exact", see :meth:`decompose`.
        tol : float, default=None
            Relative quadrature tolerance of "exact", see :meth:`decompose`.
        n_jobs : int, default=None
            ``method="unrolled"``: query blocks (each within ``memory_budget``) on joblib
            workers; the same scores as serial. ``None`` means 1 unless in a
            ``joblib.parallel_config`` context.

        Returns
        -------
        scores : ndarray of shape (n_queries, n_train)
            Float64 (an :class:`~skpathkernel.AttributionScores` for "unrolled").

        See Also
        --------
        skpathkernel.metrics.linear_datamodeling_score : Scores against retraining.
        skpathkernel.metrics.retrain_on_subsets : The retrained models it needs.
        self_influence : Each training point's unrolled score for its own output.

        Examples
        --------
        >>> from sklearn.datasets import make_classification
        >>> from skpathkernel import PathKernelClassifier
        >>> X, y = make_classification(n_samples=40, n_features=4, random_state=0)
        >>> clf = PathKernelClassifier(hidden_layer_sizes=(8,), solver="sgd",
        ...                            learning_rate_init=0.5, max_iter=30, tol=None,
        ...                            dtype="float64", random_state=0)
        >>> scores = clf.fit(X, y).attribute(X[:3], y[:3])
        >>> scores.shape
        (3, 40)
        >>> margin = clf.decision_function(X[:3]) * (2 * y[:3] - 1)
        >>> res = clf.decompose(X[:3])
        >>> initial = res.initial[:, 0] * (2 * y[:3] - 1)
        >>> bool(abs(initial + scores.sum(1) - margin).max() < 1e-10)
        True

        The counterfactual derivative, on a path that does not amplify perturbations:

        >>> cf = clf.attribute(X[:3], y[:3], method="unrolled")
        >>> cf.shape, bool(cf.growth.max() < 100)
        ((3, 40), True)
        """
        check_is_fitted(self)
        classifier = isinstance(self, ClassifierMixin)
        X = self._validate_X(X)
        if method != "unrolled":
            # Every step needs the queries' Jacobians: one query's must fit the budget.
            self._check_feature_row_fits("decompose")
        return network_of(self)._attribute(
            X, y, method=method, weighting=weighting, output=output, n_nodes=n_nodes,
            tol=tol, n_jobs=n_jobs, margin="default" if classifier else "no",
            encode=lambda y: label_codes(self.classes_, y) if classifier else None,
            scale=getattr(self, "_y_scale", None))

    def self_influence(self, *, output=None, n_jobs=None):
        """Each training point's counterfactual score for its own output.

        ``d m(x_i; theta_T) / d w_i`` for every training point ``i``: the diagonal of
        ``attribute(X_fit_, y_train, method="unrolled")``, how much down-weighting the
        point in training would move its own output (classifiers: the margin of its own
        training label). Points the network fits only by memorising them, mislabeled
        ones first, have the largest self-influence: inspect them first when cleaning
        data.

        Parameters
        ----------
        output : "margin" or int, default=None
            As in :meth:`attribute`.
        n_jobs : int, default=None
            Query blocks on joblib workers.

        Returns
        -------
        self_influence : AttributionScores of shape (n_train,)
            Float64, in the order of ``X_fit_``; ``growth`` as in :meth:`attribute`.

        Examples
        --------
        >>> import numpy as np
        >>> from sklearn.datasets import make_classification
        >>> from skpathkernel import PathKernelClassifier
        >>> X, y = make_classification(n_samples=60, n_features=4, random_state=0)
        >>> y_noisy = y.copy(); y_noisy[:6] = 1 - y_noisy[:6]     # 6 flipped labels
        >>> clf = PathKernelClassifier(hidden_layer_sizes=(16,), solver="sgd",
        ...                            learning_rate_init=0.5, max_iter=100, tol=None,
        ...                            random_state=0).fit(X, y_noisy)
        >>> influence = clf.self_influence()
        >>> influence.shape
        (60,)
        """
        check_is_fitted(self)
        classifier = isinstance(self, ClassifierMixin)
        return network_of(self)._self_influence(
            output=output, n_jobs=n_jobs, margin="default" if classifier else "no",
            scale=getattr(self, "_y_scale", None))

    def explain(self, X, n_neighbors=10, *, method="exact", output=None):
        """The training points that moved each prediction the most.

        Guo, He & Morel's "retrieval from the feature memory" (2026): for each query, the
        training points with the largest contribution ``|a_i(x)|`` in the decomposition
        of the explained output. Classifiers explain the margin of the predicted class by
        default, through :meth:`attribute`'s contracted route (one scalar output per
        query along the path: about the cost of :meth:`attribute`, not of decomposing
        every output); ``output="all"`` ranks by ``|a_i(x)|`` summed over every output,
        from :meth:`decompose`.

        Parameters
        ----------
        X : array-like of shape (n_queries, n_features) or (n_queries, ...)
        n_neighbors : int, default=10
        method : {"exact", "first_order", "second_order"}, default="exact"
        output : "margin", int or "all", default=None
            The output explained. None: the predicted class's margin for classifiers
            (see :meth:`attribute`), the output for single-output regressors, and "all"
            for regressors with several outputs. "margin" and an int are as in
            :meth:`attribute`; "all" explains every output at once.

        Returns
        -------
        indices : ndarray of shape (n_queries, n_neighbors)
            Training-set indices, largest contribution first.
        contributions : ndarray of shape (n_queries, n_neighbors, n_explained)
            Their contributions ``a_i(x)``: one column for a scalar output, ``n_outputs_``
            columns for ``output="all"``.

        Examples
        --------
        >>> import numpy as np
        >>> from skpathkernel import PathKernelMachine
        >>> X = np.linspace(-1, 1, 12).reshape(-1, 1); y = X.ravel() ** 2
        >>> est = PathKernelMachine(hidden_layer_sizes=(8,), max_iter=5, random_state=0)
        >>> idx, contrib = est.fit(X, y).explain(X[:2], n_neighbors=3)
        >>> idx.shape, contrib.shape
        ((2, 3), (2, 3, 1))
        """
        check_is_fitted(self)
        classifier = isinstance(self, ClassifierMixin)
        if output is None and not classifier and self.n_outputs_ > 1:
            output = "all"
        X = self._validate_X(X)
        self._check_feature_row_fits("decompose")
        mean, scale = getattr(self, "_y_mean", None), getattr(self, "_y_scale", None)
        return network_of(self).explain(
            X, n_neighbors, method=method, output=output,
            margin="default" if classifier else "no",
            encode=lambda y: label_codes(self.classes_, y) if classifier else None,
            scale=scale, units=lambda res: in_target_units(res, mean, scale))


def _encode_labels(y, loss: str) -> tuple[np.ndarray, int, dict]:
    """Class labels -> network targets: a margin for two classes, logits for more."""
    encoder = LabelEncoder().fit(y)
    classes = encoder.classes_
    if len(classes) < 2:
        raise ValueError(
            "The number of classes has to be greater than one; got "
            f"{len(classes)} class ({classes[0]!r}). A classifier needs at least two."
        )
    codes = encoder.transform(y)
    n_outputs = 1 if len(classes) == 2 else len(classes)
    if loss == "log_loss":
        Y = codes.astype(np.float64) if n_outputs == 1 else codes.astype(np.int64)
    elif n_outputs == 1:
        Y = (2.0 * codes - 1.0).reshape(-1, 1)
    else:
        Y = np.eye(len(classes))[codes]
    return Y, n_outputs, {"classes_": classes}


def _check_labels(estimator, y):
    check_classification_targets(y)
    kind = type_of_target(y)
    if kind not in ("binary", "multiclass"):
        raise ValueError(
            f"{type(estimator).__name__} supports binary and multi-class targets, got {kind}."
        )


def _label_tensor(Y, dtype, device):
    # Softmax cross-entropy takes class indices, which must stay integers.
    if Y.dtype == np.int64:
        return torch.as_tensor(Y, device=device)
    return to_tensor(Y, dtype=dtype, device=device)


def _doc(cls):
    cls.__doc__ = cls.__doc__.format(shared=_SHARED_PARAMS_DOC, fitted=_FITTED_ATTRS_DOC,
                                     normalize_y=_NORMALIZE_Y_DOC)
    return cls


@_doc
class PathKernelMachine(_KernelMachineMixin, RegressorMixin, BasePathKernelNetwork):
    """Regressor that trains a network and records its optimisation path.

    The trained network is, exactly, a kernel machine over its training set along the
    recorded path: Domingos (2020), "Every Model Learned by Gradient Descent Is
    Approximately a Kernel Machine"; Guo, He & Morel (2026), "On Interpolation Formulas
    Describing Neural Network Generalization". The user guide's "Theory" page states what
    is computed.

    Parameters
    ----------{shared}
    loss : {{"squared_error"}}, default="squared_error"
        ``1/2 * mean squared error`` over samples and outputs (MLPRegressor's
        convention).{normalize_y}

    Attributes
    ----------{fitted}
    See Also
    --------
    PathKernelClassifier : The classifier sibling.

    Examples
    --------
    >>> import numpy as np
    >>> from skpathkernel import PathKernelMachine
    >>> X = np.linspace(-2, 2, 40).reshape(-1, 1)
    >>> y = np.sin(X).ravel()
    >>> est = PathKernelMachine(random_state=0).fit(X, y)
    >>> est.score(X, y) > 0.9
    True
    >>> # Stopped by tol: one point per step taken (40 samples: one step an epoch).
    >>> est.n_iter_ < 200, len(est.trajectory_) == est.n_iter_ + 1
    (True, True)
    """

    _parameter_constraints = {
        **BasePathKernelNetwork._parameter_constraints,
        "loss": [StrOptions({"squared_error"})],
        "normalize_y": ["boolean"],
    }

    def __init__(
        self,
        hidden_layer_sizes=(64, 64),
        *,
        activation="gelu",
        module=None,
        solver="adam",
        learning_rate_init=1e-3,
        momentum=0.0,
        alpha=0.0,
        beta_1=0.9,
        beta_2=0.999,
        epsilon=1e-8,
        batch_size="auto",
        max_iter=200,
        tol=1e-4,
        n_iter_no_change=10,
        early_stopping=False,
        validation_fraction=0.1,
        shuffle=True,
        loss="squared_error",
        record_every="auto",
        device="auto",
        dtype="float32",
        memory_budget=2**30,
        trajectory_storage="memory",
        trajectory_dir=None,
        trajectory_compression=None,
        random_state=None,
        verbose=0,
        normalize_y=True,
    ):
        super().__init__(
            hidden_layer_sizes=hidden_layer_sizes, activation=activation, module=module,
            solver=solver, learning_rate_init=learning_rate_init, momentum=momentum,
            alpha=alpha, beta_1=beta_1, beta_2=beta_2, epsilon=epsilon,
            batch_size=batch_size, max_iter=max_iter, tol=tol,
            n_iter_no_change=n_iter_no_change, early_stopping=early_stopping,
            validation_fraction=validation_fraction, shuffle=shuffle, loss=loss,
            record_every=record_every, device=device, dtype=dtype,
            memory_budget=memory_budget, trajectory_storage=trajectory_storage,
            trajectory_dir=trajectory_dir, trajectory_compression=trajectory_compression,
            random_state=random_state, verbose=verbose,
        )
        self.normalize_y = normalize_y

    def _encode_targets(self, y):
        self_y_2d = y.ndim == 2
        Y = y.reshape(len(y), -1)
        return Y, Y.shape[1], {"_y_2d": self_y_2d}

    @keep_previous_fit_on_error
    def fit(self, X, y):
        """Train the network on (X, y), recording its path.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features) or (n_samples, ...)
            2-D for the default MLP; with ``module``, any ``(n_samples, ...)`` array:
            floats, or integer token ids.
        y : array-like of shape (n_samples,) or (n_samples, n_outputs)

        Returns
        -------
        self : PathKernelMachine
        """
        self._validate_params()
        return self._fit(X, y)

    def predict(self, X):
        """Network outputs f(X; theta_T).

        Returns
        -------
        y_pred : ndarray of shape (n_samples,) or (n_samples, n_outputs)
            Two-dimensional when ``y`` was two-dimensional at fit time.
        """
        out = in_target_units(self._forward(X), self._y_mean, self._y_scale)
        return out if self._y_2d else out[:, 0]

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.target_tags.multi_output = True
        tags.target_tags.single_output = True
        return tags


@_doc
class PathKernelClassifier(_KernelMachineMixin, ClassifierMixin, BasePathKernelNetwork):
    """Classifier that trains a network and records its optimisation path.

    Binary problems use one output (a margin); ``K`` classes use ``K`` logits.

    Parameters
    ----------{shared}
    loss : {{"log_loss", "squared_error"}}, default="log_loss"
        "log_loss": logistic loss on the margin (binary) or softmax cross-entropy
        (multi-class), mean over the batch. "squared_error": ``1/2`` mean squared error on
        +-1 targets (binary) or one-hot targets (multi-class); ``predict_proba`` is then
        unavailable.

    Attributes
    ----------
    classes_ : ndarray of shape (n_classes,)
        Class labels.{fitted}
    See Also
    --------
    PathKernelMachine : The regressor sibling.

    Examples
    --------
    >>> from skpathkernel import PathKernelClassifier
    >>> from skpathkernel.datasets import make_circle
    >>> X, y = make_circle(n_samples=200, random_state=0)
    >>> clf = PathKernelClassifier(hidden_layer_sizes=(32, 32), solver="adam",
    ...                            learning_rate_init=0.01, max_iter=300,
    ...                            random_state=0).fit(X, y)
    >>> clf.score(X, y) > 0.9
    True
    """

    _parameter_constraints = {
        **BasePathKernelNetwork._parameter_constraints,
        "loss": [StrOptions({"log_loss", "squared_error"})],
    }

    def __init__(
        self,
        hidden_layer_sizes=(64, 64),
        *,
        activation="gelu",
        module=None,
        solver="adam",
        learning_rate_init=1e-3,
        momentum=0.0,
        alpha=0.0,
        beta_1=0.9,
        beta_2=0.999,
        epsilon=1e-8,
        batch_size="auto",
        max_iter=200,
        tol=1e-4,
        n_iter_no_change=10,
        early_stopping=False,
        validation_fraction=0.1,
        shuffle=True,
        loss="log_loss",
        record_every="auto",
        device="auto",
        dtype="float32",
        memory_budget=2**30,
        trajectory_storage="memory",
        trajectory_dir=None,
        trajectory_compression=None,
        random_state=None,
        verbose=0,
    ):
        super().__init__(
            hidden_layer_sizes=hidden_layer_sizes, activation=activation, module=module,
            solver=solver, learning_rate_init=learning_rate_init, momentum=momentum,
            alpha=alpha, beta_1=beta_1, beta_2=beta_2, epsilon=epsilon,
            batch_size=batch_size, max_iter=max_iter, tol=tol,
            n_iter_no_change=n_iter_no_change, early_stopping=early_stopping,
            validation_fraction=validation_fraction, shuffle=shuffle, loss=loss,
            record_every=record_every, device=device, dtype=dtype,
            memory_budget=memory_budget, trajectory_storage=trajectory_storage,
            trajectory_dir=trajectory_dir, trajectory_compression=trajectory_compression,
            random_state=random_state, verbose=verbose,
        )

    def _validate_y(self, X, y):
        X, y = self._validate_fit_data(X, y)
        _check_labels(self, y)
        return X, y

    def _encode_targets(self, y):
        return _encode_labels(y, self.loss)

    def _target_tensor(self, Y, dtype, device):
        return _label_tensor(Y, dtype, device)

    @keep_previous_fit_on_error
    def fit(self, X, y):
        """Train the network on (X, y), recording its path.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features) or (n_samples, ...)
            2-D for the default MLP; with ``module``, any ``(n_samples, ...)`` array:
            floats, or integer token ids.
        y : array-like of shape (n_samples,)
            Class labels (binary or multi-class).

        Returns
        -------
        self : PathKernelClassifier
        """
        self._validate_params()
        return self._fit(X, y)

    def decision_function(self, X):
        """Margins (binary, shape (n_samples,)) or logits (shape (n_samples, n_classes))."""
        out = self._forward(X)
        return out[:, 0] if out.shape[1] == 1 else out

    def predict(self, X):
        """Predicted class labels."""
        scores = self.decision_function(X)
        if scores.ndim == 1:
            return self.classes_[(scores > 0).astype(np.intp)]
        return self.classes_[np.argmax(scores, axis=1)]

    def _has_proba(self):
        return self.loss == "log_loss"

    @available_if(_has_proba)
    def predict_proba(self, X):
        """Class probabilities (sigmoid of the margin, or softmax of the logits)."""
        scores = self.decision_function(X).astype(np.float64)
        if scores.ndim == 1:
            p = expit(scores)
            return np.column_stack([1.0 - p, p])
        return softmax(scores, axis=1)

    @available_if(_has_proba)
    def predict_log_proba(self, X):
        """Logarithm of :meth:`predict_proba`."""
        with np.errstate(divide="ignore"):
            return np.log(self.predict_proba(X))
