"""PathKernelMachine and PathKernelClassifier: a trained network and its kernel machine."""

from __future__ import annotations

import numpy as np
import torch
from scipy.special import expit, log_expit, log_softmax, softmax
from sklearn.base import ClassifierMixin, RegressorMixin, TransformerMixin
from sklearn.preprocessing import LabelEncoder
from sklearn.utils._param_validation import StrOptions
from sklearn.utils.metaestimators import available_if
from sklearn.utils.multiclass import check_classification_targets, type_of_target
from sklearn.utils.validation import check_array, check_is_fitted, column_or_1d

from .._analysis._attribution import check_indicator, label_codes
from .._device import to_tensor
from .._network._docs import ATTRIBUTE, DECOMPOSE, SELF_INFLUENCE, shared_doc
from .._network._trained import check_decompose_args, network_of
from .._validation import is_option, validate_params
from ._base import (
    BasePathKernelNetwork,
    declare_feature_dtype,
    dense_indicator,
    in_target_units,
    keep_previous_fit_on_error,
    tangent_feature_names_out,
)

__all__ = ["PathKernelClassifier", "PathKernelMachine"]

_SHARED_PARAMS_DOC = """
    hidden_layer_sizes : array-like of int, default=(64, 64)
        Widths of the hidden layers of the default MLP (ignored when ``module`` is given).
    activation : {"relu", "tanh", "logistic", "gelu", "softplus", "identity"}, \
            default="gelu"
        Activation of the default MLP ("logistic": the sigmoid, as MLPClassifier names
        it). The default is smooth, which keeps the exact decomposition exact: "relu"'s
        kinks cost it about 1e-4 (see the user guide, "Training"), and "tanh" is what
        Guo, He & Morel (2026) used.
    module : callable, default=None
        ``module(n_features_in, n_outputs) -> torch.nn.Module`` replacing the default MLP.
        Any module without cross-sample state works: a BatchNorm in training mode (or
        without running statistics) is refused, naming it (build it in eval mode: it then
        normalises with its running statistics, kept fixed); a dropout layer in training
        mode trains with a warning that the analyses are not exact (its draws are not on
        the path; in eval mode they are exact); a module whose output for a sample
        depends on the samples passed with it (a sequence layer built with torch's
        default ``batch_first=False`` on ``(n, S, d)``) is refused at fit. Warm starts and
        ``partial_fit`` keep each layer's mode. It is
        called with torch's global RNG seeded from ``random_state`` (and restored after).
        With a module, ``X`` may have any shape ``(n_samples, ...)``: float images
        ``(n, C, H, W)`` or sequences ``(n, S, d)`` are handed to it in ``dtype``, integer
        token ids ``(n, S)`` as int64 (``n_features_in`` is then the number of values
        per sample); see the user guide, "Images, sequences and token ids".
    solver : {"sgd", "adam", "adamw", "rmsprop"}, default="adam"
        The torch.optim optimizer whose path is recorded. Adam (MLPClassifier's default)
        learns at one step size whatever the scale of X; SGD keeps each step of the path
        kernel a structured Gram (Adam's preconditioner makes it a dense product:
        ``path_kernel_`` about five times slower per step on the default network, the
        first-order decomposition about 27 times, one thread on an AMD EPYC,
        ``benchmarks/results/verbs_floor.md``)
        and is Domingos' setting (see ``batch_size``).
    learning_rate_init : float, default=0.001
        Step size (MLPClassifier's; plain SGD wants a larger one, e.g. 0.1).
    learning_rate : {"constant", "invscaling", "adaptive"}, default="constant"
        Step-size schedule of ``solver="sgd"`` (MLPClassifier's; the other solvers keep
        ``learning_rate_init``). "constant": ``learning_rate_init`` throughout.
        "invscaling": an epoch that starts after ``t`` samples were seen (``t`` counts
        across ``warm_start`` fits and ``partial_fit`` calls) steps with
        ``learning_rate_init / (t + 1) ** power_t``. "adaptive": the step size is divided
        by 5 whenever more than ``n_iter_no_change`` consecutive epochs fail to improve
        by ``tol`` (the stopping rule), and training stops when it is at most 1e-6
        (``tol=None``, no rule, keeps ``learning_rate_init``, as SGDClassifier). The
        recorded path holds every step's size (``trajectory_.step_learning_rates``), so
        the kernels follow the schedule exactly (with every step recorded: a thinned
        path's interval takes its mean), and the decomposition and the unrolled
        attribution do on any path (they replay a thinned path's steps).
    power_t : float, default=0.5
        Exponent of ``learning_rate="invscaling"`` (sgd only).
    momentum : float, default=0.0
        Momentum of ``solver="sgd"`` (Nesterov's or heavy-ball, see
        ``nesterovs_momentum``), in torch.optim.SGD's convention: the buffer
        ``buf_t = momentum * buf_{t-1} + g_t`` sums raw gradients and the step size
        scales the whole update. scikit-learn's velocity sums gradients already scaled by
        their step size: the same steps at a constant step size, not under
        ``learning_rate="invscaling"`` or ``"adaptive"``. The recorded path is torch's, and
        every analysis models it.
    nesterovs_momentum : bool, default=True
        Whether to use Nesterov's momentum, as in MLPClassifier (``solver="sgd"`` with
        ``momentum > 0`` only; torch.optim.SGD's ``nesterov``): the update is
        ``-lr_t (g_t + momentum * buf_t)``, heavy-ball's ``-lr_t buf_t`` when False.
        The path kernel, :meth:`decompose` and :meth:`attribute` are exact over both.
    alpha : float, default=0.0
        Weight decay: L2 added to the gradient (``grad + alpha * theta``, all parameters)
        for sgd, adam and rmsprop; decoupled weight decay for adamw. Unlike MLPRegressor it
        is not divided by the number of samples and applies to biases too.
    beta_1 : float, default=0.9
        Adam / AdamW decay of the first moment (the running mean of the gradient).
    beta_2 : float, default=0.999
        Adam / AdamW decay of the second moment (RMSprop's smoothing constant is torch's
        default, 0.99).
    epsilon : float, default=1e-8
        The epsilon of Adam's, AdamW's and RMSprop's denominator, where torch.optim
        puts it: added to the bias-corrected ``sqrt(v_t / (1 - beta_2**t))``.
        MLPClassifier's Adam adds it to ``sqrt(v_t)`` itself, so the same value weighs
        ``1 / sqrt(1 - beta_2**t)`` times more there (about 32 times at the first step
        with ``beta_2=0.999``, nearly 1 after a few thousand steps): the two paths
        differ where gradients are near ``epsilon``. MLPClassifier's ``epsilon=e`` at
        step ``t`` is ``e / sqrt(1 - beta_2**t)`` here.
    batch_size : int, "auto" or None, default="auto"
        Samples per optimizer step. "auto" is ``min(200, n_samples)`` (MLPClassifier's);
        ``None`` trains on the whole training set at every step; with ``solver="sgd"``
        (no momentum) that is Domingos' full-batch gradient descent.
    max_iter : int, default=200
        Most epochs (passes over the training set).
    tol : float or None, default=1e-4
        Stopping tolerance, with MLPClassifier's meaning: training stops when for more
        than ``n_iter_no_change`` consecutive epochs the training loss has not gone below
        its best value minus ``tol`` (with ``early_stopping``: the validation score has
        not gone above its best value plus ``tol``). A ``ConvergenceWarning`` says when
        ``max_iter`` epochs end without that. ``None`` (SGDClassifier's convention) trains
        exactly ``max_iter`` epochs, with no warning: a path of fixed length.
    n_iter_no_change : int, default=10
        Epochs without improvement by ``tol`` tolerated before stopping (one more stops).
    early_stopping : bool, default=False
        Hold out ``validation_fraction`` of the training set (stratified for classes, not
        for multilabel targets), score the network on it after every epoch (accuracy,
        subset accuracy for multilabel targets, or R^2) and stop on that
        score; the fitted network is then the one of the best-scoring epoch, as in
        MLPClassifier, and ``trajectory_`` ends at it. The held-out samples are not
        training points: ``X_fit_``, the kernels and :meth:`decompose` cover the others.
    validation_fraction : float in (0, 1), default=0.1
        Fraction of the training set held out by ``early_stopping``; it must leave at
        least two samples, and one of each class (not of each label), on both sides,
        and each class needs two samples (MLPClassifier stratifies binary targets only).
    shuffle : bool, default=True
        Reshuffle the samples every epoch (minibatch training only).
    record_every : int or "auto", default="auto"
        Record the parameters every ``record_every`` optimizer steps (and at the end).
        "auto": every step when the points of ``max_iter`` epochs fit in
        ``memory_budget`` bytes, else every k-th step with the smallest k that fits (see
        the user guide, "Training"). The per-training-point decomposition stays exact
        with k > 1: it replays the steps between recorded points from their recorded
        batches (user guide, "Thinned paths"); the path kernel is then a Riemann sum.
    device : {"auto", "cpu", "cuda"}, default="auto"
        "auto" trains on CUDA when available, else on the CPU.
    dtype : {"float32", "float64"}, default="float32"
        Parameter dtype; float64 is for exactness checks.
    memory_budget : int, default=2**30
        Bytes that one block of a computation (prediction, kernels) may use, and the
        most that one fit's recorded points may take in memory with
        ``record_every="auto"``. A ``warm_start`` fit or ``partial_fit`` call keeps every
        point it records, and warns when the path it continues in memory first grows
        past the budget (streams belong on disk: ``trajectory_storage="disk"``).
    trajectory_storage : {"memory", "disk", "auto"}, default="memory"
        Where ``trajectory_`` keeps its points. "memory": CPU buffers. "disk": chunk
        files in a fresh temporary directory under ``trajectory_dir``, written while
        training and read lazily, a chunk at a time (at most 1/32 of ``memory_budget``
        each), so the kernels and :meth:`decompose` run in memory independent of the
        number of steps; ``record_every="auto"`` then keeps every step that fits in 90%
        of the free disk space. "auto": disk when the points of ``max_iter`` epochs
        (every step, or every ``record_every``-th) exceed ``memory_budget`` bytes,
        else memory. The directory is deleted with the estimator's trajectory unless
        moved with ``trajectory_.save(path)`` (a rename) or pickled (a pickle references
        the directory, which is then kept). A full disk during training keeps the
        rest of the path in memory with a warning naming the file and the step (see
        the user guide, "Scaling"). ``partial_fit`` and ``warm_start`` continue a path
        where it is kept ("auto" follows it); on disk they append to its files.
    trajectory_dir : str, path-like or None, default=None
        Where ``trajectory_storage="disk"`` creates its directories; None is the
        system's temporary directory (``tempfile.gettempdir()``, ``TMPDIR``).
    trajectory_compression : {None, "float16", "bfloat16"}, default=None
        With the trajectory on disk, store each recorded point's parameters as its
        difference from the previous stored point in this dtype (the first point of
        each chunk file in full precision): about half the disk of float32 parameters
        (optimizer states stay in full precision). Lossy: each stored point is within
        one rounding of its step of the trained one, and the kernels and
        :meth:`decompose` read the stored path, so ``decompose(...).error`` reports
        what it costs (the contributions follow the stored points' gradients, the
        reconstruction the stored steps), and ``attribute(method="unrolled")`` warns
        that its scores differentiate the rounded path. ``trajectory_.parameters(-1)`` is the stored
        last point; ``module_`` keeps the trained one.
    random_state : int, RandomState instance or None, default=None
        Seeds the initialization, the batch order and the early-stopping split: the same
        seed on the same device gives bit-identical results. A local generator is used;
        torch's global seed is untouched.
    verbose : int, default=0
        Show a progress bar (tqdm, when installed) with the training loss.
    warm_start : bool, default=False
        ``fit`` continues from the fitted network and its optimizer's state (moments,
        step count, the schedule's step size; a ``learning_rate_init`` or
        ``learning_rate`` changed since the last fit restarts the step size at
        ``learning_rate_init``, as MLPClassifier's warm start does) instead of a new
        initialization, and
        extends ``trajectory_``: one path from the first initialization to the last
        step, over which the kernels and :meth:`decompose` stay exact. On the same
        training data the batches index it as before; on other data the training set
        becomes the concatenation of both (as with ``partial_fit``). The network
        (``hidden_layer_sizes``, ``activation``, ``module``), the optimizer's rule
        (``solver``, ``momentum``, ``beta_1``, ...), ``dtype`` and the targets' encoding
        must be the previous fit's, and the trajectory stays where it is (in memory, or
        on disk, where the new points are appended to its files and the training set is
        kept beside them; see ``trajectory_storage``)."""

