"""TangentFeatures and TangentFeatureSVM: learned tangent features for kernel methods.

A trained network's tangent features ``phi(x) = d f(x; theta_T) / d theta`` are a learned
feature map; a linear model on them (or an SVC on the tangent / path kernel they define)
is figure 3 of Guo, He & Morel (2026). Both are meta-estimators: the network is trained by
their ``estimator``, a :class:`PathKernelMachine` or :class:`PathKernelClassifier`, or was
trained in a user's own loop (a :class:`RecordedNetwork`, used as it is).
"""

from __future__ import annotations

import numbers
import warnings

import numpy as np
from sklearn.base import ClassifierMixin, TransformerMixin
from sklearn.calibration import CalibratedClassifierCV
from sklearn.exceptions import DataDimensionalityWarning
from sklearn.model_selection import StratifiedKFold
from sklearn.svm import SVC
from sklearn.utils import check_random_state
from sklearn.utils._param_validation import Interval, StrOptions
from sklearn.utils.class_weight import compute_class_weight
from sklearn.utils.metadata_routing import _routing_enabled
from sklearn.utils.metaestimators import available_if
from sklearn.utils.multiclass import type_of_target
from sklearn.utils.validation import _check_feature_names_in, check_is_fitted, column_or_1d

from .._memory import feature_block_rows, map_fixed_blocks
from .._parallel import limit_torch_threads
from .._path._recorder import RecordedNetwork
from .._validation import count, validate_params
from ..kernels import PathKernel, TangentKernel, kernel_threads
from ._base import (
    FittedAttribute,
    _check_weighted_classes,
    holdout_rows,
    keep_previous_fit_on_error,
    mean_one,
    runs_fitted_module,
    tangent_feature_names_out,
)
from ._machine import PathKernelClassifier, check_labels
from ._meta import ESTIMATOR_DOC, FITTED_DOC, NetworkMetaEstimator, trained_task

__all__ = ["TangentFeatureSVM", "TangentFeatures"]


def _unit_rows(phi: np.ndarray) -> np.ndarray:
    # The squares summed in float64 (einsum casts as it goes: no float64 copy of phi): a
    # float32 row's squared norm passes float32's range where its features are finite
    # (from about 1e19: a ReLU network at a large input), and the row became zero.
    norms = np.sqrt(np.einsum("ij,ij->i", phi, phi, dtype=np.float64))[:, None]
    # A zero row (a dead network at x) has no direction: it stays zero.
    return phi / np.where(norms > 0, norms, 1).astype(phi.dtype, copy=False)