_NORMALIZE_Y_DOC = """
    normalize_y : bool, default=True
        For regression targets: train the network on ``(y - mean) / scale`` (mean and
        standard deviation of the samples trained on, per output, weighted by
        ``sample_weight`` when given; a constant target is only centered), so that one
        step size suits targets of any scale. Predictions are ``mean + scale * f(x)``
        and :meth:`decompose`'s terms are mapped back to the units of ``y`` exactly;
        ``loss_curve_``, the kernels and the tangent features are those of the network
        ``f`` itself. ``attribute(method="unrolled")`` differentiates the mean and
        scale too, as refits with other ``sample_weight`` take them anew (see
        :meth:`attribute`). ``False`` trains on ``y`` as given
        (MLPRegressor's behaviour). Ignored for class labels. A path continued by
        ``partial_fit`` or ``warm_start`` keeps the mean and scale of its first call's
        samples: a stream whose first call holds a few rows trains on targets scaled
        by their spread (2 rows: half their difference), and on later rows the
        residuals, and so the steps, grow with the ratio of the targets' spread to
        it; start such a stream with a representative chunk, or set
        ``normalize_y=False``."""

_FITTED_ATTRS_DOC = """
    network_ : TrainedNetwork
        The trained network and its recorded path (module, trajectory, loss, dtype,
        device, training inputs and targets), which the kernels, the decomposition and
        the displays read; ``module_``, ``trajectory_``, ``device_``, ``dtype_``,
        ``n_params_`` and ``X_fit_`` are its attributes.
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
        The score of the model kept: the best of the last fit's ``validation_scores_``.
        After a ``warm_start`` fit it may be below an earlier fit's best, as the fit
        keeps the best epoch of its own (the path ends at the model; MLPClassifier keeps
        the best over every fit, restoring an earlier fit's network). None without early
        stopping.
    n_iter_ : int
        Epochs run along the recorded path: over every call that extended it (a
        ``warm_start`` fit, each ``partial_fit``), where ``MLPClassifier`` counts the
        last call's.
    t_ : int
        Optimizer steps taken along the recorded path (``trajectory_.n_steps`` is fewer
        when early stopping kept an earlier epoch); ``MLPClassifier``'s ``t_`` counts
        the training samples seen instead.
    n_params_ : int
        Number of trainable parameters P.
    n_outputs_ : int
        Network outputs C.
    device_ : str
        Device the network lives on.
    dtype_ : str
        "float32" or "float64", the dtype the network was trained in (``dtype`` at
        ``fit``; a later ``set_params(dtype=...)`` changes the next fit only).
    X_fit_ : ndarray of shape (n_samples_trained, n_features) or (n_samples_trained, ...)
        The samples trained on, in the order of X (all of X unless ``early_stopping``
        held some out), as the network takes them (floats, or int64 token ids): the
        kernel machine's representation is over them.
    train_indices_ : ndarray of int of shape (n_samples_trained,) or None
        The rows of the ``X`` given to the last ``fit`` that ``X_fit_`` holds, in its
        order: ``X_fit_`` equals ``X[train_indices_]`` (``X`` after the estimator's input
        conversion; ``X.iloc[train_indices_]`` for a DataFrame). ``arange(n_samples)``
        unless ``early_stopping`` held rows out. Every per-training-point output
        indexes ``X_fit_`` (``decompose``'s ``contributions``, ``attribute``,
        ``self_influence``, ``kneighbors`` and ``explain`` indices, the trajectory's
        batches): this maps them back to ``X``. None where ``X_fit_`` is not rows of one
        call's ``X``: after a ``partial_fit`` call that appended its rows to an earlier
        call's (every call after the first), or a ``warm_start`` fit whose training rows
        differ from ``X_fit_`` (other data, or another ``early_stopping`` split: an int
        ``random_state`` keeps it), which appends them too. A ``warm_start`` fit on the
        same training rows keeps ``X_fit_`` and maps it to that call's ``X``.
    n_features_in_ : int
        Number of features seen during fit: for ``(n_samples, ...)`` inputs, the number
        of values per sample, ``prod(input_shape_)``.
    input_shape_ : tuple of int
        Trailing shape of ``X`` at fit (``(n_features,)`` for 2-D ``X``); every method
        that takes ``X`` expects this shape.
    feature_names_in_ : ndarray of shape (`n_features_in_`,)
        Names of features seen during fit, when X has string column names.
"""


_DECOMPOSE_EXAMPLES = """

Examples
--------
>>> import numpy as np
>>> from skpathkernel import PathKernelMachine
>>> X = np.linspace(-1, 1, 12).reshape(-1, 1); y = X.ravel() ** 2
>>> est = PathKernelMachine(hidden_layer_sizes=(8,), solver="adam", max_iter=20, tol=None,
...                         dtype="float64", random_state=0).fit(X, y)
>>> res = est.decompose(X[:3])
>>> res.contributions.shape
(3, 12, 1)
>>> bool(res.error < 1e-10)
True
"""

_ATTRIBUTE_EXAMPLES = """

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

_SELF_INFLUENCE_EXAMPLES = """

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


class _KernelMachineMixin(TransformerMixin):
    """transform / decompose / explain: the trained network as a kernel machine."""

    def __sklearn_tags__(self):
        return declare_feature_dtype(super().__sklearn_tags__(), self)

    def get_feature_names_out(self, input_features=None):
        """Names of the tangent features: ``"<parameter>[<index>]"``, e.g. ``"0.weight[3]"``.

        With several outputs, ``"out<c>:<parameter>[<index>]"``.

        Parameters
        ----------
        input_features : array-like of str or None, default=None
            Only checked against the input features seen in ``fit`` (``feature_names_in_``,
            or their number), as scikit-learn's transformers do; the names come from the
            network's parameters.

        Returns
        -------
        feature_names_out : ndarray of str objects
            One name per column of :meth:`transform`'s output.
        """
        return tangent_feature_names_out(self, input_features)

    @shared_doc(DECOMPOSE, note="", extra_params="", raises="",
                X="array-like of shape (n_queries, n_features) or (n_queries, ...)\n"
                  "    In the form of the training inputs (``input_shape_``).",
                examples=_DECOMPOSE_EXAMPLES)
    def decompose(self, X, *, method="exact", weighting="realized", n_nodes=None, tol=None,
                  n_jobs=None):
        check_decompose_args(method, weighting, n_nodes, tol)
        X = self._validate_X(X)
        # Every step needs the queries' Jacobians: one query's must fit the budget.
        self._check_feature_row_fits("decompose")
        mean, scale = getattr(self, "_y_mean", None), getattr(self, "_y_scale", None)
        # The network's loss is the one it was trained with: set_params(loss=...) after
        # fit must not change what the fitted path is decomposed with.
        return network_of(self).decompose(
            X, method=method, weighting=weighting, n_nodes=n_nodes, tol=tol, n_jobs=n_jobs,
            units=lambda res: in_target_units(res, mean, scale))

    def transform(self, X):
        """Tangent features phi(x) = d f(x; theta_T) / d theta at the final parameters.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features) or (n_samples, ...)
            In the form of the training inputs (``input_shape_``).

        Returns
        -------
        phi : ndarray of shape (n_samples, `n_params_`) or (n_samples, `n_outputs_` * `n_params_`)
            One row per sample, columns in ``trajectory_`` flat order, in the network's
            dtype. For several outputs, the flattened Jacobian divided by
            ``sqrt(n_outputs_)``, whose inner products are the trace kernel.
        """
        return self._tangent_features(X)

    @shared_doc(ATTRIBUTE, note="",
                X="array-like of shape (n_queries, n_features) or (n_queries, ...)\n"
                  "    The queries, in the form of the training inputs (``input_shape_``).",
                y="array-like of shape (n_queries,) or (n_queries, n_labels), default=None\n"
                  "    Classifiers: the queries' labels, whose margin is explained (a 0/1\n"
                  "    indicator row per query for multilabel classifiers, dense or sparse,\n"
                  "    whose margin is the sum of the labels' logits signed +1 for a label\n"
                  "    that is on, -1 for one that is off); None explains the margin of the\n"
                  "    predicted class (labels). Regressors: ignored.",
                output_default="Default: \"margin\" for the classifiers, 0 for the "
                               "regressors (required for several outputs).",
                examples=_ATTRIBUTE_EXAMPLES)
    def attribute(self, X, y=None, *, method="exact", weighting="realized", output=None,
                  n_nodes=None, tol=None, n_jobs=None):
        check_is_fitted(self)
        classifier = isinstance(self, ClassifierMixin)
        X = self._validate_X(X)
        if not is_option(method, "unrolled"):
            # Every step needs the queries' Jacobians: one query's must fit the budget.
            self._check_feature_row_fits("decompose")
        return network_of(self)._attribute(
            X, y, method=method, weighting=weighting, output=output,
            n_nodes=n_nodes, tol=tol, n_jobs=n_jobs, margin="default" if classifier else "no",
            encode=self._query_labels, scale=getattr(self, "_y_scale", None),
            multilabel=_multilabel(self),
            standardized=self._standardization() if is_option(method, "unrolled") else None)

    @shared_doc(SELF_INFLUENCE, label="classifiers: the margin of its own training label, "
                "or label set for multilabel classifiers",
                examples=_SELF_INFLUENCE_EXAMPLES)
    def self_influence(self, *, output=None, n_jobs=None):
        check_is_fitted(self)
        classifier = isinstance(self, ClassifierMixin)
        return network_of(self)._self_influence(
            output=output, n_jobs=n_jobs, margin="default" if classifier else "no",
            scale=getattr(self, "_y_scale", None), multilabel=_multilabel(self),
            standardized=self._standardization())

    def explain(self, X, n_neighbors=10, *, method="exact", output=None, n_jobs=None):
        """The training points that moved each prediction the most.

        Guo, He & Morel's "retrieval from the feature memory" (2026): for each query, the
        training points with the largest contribution ``|a_i(x)|`` in the decomposition
        of the explained output. Classifiers explain the margin of the predicted class (of
        the predicted labels for multilabel classifiers, see :meth:`attribute`) by
        default, through :meth:`attribute`'s contracted route (one scalar output per
        query along the path: about the cost of :meth:`attribute`, not of decomposing
        every output); ``output="all"`` ranks by ``|a_i(x)|`` summed over every output,
        from :meth:`decompose`.

        Parameters
        ----------
        X : array-like of shape (n_queries, n_features) or (n_queries, ...)
            The queries, in the form of the training inputs (``input_shape_``).
        n_neighbors : int, default=10
            Number of training points returned per query, at most the number of
            training samples (more is refused, as by :meth:`kneighbors`).
        method : {"exact", "first_order", "second_order"}, default="exact"
            How the contributions are computed, as in :meth:`decompose`.
        output : "margin", int, array-like of float or "all", default=None
            The output explained. None: the predicted class's margin for classifiers
            (see :meth:`attribute`), the output for single-output regressors, and "all"
            for regressors with several outputs. "margin", an int and output weights
            (the weighted sum of the outputs, in the units of ``y`` for regressors)
            are as in :meth:`attribute`; "all" explains every output at once.
        n_jobs : int, default=None
            Query blocks on joblib workers (Dask under
            ``joblib.parallel_config(backend="dask")``), as in :meth:`decompose`; the
            contributions agree with the serial call to the decomposition's ``tol``.

        Returns
        -------
        indices : ndarray of shape (n_queries, n_neighbors)
            Rows of ``X_fit_`` (``train_indices_`` maps them to ``X``), largest
            contribution first.
        contributions : ndarray of shape (n_queries, n_neighbors, n_explained)
            Their contributions ``a_i(x)``: one column for a scalar output, ``n_outputs_``
            columns for ``output="all"``.

        Examples
        --------
        >>> import numpy as np
        >>> from skpathkernel import PathKernelMachine
        >>> X = np.linspace(-1, 1, 12).reshape(-1, 1); y = X.ravel() ** 2
        >>> est = PathKernelMachine(hidden_layer_sizes=(8,), max_iter=5, tol=None, random_state=0)
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
            X, n_neighbors, method=method, output=output, n_jobs=n_jobs,
            margin="default" if classifier else "no", encode=self._query_labels,
            scale=scale, units=lambda res: in_target_units(res, mean, scale),
            multilabel=_multilabel(self))

    def _query_labels(self, y) -> np.ndarray | None:
        """Queries' labels as output columns (classifiers): class positions, or 0/1
        codes per label for a multilabel classifier."""
        if not isinstance(self, ClassifierMixin):
            return None
        if _multilabel(self):
            return check_indicator(y, self.n_outputs_)
        return label_codes(self.classes_, y)


def _multilabel(estimator) -> bool:
    """Whether a fitted classifier was trained on a multilabel indicator matrix."""
    return getattr(estimator, "_multilabel", False)


def _encode_indicator(y, loss: str, classes=None) -> tuple[np.ndarray, int, dict]:
    """A multilabel indicator -> one logit per label, as MLPClassifier's LabelBinarizer:
    0/1 targets (log loss) or +-1 (squared error); ``classes_`` is ``arange(n_labels)``.

    ``classes`` (``partial_fit``'s, or the fitted ones being continued) must be those
    label columns.
    """
    n_labels = y.shape[1]
    labels = np.arange(n_labels)
    if classes is not None and not np.array_equal(np.unique(classes), labels):
        raise ValueError(
            f"y is a multilabel indicator with {n_labels} label columns, whose classes are "
            f"the columns 0..{n_labels - 1}; classes (partial_fit's, or classes_ of the fit "
            f"being continued) is {np.asarray(classes).tolist()}. "
            "Every call must have the same label columns (pass "
            "classes=np.arange(n_labels) to the first partial_fit call)."
        )
    codes = check_indicator(y, n_labels)
    Y = codes.astype(np.float64) if loss == "log_loss" else 2.0 * codes - 1.0
    return Y, n_labels, {"classes_": labels, "_multilabel": True}


def _encode_labels(y, loss: str, classes=None) -> tuple[np.ndarray, int, dict]:
    """Class labels -> network targets: a margin for two classes, logits for more, and
    for a multilabel indicator (2-D ``y``) a logit per label.

    ``classes``: every label the network will see (``partial_fit``'s); ``y`` may hold
    some of them only.
    """
    if np.ndim(y) == 2:
        return _encode_indicator(y, loss, classes)
    encoder = LabelEncoder().fit(y if classes is None else classes)
    if classes is not None:
        unseen = np.setdiff1d(y, encoder.classes_)
        if unseen.size:
            raise ValueError(
                f"y has classes not in classes_ {encoder.classes_.tolist()}: "
                f"{unseen.tolist()}. partial_fit and warm_start continue a network whose "
                "outputs are those classes: pass every class to the first partial_fit "
                "call (classes=...), or call fit."
            )
    classes = encoder.classes_
    if len(classes) < 2:
        raise ValueError(
            "The number of classes has to be greater than one; got "
            # tolist(): a NumPy scalar's repr is np.int64(0) since NumPy 2.
            f"{len(classes)} class ({classes.tolist()[0]!r}). A classifier needs at least "
            "two."
        )
    codes = encoder.transform(y)
    n_outputs = 1 if len(classes) == 2 else len(classes)
    if loss == "log_loss":
        Y = codes.astype(np.float64) if n_outputs == 1 else codes.astype(np.int64)
    elif n_outputs == 1:
        Y = (2.0 * codes - 1.0).reshape(-1, 1)
    else:
        Y = np.eye(len(classes))[codes]
    return Y, n_outputs, {"classes_": classes, "_multilabel": False}


def check_labels(estimator, y, multilabel: bool = False):
    """Refuse targets that are not class labels (or, with ``multilabel``, a 0/1
    indicator matrix), naming what they are."""
    check_classification_targets(y)
    kind = type_of_target(y)
    if multilabel and kind == "multilabel-indicator":
        check_indicator(y)
        return
    if kind not in ("binary", "multiclass"):
        kinds = ("binary, multi-class and multilabel-indicator targets (a 0/1 matrix of "
                 "shape (n_samples, n_labels))" if multilabel else
                 "binary and multi-class targets")
        raise ValueError(f"{type(estimator).__name__} supports {kinds}, got {kind}.")


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
        learning_rate="constant",
        power_t=0.5,
        momentum=0.0,
        nesterovs_momentum=True,
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
        warm_start=False,
        normalize_y=True,
    ):
        super().__init__(
            hidden_layer_sizes=hidden_layer_sizes, activation=activation, module=module,
            solver=solver, learning_rate_init=learning_rate_init,
            learning_rate=learning_rate, power_t=power_t, momentum=momentum,
            nesterovs_momentum=nesterovs_momentum, alpha=alpha, beta_1=beta_1,
            beta_2=beta_2, epsilon=epsilon,
            batch_size=batch_size, max_iter=max_iter, tol=tol,
            n_iter_no_change=n_iter_no_change, early_stopping=early_stopping,
            validation_fraction=validation_fraction, shuffle=shuffle, loss=loss,
            record_every=record_every, device=device, dtype=dtype,
            memory_budget=memory_budget, trajectory_storage=trajectory_storage,
            trajectory_dir=trajectory_dir, trajectory_compression=trajectory_compression,
            random_state=random_state, verbose=verbose, warm_start=warm_start,
        )
        self.normalize_y = normalize_y

    def _validate_y(self, X, y, **kwargs):
        X, y = super()._validate_y(X, y, **kwargs)
        if y.ndim == 2 and y.shape[1] == 1:
            # MLPRegressor's: a column is one output, with a DataConversionWarning, and
            # predict returns it 1-D (it returned (n, 1), where MLPRegressor's is (n,)).
            y = column_or_1d(y, warn=True)
        return X, y

    def _encode_targets(self, y, classes=None):
        self_y_2d = y.ndim == 2
        Y = y.reshape(len(y), -1)
        return Y, Y.shape[1], {"_y_2d": self_y_2d}

    @keep_previous_fit_on_error
    def fit(self, X, y, sample_weight=None):
        """Train the network on (X, y), recording its path.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features) or (n_samples, ...)
            2-D for the default MLP; with ``module``, any ``(n_samples, ...)`` array:
            floats, or integer token ids.
        y : array-like of shape (n_samples,) or (n_samples, n_outputs)
            Real-valued targets. A column of shape ``(n_samples, 1)`` is taken as 1-D,
            with a ``DataConversionWarning``, as by
            :class:`~sklearn.neural_network.MLPRegressor`.
        sample_weight : array-like of shape (n_samples,), default=None
            Non-negative weights of the samples, relative as in ``np.average``: each
            batch's loss is their weighted mean, ``sum_i s_i l_i / sum_i s_i`` over
            the batch, so multiplying every weight by a constant changes nothing (unlike
            MLPRegressor, whose L2 penalty ``alpha`` is divided by the batch's weight sum;
            here ``alpha`` is not weighted). A batch whose weights sum to 0 contributes
            no gradient. The trajectory records each batch's normalized weights
            (``trajectory_.batch_weights``), so :meth:`decompose` and :meth:`attribute`
            stay exact; a zero-weight sample gets a zero contribution. None, or equal
            weights, is the unweighted fit.

        Returns
        -------
        self : PathKernelMachine
            The fitted estimator.
        """
        validate_params(self)
        return self._fit(X, y, sample_weight=sample_weight)

    @keep_previous_fit_on_error
    def partial_fit(self, X, y, sample_weight=None):
        """Train one more epoch, on (X, y), continuing the fitted network and its path.

        MLPRegressor's out-of-core entry point: the first call starts a network (as
        ``fit`` would, with ``normalize_y`` from the targets' mean and scale of its
        samples, which later calls keep), every later one continues its optimizer,
        schedule and stopping rule for one pass over the given data. Any call, the first
        included, may hold a single sample (``fit`` needs two; a single first sample's
        target is only centered, see ``normalize_y``). The training set of the kernel
        machine (``X_fit_``) is the concatenation of what the calls received, in order,
        and the trajectory's batches index into it, so that the kernels,
        :meth:`decompose` and :meth:`attribute` cover every call. With
        ``trajectory_storage="disk"`` the path grows in its directory and the training
        set is kept there too (``<directory>/data``, read back as a memory-mapped
        ``X_fit_``), so that a stream never holds it in memory between calls.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features) or (n_samples, ...)
            This call's training inputs (appended to ``X_fit_``).
        y : array-like of shape (n_samples,) or (n_samples, n_outputs)
            Their targets.
        sample_weight : array-like of shape (n_samples,), default=None
            Weights of this call's samples, as in :meth:`fit`.

        Returns
        -------
        self : PathKernelMachine
            The estimator, one epoch further along its path.

        Examples
        --------
        >>> import numpy as np
        >>> from skpathkernel import PathKernelMachine
        >>> X = np.linspace(-1, 1, 40).reshape(-1, 1); y = np.sin(3 * X).ravel()
        >>> est = PathKernelMachine(hidden_layer_sizes=(8,), random_state=0)
        >>> for chunk in np.array_split(np.arange(40), 4):
        ...     est = est.partial_fit(X[chunk], y[chunk])
        >>> est.n_iter_, est.X_fit_.shape[0], est.trajectory_.n_samples
        (4, 40, 40)
        """
        validate_params(self)
        return self._fit(X, y, sample_weight=sample_weight, incremental=True)

    def predict(self, X):
        """Network outputs f(X; theta_T).

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features) or (n_samples, ...)
            In the form of the training inputs (``input_shape_``).

        Returns
        -------
        y_pred : ndarray of shape (n_samples,) or (n_samples, n_outputs)
            Two-dimensional when ``y`` had more than one column at fit time; a column
            ``y`` of shape ``(n_samples, 1)`` predicts ``(n_samples,)``, as in
            :class:`~sklearn.neural_network.MLPRegressor`.
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

    Binary problems use one output (a margin); ``K`` classes use ``K`` logits; a
    multilabel indicator matrix ``y`` of shape ``(n_samples, n_labels)`` (0/1) uses one
    logit per label, each label a binary problem, as MLPClassifier does (see the user
    guide, "Multilabel targets").

    Parameters
    ----------{shared}
    loss : {{"log_loss", "squared_error"}}, default="log_loss"
        "log_loss": logistic loss on the margin (binary), softmax cross-entropy
        (multi-class) or the logistic loss of every label summed over the labels
        (multilabel, MLPClassifier's), mean over the batch. "squared_error": ``1/2`` mean
        squared error on +-1 targets (binary, and per label for multilabel) or one-hot
        targets (multi-class); ``predict_proba`` is then unavailable.

    Attributes
    ----------
    classes_ : ndarray of shape (n_classes,)
        Class labels; for multilabel targets the label columns, ``arange(n_labels)``
        (MLPClassifier's).{fitted}
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
        learning_rate="constant",
        power_t=0.5,
        momentum=0.0,
        nesterovs_momentum=True,
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
        warm_start=False,
    ):
        super().__init__(
            hidden_layer_sizes=hidden_layer_sizes, activation=activation, module=module,
            solver=solver, learning_rate_init=learning_rate_init,
            learning_rate=learning_rate, power_t=power_t, momentum=momentum,
            nesterovs_momentum=nesterovs_momentum, alpha=alpha, beta_1=beta_1,
            beta_2=beta_2, epsilon=epsilon,
            batch_size=batch_size, max_iter=max_iter, tol=tol,
            n_iter_no_change=n_iter_no_change, early_stopping=early_stopping,
            validation_fraction=validation_fraction, shuffle=shuffle, loss=loss,
            record_every=record_every, device=device, dtype=dtype,
            memory_budget=memory_budget, trajectory_storage=trajectory_storage,
            trajectory_dir=trajectory_dir, trajectory_compression=trajectory_compression,
            random_state=random_state, verbose=verbose, warm_start=warm_start,
        )

    def _validate_y(self, X, y, **kwargs):
        # A sparse label indicator is taken as MLPClassifier takes it; the network
        # trains on dense targets, and predict returns dense indicators.
        X, y = self._validate_fit_data(X, dense_indicator(y), multi_output=True, **kwargs)
        if y.ndim == 2 and y.shape[1] == 1:
            # MLPClassifier's: a column is labels, with a DataConversionWarning.
            y = column_or_1d(y, warn=True)
        check_labels(self, y, multilabel=True)
        return X, y

    def _check_continued_targets(self, y):
        # Checked before encoding: class labels 0..K-1 and K label columns would both
        # encode against classes_ = arange(K), as different networks.
        fitted, given = _multilabel(self), y.ndim == 2
        if fitted != given:
            what = {True: "a multilabel indicator matrix (n_samples, n_labels)",
                    False: "1-D class labels"}
            raise ValueError(
                f"The fitted network was trained on {what[fitted]}; y is {what[given]}. "
                "partial_fit and warm_start continue its outputs: pass the same kind of "
                "targets, or call fit (warm_start=False) to train a new network.")

    def _encode_targets(self, y, classes=None):
        return _encode_labels(y, self.loss, classes)

    def _target_tensor(self, Y, dtype, device):
        return _label_tensor(Y, dtype, device)

    @keep_previous_fit_on_error
    def fit(self, X, y, sample_weight=None):
        """Train the network on (X, y), recording its path.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features) or (n_samples, ...)
            2-D for the default MLP; with ``module``, any ``(n_samples, ...)`` array:
            floats, or integer token ids.
        y : {array-like, sparse matrix} of shape (n_samples,) or (n_samples, n_labels)
            Class labels (binary or multi-class), or a 0/1 multilabel indicator matrix,
            dense or sparse (as MLPClassifier's; trained on, and predicted, dense).
        sample_weight : array-like of shape (n_samples,), default=None
            Non-negative weights of the samples, relative as in ``np.average`` and
            recorded in the trajectory, as in :meth:`PathKernelMachine.fit` (MLPClassifier
            divides ``alpha`` by the batch's weight sum; here it is not weighted). Class
            weights are sample weights: ``compute_sample_weight("balanced", y)`` weighs
            the classes of imbalanced data equally. Weights that leave fewer than two
            classes with positive weight are refused.

        Returns
        -------
        self : PathKernelClassifier
        """
        validate_params(self)
        return self._fit(X, y, sample_weight=sample_weight)

    @keep_previous_fit_on_error
    def partial_fit(self, X, y, sample_weight=None, classes=None):
        """Train one more epoch, on (X, y), continuing the fitted network and its path.

        MLPClassifier's out-of-core entry point: the first call starts a network (as
        ``fit`` would) and must name every class; every later one continues its
        optimizer, schedule and stopping rule for one pass over the given data. Any call,
        the first included, may hold a single sample (``fit`` needs two). The
        training set of the kernel machine (``X_fit_``) is the concatenation of what the
        calls received, in order, and the trajectory's batches index into it, so that
        the kernels, :meth:`decompose` and :meth:`attribute` cover every call. With
        ``trajectory_storage="disk"`` the path grows in its directory and the training
        set is kept there too (``<directory>/data``, read back as a memory-mapped
        ``X_fit_``), so that a stream never holds it in memory between calls.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features) or (n_samples, ...)
            This call's training inputs (appended to ``X_fit_``).
        y : {array-like, sparse matrix} of shape (n_samples,) or (n_samples, n_labels)
            Labels among ``classes``, or a 0/1 multilabel indicator matrix, dense or
            sparse (every call with the same label columns).
        sample_weight : array-like of shape (n_samples,), default=None
            Weights of this call's samples, as in :meth:`fit`.
        classes : array-like of shape (n_classes,), default=None
            Every class of the whole stream; required on the first call. A later call may
            omit it, or must repeat the fitted ``classes_`` (a later call's labels must be
            among them). For multilabel ``y``, the label columns ``np.arange(n_labels)``.

        Notes
        -----
        The argument order is MLPClassifier's (scikit-learn >= 1.7):
        ``partial_fit(X, y, sample_weight, classes)``: code written for it that passes
        the weights positionally trains weighted (with ``classes`` third, a later call
        ignored them silently). As in scikit-learn, ``classes`` given on a later call
        must equal ``classes_``. Code that passed ``classes`` third before this order
        changed is refused on its first call (``classes`` missing), and on later calls
        by the weights' length unless the call has exactly ``n_classes`` samples; pass
        ``classes`` by keyword.

        Returns
        -------
        self : PathKernelClassifier

        Examples
        --------
        >>> import numpy as np
        >>> from skpathkernel import PathKernelClassifier
        >>> X = np.linspace(-1, 1, 40).reshape(-1, 1); y = (X.ravel() > 0).astype(int)
        >>> clf = PathKernelClassifier(hidden_layer_sizes=(8,), random_state=0)
        >>> clf = clf.partial_fit(X[:20], y[:20], classes=[0, 1])
        >>> clf = clf.partial_fit(X[20:], y[20:])
        >>> clf.classes_.tolist(), clf.X_fit_.shape[0]
        ([0, 1], 40)
        """
        validate_params(self)
        if not hasattr(self, "network_") and classes is None:
            raise ValueError("classes must be passed on the first call to partial_fit.")
        if classes is not None:
            # As y is checked: a NaN among the classes became a class of its own (a
            # network with an output for it, labels predicted as floats), and a string
            # was refused in words about y.
            if np.ndim(classes) != 1:
                raise ValueError(f"classes must be a 1-D array-like of labels, got shape "
                                 f"{np.shape(classes)}.")
            classes = check_array(classes, ensure_2d=False, dtype=None,
                                  input_name="classes")
        fitted = getattr(self, "classes_", None)
        if classes is not None and fitted is not None and hasattr(self, "network_") and \
                not np.array_equal(np.unique(np.asarray(classes)), fitted):
            raise ValueError(f"classes={np.asarray(classes).tolist()} is not the same as on "
                             f"the first call to partial_fit, {fitted.tolist()}.")
        return self._fit(X, y, sample_weight=sample_weight, incremental=True,
                         classes=classes)

    def decision_function(self, X):
        """Margins (binary, shape (n_samples,)) or logits (shape (n_samples, n_classes)).

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features) or (n_samples, ...)
            In the form of the training inputs (``input_shape_``).

        Returns
        -------
        scores : ndarray of shape (n_samples,) or (n_samples, n_classes)
            The network's outputs at the final parameters: the margin of the second class
            for binary problems, one logit per class otherwise (one per label for
            multilabel targets).
        """
        out = self._forward(X)
        return out[:, 0] if out.shape[1] == 1 else out

    def predict(self, X):
        """Predicted class labels.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features) or (n_samples, ...)
            In the form of the training inputs (``input_shape_``).

        Returns
        -------
        y_pred : ndarray of shape (n_samples,) or (n_samples, n_labels)
            The class with the largest score in :meth:`decision_function`; for multilabel
            targets the indicator matrix (ints, as MLPClassifier's) of the labels with a
            positive logit (probability above 0.5).
        """
        scores = self.decision_function(X)
        if _multilabel(self):
            return (scores > 0).astype(int)
        if scores.ndim == 1:
            return self.classes_[(scores > 0).astype(np.intp)]
        return self.classes_[np.argmax(scores, axis=1)]

    def _outputs_hint(self, n_outputs: int) -> str:
        if n_outputs == 1:
            return (" (a binary classifier's network has one output, the logit of "
                    "classes_[1], as MLPClassifier's)")
        return " (one logit per class, or per label for multilabel y)"

    def _has_proba(self):
        # The fitted network's loss (set_params(loss=...) after fit changes no network).
        return getattr(self, "_loss_name", self.loss) == "log_loss"

    @available_if(_has_proba)
    def predict_proba(self, X):
        """Class probabilities (sigmoid of the margin, or softmax of the logits).

        For multilabel targets, each label's probability, the sigmoid of its logit:
        shape (n_samples, n_labels), as MLPClassifier's.
        """
        scores = self.decision_function(X).astype(np.float64)
        if _multilabel(self):
            return expit(scores)
        if scores.ndim == 1:
            # expit(-s), not 1 - expit(s), which rounds to 0 beyond a margin of ~37.
            return np.column_stack([expit(-scores), expit(scores)])
        return softmax(scores, axis=1)

    @available_if(_has_proba)
    def predict_log_proba(self, X):
        """Logarithm of :meth:`predict_proba`, from the margins themselves.

        Log-sigmoid / log-softmax of the scores: finite where a probability rounds to
        0 (``np.log(predict_proba(X))``, as MLPClassifier computes it, gives ``-inf``
        beyond a margin of about 37, where float64's ``1 - p`` is 0).
        """
        scores = self.decision_function(X).astype(np.float64)
        if _multilabel(self):
            return log_expit(scores)
        if scores.ndim == 1:
            return np.column_stack([log_expit(-scores), log_expit(scores)])
        return log_softmax(scores, axis=1)

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.classifier_tags.multi_label = True  # a 0/1 indicator y, as MLPClassifier
        return tags