class _TangentFeatureNames:
    """Transformer tags and output names of the dense tangent features."""

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
        """
        return tangent_feature_names_out(self, input_features)

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        # Tangent features come out in the network's dtype, whatever X's (set after
        # TransformerMixin's preserves_dtype=["float64"]).
        tags.transformer_tags.preserves_dtype = [self._trainer_param("dtype", "float32")]
        return tags


class TangentFeatures(_TangentFeatureNames, TransformerMixin, NetworkMetaEstimator):
    """Learned tangent features: train a network on (X, y), then map x to phi(x).

    ``fit`` fits the network trainer ``estimator`` (recording its path);
    ``transform`` returns ``phi(x) = d f(x; theta_T) / d theta`` at the final parameters,
    one dense row of ``n_params_`` features per sample, or a seeded random projection of
    it with ``n_components``. Inner products of the rows are the tangent kernel
    (:class:`~skpathkernel.kernels.TangentKernel`), so a linear model on them is a kernel machine
    with the network's learned kernel.

    Parameters
    ----------{estimator}
        None: a default-constructed trainer chosen by the targets
        (:func:`~sklearn.utils.multiclass.type_of_target`): binary and multi-class
        targets (integers, strings, floats with integral values and few distinct values)
        and multilabel indicator matrices train a :class:`PathKernelClassifier`, anything
        else (continuous, multi-output) a :class:`PathKernelMachine`. Pass
        ``PathKernelMachine()`` to regress on integer-valued targets.
    n_components : int, default=None
        ``None`` returns the exact tangent features. An int returns a Johnson-Lindenstrauss
        projection ``z(x)`` with ``E[z(x) . z(x')] = K(x, x')``, computed without forming
        the features of ``nn.Linear`` layers (Kronecker-structured Gaussian directions),
        seeded from ``random_state`` at fit time. ``fit`` warns
        (:class:`~sklearn.exceptions.DataDimensionalityWarning`) when it exceeds the
        number of exact features.
    normalize : bool, default=False
        Scale every row to unit Euclidean norm (the normalized tangent kernel).
    n_jobs : int or None, default=None
        Number of joblib workers for :meth:`transform`: the rows of ``X`` are split into
        one contiguous block per worker, computed with ``Parallel(n_jobs)`` on loky
        processes, threads or, under ``joblib.parallel_config(backend="dask")``, a Dask
        cluster, and stacked back in order; each task runs torch with ``max(1, cpu_count
        // n_jobs)`` threads and receives the network with its path by reference (an
        on-disk path's temporary directory stays temporary). Every block is a whole
        number of the serial call's fixed blocks (256 rows, fewer where
        ``memory_budget`` needs it), each computed as serially: the result equals the
        serial one bit for bit, and an ``X`` of one such block runs serially. ``None``
        means 1 unless in a :func:`joblib.parallel_config` context; ``-1`` all workers.
        ``fit`` is serial (the trainer's own).
    random_state : int, RandomState instance or None, default=None
        Seeds the projection's directions and, with ``estimator=None``, the default
        trainer (a given trainer keeps its own ``random_state``).

    Attributes
    ----------
    task_ : {{"regression", "classification"}}
        What the network was trained on: class labels with a
        :class:`PathKernelClassifier`, regression targets with a
        :class:`PathKernelMachine`; for a :class:`RecordedNetwork`, "classification"
        when its declared loss is "log_loss".
    classes_ : ndarray of shape (n_classes,)
        Class labels, for a :class:`PathKernelClassifier` only (``estimator_``'s).{fitted}
    See Also
    --------
    TangentFeatureSVM : A linear SVM on these features, or an SVC on their kernel.
    PathKernelMachine.transform : The same features from the trainer itself.

    Notes
    -----
    With ``C > 1`` network outputs (multi-class logits, multi-output regression) the row
    is the flattened Jacobian divided by ``sqrt(C)``: its inner products are the trace
    tangent kernel ``trace(J(x) J(x')^T) / C``.

    Examples
    --------
    >>> from skpathkernel import PathKernelClassifier, TangentFeatures
    >>> from skpathkernel.datasets import make_circle
    >>> X, y = make_circle(n_samples=60, random_state=0)
    >>> net = PathKernelClassifier(hidden_layer_sizes=(8,), max_iter=20, tol=None, random_state=0)
    >>> tf = TangentFeatures(net)
    >>> phi = tf.fit_transform(X, y)
    >>> tf.task_, phi.shape, tf.n_params_
    ('classification', (60, 33), 33)
    >>> tf.get_feature_names_out()[:2].tolist()
    ['0.weight[0]', '0.weight[1]']
    >>> tf.set_params(n_components=5, estimator__hidden_layer_sizes=(4,)).fit_transform(
    ...     X, y).shape
    (60, 5)
    """

    _parameter_constraints = {
        **NetworkMetaEstimator._parameter_constraints,
        "n_components": [count(1), None],
        "normalize": ["boolean"],
        "n_jobs": [numbers.Integral, None],
    }
    # sample_weight only weighs the trainer's loss: routed to it, as MultiOutputRegressor
    # routes its own (this fit's request is not read).
    _uses_sample_weight = False

    def __init__(self, estimator=None, *, n_components=None, normalize=False, n_jobs=None,
                 random_state=None):
        self.estimator = estimator
        self.n_components = n_components
        self.normalize = normalize
        self.n_jobs = n_jobs
        self.random_state = random_state

    classes_ = FittedAttribute("_network_estimator", label="estimator_")

    def __setstate__(self, state):
        # A fit pickled before transform read the fit's n_components and normalize has
        # neither: its transform read the parameters, which then describe its fit.
        if "estimator_" in state:
            state = {"_n_components": state.get("n_components"),
                     "_normalize": state.get("normalize", False), **state}
        # A pickle from before n_jobs transformed serially.
        super().__setstate__({"n_jobs": None, **state})

    @property
    def task_(self):
        """"classification" or "regression": what ``estimator_`` was trained on."""
        return trained_task(self._network_estimator)

    @keep_previous_fit_on_error
    def fit(self, X, y=None, sample_weight=None, **fit_params):
        """Fit the network trainer on (X, y), recording its path.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features) or (n_samples, ...)
            2-D for the default MLP; with a trainer's ``module``, any
            ``(n_samples, ...)`` array: floats, or integer token ids.
        y : array-like of shape (n_samples,) or (n_samples, n_outputs), default=None
            Regression targets or class labels (see ``estimator``), required unless the
            trainer is a ``FrozenEstimator`` or a ``RecordedNetwork``, which ignore it
            (``fit(X)`` in an unsupervised pipeline).
        sample_weight : array-like of shape (n_samples,), default=None
            Passed to the trainer's ``fit`` (see :meth:`PathKernelMachine.fit`);
            validated, and otherwise unused, with a ``FrozenEstimator``. With
            ``sklearn.set_config(enable_metadata_routing=True)``, routed to a trainer
            that requested it (``set_fit_request(sample_weight=True)``), an error for one
            that did not say, and refused as routed to no one when it declined or is
            frozen.
        **fit_params : dict
            Only with ``sklearn.set_config(enable_metadata_routing=True)``: metadata
            routed to the trainer's ``fit`` (an unfrozen ``Pipeline`` given as
            ``estimator`` routes each of its steps what it requested, as
            ``Pipeline.fit`` does), such as a weight under the alias the trainer
            requested (``set_fit_request(sample_weight="w")``, then ``fit(X, y,
            w=weights)``), as scikit-learn's ``MultiOutputRegressor`` routes them.
            Without routing they are refused, as by ``BaggingRegressor``.

        Returns
        -------
        self : TangentFeatures
        """
        validate_params(self)
        if y is None and self._y_required(self._trainer()[1]):
            raise ValueError(
                "TangentFeatures requires y to be passed, but the target y is None: its "
                "trainer is fitted on (X, y), class labels or regression targets (pass "
                "pipeline.fit(X, y)); wrap a fitted trainer in "
                "sklearn.frozen.FrozenEstimator (or pass a RecordedNetwork) to take its "
                "network's features without y.")
        # The second draw: a default trainer seeded with the same random_state takes the
        # first for its initialization, and the directions must differ from it.
        seed = int(check_random_state(self.random_state).randint(2**31 - 1, size=2)[1])
        self._fit_trainer(X, y, sample_weight=sample_weight, fit_params=fit_params)
        # The projection (its width, its seed) and the normalization are part of the
        # fitted state, as SparseRandomProjection's components_: set_params changes what
        # the next fit returns, not what this one's transform does.
        self._projection_seed = seed
        self._n_components, self._normalize = self.n_components, self.normalize
        n_exact = self.n_params_ * (self.n_outputs_ if self.n_outputs_ > 1 else 1)
        if self.n_components is not None and self.n_components > n_exact:
            # As GaussianRandomProjection warns: the projection is wider than the exact
            # features, so it only adds sampling noise to their kernel.
            warnings.warn(
                f"The number of components is higher than the number of exact tangent "
                f"features: n_components={self.n_components} > {n_exact} (n_params_ "
                f"{self.n_params_} times {max(self.n_outputs_, 1)} output(s)). The "
                "projection does not reduce the dimension and only approximates the "
                "exact features' kernel: use n_components=None for the exact features.",
                DataDimensionalityWarning, stacklevel=3)
        return self

    @runs_fitted_module
    def transform(self, X):
        """Tangent features of X at the final parameters.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features) or (n_samples, ...)
            In the form of the training inputs (``input_shape_``).

        Returns
        -------
        phi : ndarray of shape (n_samples, n_features_out)
            ``n_features_out`` is ``n_params_`` (times ``n_outputs_`` for several outputs)
            or ``n_components``; in the network's dtype. ``n_components`` and
            ``normalize`` are those of the last ``fit``: ``set_params`` takes effect at
            the next.
        """
        check_is_fitted(self)  # before the fitted state it reads
        projection = (None if self._n_components is None
                      else (self._n_components, self._projection_seed))
        phi = self._tangent_features(X, n_jobs=self.n_jobs, projection=projection)
        return _unit_rows(phi) if self._normalize else phi

    def get_feature_names_out(self, input_features=None):
        """Output feature names: the tangent features', or ``"tangentfeatures<k>"``.

        ``"<parameter>[<index>]"`` for the exact features (``"out<c>:..."`` per output
        when there are several), ``"tangentfeatures<k>"`` for a projection.

        Parameters
        ----------
        input_features : array-like of str or None, default=None
            Only checked against the input features seen in ``fit`` (``feature_names_in_``,
            or their number), as scikit-learn's transformers do: the names come from the
            network's parameters or the projection, not from the input features.

        Returns
        -------
        feature_names_out : ndarray of str objects
            One name per column of :meth:`transform`'s output.
        """
        check_is_fitted(self)
        if self._n_components is None:
            return super().get_feature_names_out(input_features)
        _check_feature_names_in(self, input_features, generate_names=False)
        prefix = type(self).__name__.lower()
        return np.asarray([f"{prefix}{k}" for k in range(self._n_components)], dtype=object)

    def _y_required(self, frozen: bool) -> bool:
        # A frozen trainer is not trained: y is ignored.
        return not frozen

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        # As fit: y trains the trainer, and a frozen one takes fit(X) without it.
        tags.target_tags.required = self._y_required(self._is_frozen())
        return tags


class TangentFeatureSVM(_TangentFeatureNames, ClassifierMixin, TransformerMixin,
                        NetworkMetaEstimator):
    """Support vector classifier on a network's tangent features (Guo, He & Morel, fig. 3).

    ``fit`` fits the network trainer ``estimator`` (a classifier) on (X, y), then an SVM
    on what it learned: a linear SVM on the tangent features ``phi(x)``, or an SVC on the
    tangent or path kernel. Each sample enters the SVM through ``phi(x)``, not through its
    coordinates.

    Parameters
    ----------{estimator}
        A :class:`PathKernelClassifier`, or a :class:`RecordedNetwork` declared with
        ``loss="log_loss"`` (a classifier of your own loop); None:
        ``PathKernelClassifier()``.
    C : float or "auto", default="auto"
        The SVM's regularization (larger: less regularization). "auto" chooses it from
        the training data: among ``[0.1, 1, 10, 100, 1000] / s``, ``s`` the mean of the
        training Gram's diagonal (the kernel's scale, so that the choice does not depend
        on the units of the tangent features; exactly 1 with ``normalize``), the value with the
        best accuracy in a stratified 3-fold cross-validation of the SVM on the training
        Gram (the smaller on ties), each fold's SVM weighted, and its accuracy weighted,
        by ``class_weight`` and ``sample_weight``. Cheap next to training: the Gram is
        computed once. ``C_`` holds the value used. The Gram's rounding depends on the
        threads (and the BLAS) that computed it: where a fold's prediction of a sample,
        and with it the tie between two values' scores, turns on that rounding, another
        thread count may choose another ``C_``.
    svm_kernel : {{"linear", "tangent", "path"}}, default="tangent"
        "linear": ``SVC(kernel="linear")`` on the dense tangent features at the final
        parameters (``svm_.coef_`` is then a direction in parameter space). "tangent" /
        "path": ``SVC(kernel="precomputed")`` on the Gram of the
        :class:`~skpathkernel.kernels.TangentKernel` /
        :class:`~skpathkernel.kernels.PathKernel` over the training set. "linear" and
        "tangent" are the same SVM (the tangent kernel is the linear kernel of ``phi``):
        "tangent" never forms ``phi`` for ``nn.Linear`` layers and is much cheaper (on
        sklearn's digits, ``phi`` of the default network is 89,700 wide: the linear SVM
        on it takes minutes, the Gram a fraction of a second), "linear" exposes
        ``coef_``.
    normalize : bool, default=True
        Cosine-normalize the kernel: ``K(x, x') / sqrt(K(x, x) K(x', x'))``, the
        kernel of the unit rows ``phi(x) / ||phi(x)||`` (``normalized=True`` of the
        kernels). The raw tangent kernel's diagonal ``||phi(x)||^2`` grows with how
        strongly the network responds at ``x`` and can differ widely within one training
        set, so the samples of largest norm set the margin and the scale of ``C``;
        normalized, the SVM compares directions only, every sample has norm 1, and
        ``C="auto"``'s grid means the same on every data set. False: the raw kernel.
    class_weight : dict, "balanced" or None, default=None
        The SVM's class weights, as :class:`sklearn.svm.SVC`'s, in every ``svm_kernel``
        (each an ``SVC``): class ``c``'s samples get ``C * class_weight[c]`` (times
        their ``sample_weight``); "balanced": ``n_samples / (n_classes *
        np.bincount(y))`` over the rows the SVM is fitted on. A label that is not a
        class of ``y``, and a weight that is not positive (``SVC`` fails on a class of
        weight 0), are refused before any training. ``C="auto"`` weighs its folds'
        SVMs alike and scores them by accuracy weighted by the same weights (with
        "balanced" and no ``sample_weight``, the balanced accuracy where the folds keep
        the classes' proportions). They weigh the SVM only, not the network's training:
        for that, pass ``sample_weight`` (e.g.
        :func:`sklearn.utils.class_weight.compute_sample_weight`), which both receive.
    probability : bool, default=False
        Whether to fit a probability model, giving :meth:`predict_proba` and
        :meth:`predict_log_proba` (absent otherwise, as ``SVC``'s). Platt scaling, by
        scikit-learn's replacement of ``SVC(probability=True)`` (deprecated in
        scikit-learn 1.9): ``CalibratedClassifierCV(svm, method="sigmoid",
        ensemble=False)``, the sigmoid fitted to out-of-fold decision values of a
        stratified 5-fold cross-validation in the order of the training set
        (deterministic, where libsvm's folds are drawn at random; fewer folds where a
        class has fewer than 5 samples, and a class of one sample is refused before
        any training, as is one where early stopping's hold-out will leave one), each
        fold's SVM with the class weights of the whole set (as
        libsvm's) and the sample weights, the sigmoid with the sample weights alone;
        one-vs-rest sigmoids, normalized, for several classes. Six more SVM fits.
        ``svm_``, :meth:`predict` and :meth:`decision_function` are those of
        ``probability=False``; as with ``SVC``, :meth:`predict` can disagree with the
        argmax of :meth:`predict_proba`.
    random_state : int, RandomState instance or None, default=None
        Seeds the default trainer (``estimator=None``); a given trainer keeps its own.
        The SVM itself, and its probability model, are deterministic.

    Attributes
    ----------
    svm_ : SVC
        The fitted SVM; it reads tangent features ("linear"; unit rows with
        ``normalize``) or Gram rows against ``X_fit_`` ("tangent", "path"; columns are
        rows of ``X_fit_``, which ``train_indices_`` maps to ``X``).
    calibrated_svm_ : CalibratedClassifierCV
        Only with ``probability=True``: the probability model, fitted on the class
        indices (``0`` to ``n_classes - 1``, in the order of ``classes_``) with
        ``class_weight``'s weights by index (``cross_val_predict``, which it runs,
        encodes the labels so: weights keyed by label would weigh the wrong classes);
        its SVM is ``svm_`` on the indices.
    C_ : float
        The ``C`` of ``svm_`` (chosen by ``C="auto"``, else ``C``).
    classes_ : ndarray of shape (n_classes,)
        Class labels (``svm_``'s).{fitted}
    See Also
    --------
    TangentFeatures : The transformer alone, for any estimator in a Pipeline.
    PathKernelClassifier : The network's own predictions.

    Examples
    --------
    >>> from skpathkernel import PathKernelClassifier, TangentFeatureSVM
    >>> from skpathkernel.datasets import make_circle
    >>> X, y = make_circle(n_samples=100, inner_radius_sq=0.9, random_state=0)
    >>> net = PathKernelClassifier(hidden_layer_sizes=(16,), max_iter=100, tol=None,
    ...                            learning_rate_init=0.02, random_state=0)
    >>> svm = TangentFeatureSVM(net).fit(X, y)
    >>> type(svm.svm_).__name__, bool(svm.score(X, y) > 0.9)
    ('SVC', True)
    """

    _parameter_constraints = {
        **NetworkMetaEstimator._parameter_constraints,
        "C": [Interval(numbers.Real, 0, None, closed="neither"), StrOptions({"auto"})],
        "svm_kernel": [StrOptions({"linear", "tangent", "path"})],
        "normalize": ["boolean"],
        "class_weight": [dict, StrOptions({"balanced"}), None],
        "probability": ["boolean"],
    }
    _trainers = (PathKernelClassifier, RecordedNetwork)

    def __init__(self, estimator=None, *, C="auto", svm_kernel="tangent", normalize=True,
                 class_weight=None, probability=False, random_state=None):
        self.estimator = estimator
        self.C = C
        self.svm_kernel = svm_kernel
        self.normalize = normalize
        self.class_weight = class_weight
        self.probability = probability
        self.random_state = random_state

    def __setstate__(self, state):
        # A pickle from before class_weight and probability was fitted without them.
        super().__setstate__({"class_weight": None, "probability": False, **state})

    classes_ = FittedAttribute("svm_")

    _routing_default = PathKernelClassifier

    def _default_trainer(self, y):
        return PathKernelClassifier(random_state=self.random_state)

    def _check_targets(self, y):
        if type_of_target(y) == "multilabel-indicator":
            raise ValueError(
                "TangentFeatureSVM fits one sklearn SVC, which takes one label per sample; "
                "y is a multilabel indicator matrix. Use PathKernelClassifier (one logit "
                "per label), or OneVsRestClassifier(TangentFeatureSVM(...)) (one network "
                "and SVM per label).")
        check_labels(self, y)
        # Before any training: a fit that ends in the SVM's refusal trained for nothing.
        classes, counts = np.unique(column_or_1d(y), return_counts=True)
        if isinstance(self.class_weight, dict):
            _check_class_weight(self.class_weight, classes)
        if self.probability:
            _calibration_folds(classes, counts)

    def _check_trainer(self, trainer, y, sample_weight):
        # The SVM learns from the rows the network trains on, which early stopping's
        # split decides: read from the split its fit will draw, before it trains (a
        # refusal after it cost the whole fit). probability=True's folds need 2 samples
        # of every class there, and the SVM's weights (which routing may keep from the
        # trainer, whose own check then does not see them) two weighted classes.
        if not getattr(trainer, "early_stopping", False) or (
                not self.probability and sample_weight is None):
            return
        labels = column_or_1d(y)
        rows = holdout_rows(trainer, labels)
        if sample_weight is not None:
            _check_weighted_classes(labels[rows], sample_weight[rows],
                                    " of early_stopping's training part")
        if self.probability:
            classes, counts = np.unique(labels[rows], return_counts=True)
            _calibration_folds(classes, counts, held_out=len(labels) - len(rows))

    def _check_weighted(self, X, y, sample_weight):
        # The SVM takes the weights even where routing kept them from the trainer, which
        # would otherwise have refused them: refused before it trains, not after.
        if sample_weight is not None:
            _check_weighted_classes(column_or_1d(y), sample_weight)

    def _kernel(self):
        kernel = TangentKernel if self._svm_kernel == "tangent" else PathKernel
        # Of the network itself: the rows it is given are the network's input already
        # (validated, or X_fit_), which a kernel of this estimator would take as its own
        # X, through the steps of a pipeline holding the network again.
        return kernel(self.network_, normalized=self._normalize)

    def _features(self, X):
        """What the linear SVM reads of an ``X`` validated already (``X_fit_``, or
        ``_svm_input``'s): validated again, rows from a DataFrame fit warned that they
        had no feature names."""
        phi = self._tangent_features(X, validated=True)
        return _unit_rows(phi) if self._normalize else phi

    @runs_fitted_module
    def _svm_input(self, X):
        """What ``svm_`` reads: tangent features, or Gram rows against the training set."""
        X = self._validate_X(X)
        if self._svm_kernel == "linear":
            with limit_torch_threads(kernel_threads(len(X) * self.n_params_)):
                return self._features(X)
        kernel = self._kernel()  # its own threads for its size
        # Fixed-size row blocks: a row's float32 Gram entries never depend on the others.
        # Padded with a training point, whose kernel row was finite in fit: an
        # overflowing query is then counted once in the kernel's error, not per copy.
        return map_fixed_blocks(lambda xb: kernel(xb, self.X_fit_), X, feature_block_rows(
            self._budget(), 8 * len(self.X_fit_), "The SVM's kernel rows"),
            fill=self.X_fit_[:1].astype(X.dtype, copy=False))

    @keep_previous_fit_on_error
    def fit(self, X, y, sample_weight=None, **fit_params):
        """Fit the network trainer on (X, y), then the SVM on its tangent features or kernel.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features) or (n_samples, ...)
            2-D for the default MLP; with a trainer's ``module``, any
            ``(n_samples, ...)`` array: floats, or integer token ids.
        y : array-like of shape (n_samples,)
            Class labels (binary or multi-class).
        sample_weight : array-like of shape (n_samples,), default=None
            Non-negative weights, relative as the trainer's (see
            :meth:`PathKernelClassifier.fit`, which receives them unless frozen): the SVM
            gets them rescaled to mean 1 (``SVC.fit``'s weights multiply ``C``, so that
            ``C`` keeps its meaning and equal weights are the unweighted fit), and
            ``C="auto"`` scores its folds by weighted accuracy. With
            ``sklearn.set_config(enable_metadata_routing=True)`` the trainer receives
            them only where it requested them (``set_fit_request(sample_weight=True)``;
            an error where it did not say), and the SVM takes them either way.
        **fit_params : dict
            Only with ``sklearn.set_config(enable_metadata_routing=True)``: metadata
            routed to the trainer's ``fit`` (an unfrozen ``Pipeline`` given as
            ``estimator`` routes each of its steps what it requested, as
            ``Pipeline.fit`` does), such as a weight under the alias the trainer
            requested (``set_fit_request(sample_weight="w")``, then ``fit(X, y,
            w=weights)``), as scikit-learn's ``MultiOutputRegressor`` routes them; the
            SVM takes ``sample_weight`` alone (its own, as ``CalibratedClassifierCV``'s
            calibrator). Without routing they are refused, as by ``BaggingRegressor``.

        Returns
        -------
        self : TangentFeatureSVM
        """
        validate_params(self)
        inner = self._trainer()[0]
        if isinstance(inner, RecordedNetwork) and trained_task(inner) != "classification":
            # As a PathKernelMachine is refused: the SVM classifies with what a network
            # learned of the classes.
            raise ValueError(
                "TangentFeatureSVM takes a network trained as a classifier: a "
                "RecordedNetwork declared with loss='log_loss' (PathRecorder.as_estimator"
                "(..., loss='log_loss')); got one declared with loss "
                f"{inner.network_.loss.name!r}. For the tangent features of any network: "
                "make_pipeline(TangentFeatures(net), SVC()).")
        # Never half-fitted: keep_previous_fit_on_error restores the previous fit whole
        # when the network or the SVM fails.
        X, y, frozen, weights = self._fit_trainer(X, y, sample_weight=sample_weight,
                                                  fit_params=fit_params)
        # The kernel choice and its normalization are part of the fitted state:
        # set_params must not change what an already fitted svm_ reads.
        self._svm_kernel, self._normalize = self.svm_kernel, self.normalize
        # A column y: the trainer has warned already, unless frozen.
        labels = column_or_1d(y, warn=frozen)
        # Early stopping held rows out: the SVM learns from the rows the network did.
        labels = labels[self.train_indices_]
        weights = None if weights is None else weights[self.train_indices_]
        weights = mean_one(weights)
        # libsvm rather than liblinear's LinearSVC: tangent features have norms in the
        # tens, where liblinear (which also penalizes the intercept) needs 10^4+
        # iterations on the data of figure 3 and libsvm converges in milliseconds.
        kernel = "linear" if self.svm_kernel == "linear" else "precomputed"
        if kernel == "linear":
            with limit_torch_threads(kernel_threads(len(self.X_fit_) * self.n_params_)):
                train_input = self._features(self.X_fit_)
        else:
            # The training Gram is symmetric: computed as K(X, X), its upper blocks only.
            train_input = self._kernel()(self.X_fit_)
        # Each class's weight as SVC(class_weight=...) computes it from these labels,
        # and each row's class index.
        classes, index, counts = np.unique(labels, return_inverse=True, return_counts=True)
        per_class = compute_class_weight(self.class_weight, classes=classes, y=labels)
        C = self.C
        if C == "auto":
            gram = train_input @ train_input.T if kernel == "linear" else train_input
            # The folds' SVMs weigh the classes as svm_ does (libsvm's C of a sample is
            # C * class_weight[y] * sample_weight) and so are the folds' accuracies.
            fold_weights = weights if self.class_weight is None else (
                per_class[index] if weights is None else weights * per_class[index])
            # Normalized, the scale is 1 (as documented), not the mean of a diagonal of
            # rounded ones: "linear" (unit rows in float32) chose C_ = 999.99999 where
            # "tangent", the same SVM, chose 1000.
            C = _choose_C(np.asarray(gram, dtype=np.float64), labels, fold_weights,
                          1.0 if self._normalize else None)
        self.__dict__.pop("calibrated_svm_", None)
        if self.probability:
            # Deterministic folds: SVC(probability=True) drew them at random (and is
            # deprecated). Its cross_val_predict encodes the labels as class indices,
            # where a class_weight keyed by labels would weigh the wrong class (or fail):
            # the calibration is fitted on the indices, its SVC weighted by index.
            indexed = SVC(kernel=kernel, C=float(C), class_weight=None
                          if self.class_weight is None else dict(enumerate(per_class)))
            if weights is not None and _routing_enabled():
                # CalibratedClassifierCV routes the weights only where they were asked.
                indexed.set_fit_request(sample_weight=True)
            self.calibrated_svm_ = CalibratedClassifierCV(
                indexed, method="sigmoid", ensemble=False,
                cv=StratifiedKFold(_calibration_folds(
                    classes, counts, held_out=len(y) - len(labels))),
            ).fit(train_input, index, sample_weight=weights)
        svm = SVC(kernel=kernel, C=float(C), class_weight=self.class_weight)
        svm.fit(train_input, labels, sample_weight=weights)
        self.svm_, self.C_ = svm, float(C)
        return self

    def decision_function(self, X):
        """The SVM's decision values on the tangent features (or kernel rows) of X.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features) or (n_samples, ...)
            In the form of the training inputs (``input_shape_``).

        Returns
        -------
        scores : ndarray of shape (n_samples,) or (n_samples, n_classes)
            As :meth:`sklearn.svm.SVC.decision_function`.
        """
        check_is_fitted(self)
        return self.svm_.decision_function(self._svm_input(X))

    def _has_proba(self):
        # Once fitted, the fit's choice, as PathKernelClassifier reads its fitted loss:
        # set_params(probability=...) after fit changes no fitted SVM.
        fitted = "svm_" in self.__dict__
        if "calibrated_svm_" in self.__dict__ or (not fitted and self.probability):
            return True
        raise AttributeError(
            f"predict_proba is not available when {'fitted with ' if fitted else ''}"
            "probability=False; fit with probability=True.")

    @available_if(_has_proba)
    def predict_proba(self, X):
        """Class probabilities: Platt scaling of the SVM's decision values.

        Only with ``probability=True`` (see ``probability``).

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features) or (n_samples, ...)
            In the form of the training inputs (``input_shape_``).

        Returns
        -------
        proba : ndarray of shape (n_samples, n_classes)
            Columns in the order of ``classes_``.
        """
        check_is_fitted(self)
        return self.calibrated_svm_.predict_proba(self._svm_input(X))

    @available_if(_has_proba)
    def predict_log_proba(self, X):
        """Logarithm of :meth:`predict_proba` (``np.log`` of it, as ``SVC``'s).

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features) or (n_samples, ...)
            In the form of the training inputs (``input_shape_``).

        Returns
        -------
        log_proba : ndarray of shape (n_samples, n_classes)
            Columns in the order of ``classes_``.
        """
        return np.log(self.predict_proba(X))

    def predict(self, X):
        """Predicted class labels.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features) or (n_samples, ...)
            In the form of the training inputs (``input_shape_``).

        Returns
        -------
        y_pred : ndarray of shape (n_samples,)
            The SVM's predicted classes.
        """
        check_is_fitted(self)
        return self.svm_.predict(self._svm_input(X))

    def transform(self, X):
        """Tangent features phi(x) at the final parameters (see :class:`TangentFeatures`).

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features) or (n_samples, ...)
            In the form of the training inputs (``input_shape_``).

        Returns
        -------
        phi : ndarray of shape (n_samples, `n_params_`) or (n_samples, `n_outputs_` * `n_params_`)
            One row per sample, columns in ``trajectory_`` flat order.
        """
        return self._tangent_features(X)


def _check_class_weight(class_weight: dict, classes) -> None:
    """Refuse a label that is not a class (SVC's own check lets one through where every
    class has a weight) and a weight that is not positive or not finite (libsvm fits a
    class of weight 0 with C = 0, and SVC then fails, after the network trained, on "dual
    coefficients or intercepts [that] are not finite")."""
    known = set(classes.tolist())
    unknown = [label for label in class_weight if label not in known]
    if unknown:
        raise ValueError(
            f"class_weight has weights for {unknown}, which are not classes of y: "
            f"{classes.tolist()}.")
    bad = {label: w for label, w in class_weight.items()
           if not (isinstance(w, numbers.Real) and np.isfinite(w) and w > 0)}
    if bad:
        raise ValueError(
            f"class_weight's weights must be finite and positive; got {bad}. To leave a "
            "class out, fit without its samples.")


def _calibration_folds(classes, counts, held_out=0) -> int:
    """probability=True's folds: 5, as libsvm's, or the smallest class's size.

    ``held_out``: the rows early stopping keeps from the network and the SVM (checked
    before training on the split its fit will draw, and again after it on the rows
    left: y's own counts were checked before)."""
    if counts.min() < 2:
        where = "" if not held_out else (
            f" of the rows the network trains on (early stopping holds out {held_out} "
            "for validation)")
        raise ValueError(
            "probability=True fits its sigmoid to cross-validated decision values, which "
            "needs 2 samples of every class; class "
            f"{classes.tolist()[np.argmin(counts)]!r} has 1{where}. Fit with "
            "probability=False" + (", or without early stopping." if held_out else "."))
    return int(min(5, counts.min()))


# C="auto"'s candidates, in units of the kernel's scale (the mean of the Gram's diagonal).
AUTO_C = (0.1, 1.0, 10.0, 100.0, 1000.0)


def _choose_C(gram: np.ndarray, labels, sample_weight=None, scale=None) -> float:
    """The C of ``AUTO_C / scale`` with the best 3-fold cross-validated accuracy.

    ``scale``: the kernel's scale, None for the mean of the Gram's diagonal.

    Stratified folds in the order of the training set (no shuffling: deterministic),
    each fold's SVM fitted on the Gram's rows and columns of its training part; the mean
    accuracy over the folds decides, the smaller C on ties (GridSearchCV's choice,
    without its per-candidate overhead, which cost more than these small SVMs). With a
    class too small for two folds, no cross-validation: ``1 / scale``. With
    ``sample_weight`` (TangentFeatureSVM's sample weights times its class weights: libsvm
    multiplies ``C`` by both alike) each fold's SVM is fitted with its part of the
    weights and scored by weighted accuracy. A fold whose held-out part weighs nothing,
    or whose training part gives positive weight to fewer than two classes (libsvm
    refuses to fit it), is not scored; with no fold left, ``1 / scale``.
    """
    if scale is None:
        scale = float(np.mean(np.diag(gram)))
        scale = scale if np.isfinite(scale) and scale > 0 else 1.0
    grid = [c / scale for c in AUTO_C]
    labels = np.asarray(labels)
    n_folds = min(3, int(np.unique(labels, return_counts=True)[1].min()))
    if n_folds < 2:
        return 1.0 / scale
    weights = np.ones(len(labels)) if sample_weight is None else sample_weight
    # Each fold's blocks of the Gram are cut once for the whole grid.
    folds = [(gram[np.ix_(tr, tr)], gram[np.ix_(te, tr)], labels[tr], labels[te],
              None if sample_weight is None else weights[tr], weights[te])
             for tr, te in StratifiedKFold(n_folds).split(gram, labels)
             if weights[te].sum() > 0 and len(np.unique(labels[tr][weights[tr] > 0])) > 1]
    if not folds:
        return 1.0 / scale
    best, best_score = grid[0], -np.inf
    for C in grid:
        score = np.mean([
            np.average(SVC(kernel="precomputed", C=C).fit(g_tr, y_tr, sample_weight=w_tr)
                       .predict(g_te) == y_te, weights=w_te)
            for g_tr, g_te, y_tr, y_te, w_tr, w_te in folds])
        if score > best_score:
            best, best_score = C, score
    return float(best)


for _cls in (TangentFeatures, TangentFeatureSVM):
    _cls.__doc__ = _cls.__doc__.format(estimator=ESTIMATOR_DOC, fitted=FITTED_DOC)
