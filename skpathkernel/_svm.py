"""TangentFeatures and TangentFeatureSVM: learned tangent features for kernel methods.

A trained network's tangent features ``phi(x) = d f(x; theta_T) / d theta`` are a learned
feature map; a linear model on them (or an SVC on the tangent / path kernel they define)
is figure 3 of Guo, He & Morel (2026).
"""

from __future__ import annotations

import numbers

import numpy as np
from sklearn.base import ClassifierMixin, TransformerMixin
from sklearn.svm import SVC
from sklearn.utils import check_random_state
from sklearn.utils._param_validation import Interval, StrOptions
from sklearn.utils.multiclass import type_of_target
from sklearn.utils.validation import check_is_fitted, column_or_1d

from . import _tangent
from ._base import (
    BasePathKernelNetwork,
    declare_feature_dtype,
    feature_block_rows,
    keep_previous_fit_on_error,
    map_fixed_blocks,
    tangent_feature_names,
)
from ._device import to_numpy
from ._machine import (
    _check_labels,
    _doc,
    _encode_labels,
    _label_tensor,
    _LabelTargetsMixin,
)
from .kernels import PathKernel, TangentKernel

__all__ = ["TangentFeatureSVM", "TangentFeatures"]

_CLASSIFICATION_TARGETS = ("binary", "multiclass")


def _unit_rows(phi: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(phi, axis=1, keepdims=True)
    # A zero row (a dead network at x) has no direction: it stays zero.
    return phi / np.where(norms > 0, norms, 1).astype(phi.dtype, copy=False)


@_doc
class TangentFeatures(TransformerMixin, BasePathKernelNetwork):
    """Learned tangent features: train a network on (X, y), then map x to phi(x).

    ``fit`` trains the network (recording its path like every skpathkernel estimator);
    ``transform`` returns ``phi(x) = d f(x; theta_T) / d theta`` at the final parameters,
    one dense row of ``n_params_`` features per sample, or a seeded random projection of
    it with ``n_components``. Inner products of the rows are the tangent kernel
    (:class:`~skpathkernel.TangentKernel`), so a linear model on them is a kernel machine
    with the network's learned kernel.

    Parameters
    ----------{shared}
    task : {{"auto", "regression", "classification"}}, default="auto"
        What the network is trained on. "auto" follows
        :func:`sklearn.utils.multiclass.type_of_target`, as scikit-learn does to choose a
        stratified split: binary and multi-class targets (integers, strings, floats with
        integral values and at most a few distinct values are all "multiclass" to it) are
        classification, anything else (continuous, multi-output) regression. Pass
        "regression" to regress on integer-valued targets.
    loss : {{"auto", "squared_error", "log_loss"}}, default="auto"
        "auto": "squared_error" for regression, "log_loss" for classification. See
        :class:`PathKernelMachine` and :class:`PathKernelClassifier` for their meaning.
    n_components : int, default=None
        ``None`` returns the exact tangent features. An int returns a Johnson-Lindenstrauss
        projection ``z(x)`` with ``E[z(x) . z(x')] = K(x, x')``, computed without forming
        the features of ``nn.Linear`` layers (Kronecker-structured Gaussian directions),
        seeded from ``random_state`` at fit time.
    normalize : bool, default=False
        Scale every row to unit Euclidean norm (the normalized tangent kernel).{normalize_y}

    Attributes
    ----------
    task_ : str
        "regression" or "classification", as resolved at fit.
    classes_ : ndarray of shape (n_classes,)
        Class labels, for classification only.{fitted}
    See Also
    --------
    TangentFeatureSVM : A linear SVM on these features, or an SVC on their kernel.
    PathKernelMachine.transform : The same features from the regressor.

    Notes
    -----
    With ``C > 1`` network outputs (multi-class logits, multi-output regression) the row
    is the flattened Jacobian divided by ``sqrt(C)``: its inner products are the trace
    tangent kernel ``trace(J(x) J(x')^T) / C``.

    Examples
    --------
    >>> from skpathkernel import TangentFeatures
    >>> from skpathkernel.datasets import make_circle
    >>> X, y = make_circle(n_samples=60, random_state=0)
    >>> tf = TangentFeatures(hidden_layer_sizes=(8,), max_iter=20, random_state=0)
    >>> phi = tf.fit_transform(X, y)
    >>> tf.task_, phi.shape, tf.n_params_
    ('classification', (60, 33), 33)
    >>> tf.get_feature_names_out()[:2].tolist()
    ['0.weight[0]', '0.weight[1]']
    >>> tf.set_params(n_components=5).fit_transform(X, y).shape
    (60, 5)
    """

    _parameter_constraints = {
        **BasePathKernelNetwork._parameter_constraints,
        "task": [StrOptions({"auto", "regression", "classification"})],
        "loss": [StrOptions({"auto", "squared_error", "log_loss"})],
        "n_components": [Interval(numbers.Integral, 1, None, closed="left"), None],
        "normalize": ["boolean"],
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
        loss="auto",
        record_every="auto",
        device="auto",
        dtype="float32",
        memory_budget=2**30,
        trajectory_storage="memory",
        trajectory_dir=None,
        trajectory_compression=None,
        random_state=None,
        verbose=0,
        task="auto",
        n_components=None,
        normalize=False,
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
        self.task = task
        self.n_components = n_components
        self.normalize = normalize
        self.normalize_y = normalize_y

    def _validate_y(self, X, y):
        # No y_numeric: class labels may be strings; regression checks numbers below.
        return self._validate_fit_data(X, y, multi_output=True)

    def _encode_targets(self, y):
        task = self.task
        if task == "auto":
            kind = type_of_target(y, input_name="y", raise_unknown=True)
            task = "classification" if kind in _CLASSIFICATION_TARGETS else "regression"
        if task == "classification":
            _check_labels(self, y)
            loss = "log_loss" if self.loss == "auto" else self.loss
            Y, n_outputs, attrs = _encode_labels(y, loss)
        else:
            if self.loss == "log_loss":
                raise ValueError(
                    "loss='log_loss' needs class labels, but the task is regression "
                    f"(task={self.task!r}); use loss='auto' or 'squared_error'."
                )
            if y.dtype.kind not in "biuf":
                raise ValueError(
                    f"Regression needs numeric targets, got dtype {y.dtype}; pass "
                    "task='classification' for labels."
                )
            loss = "squared_error"
            Y = np.asarray(y, dtype=np.float64).reshape(len(y), -1)
            n_outputs, attrs = Y.shape[1], {}
        attrs.update(task_=task, _loss_name=loss)
        return Y, n_outputs, attrs

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
        y : array-like of shape (n_samples,) or (n_samples, n_outputs)
            Regression targets or class labels (see ``task``).

        Returns
        -------
        self : TangentFeatures
        """
        self._validate_params()
        # Drawn after the training seed, so that the directions differ from the init's.
        seed = int(check_random_state(self.random_state).randint(2**31 - 1, size=2)[1])
        self._fit(X, y)
        self._projection_seed = seed
        return self

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
            or ``n_components``; in the network's dtype.
        """
        if self.n_components is None:
            phi = self._tangent_features(X)
        else:
            module, params, X_t = self._engine_inputs(X)
            exclude = _tangent.hidden_reads(module, [params], [X_t], output="trace",
                                            memory_budget=self.memory_budget)
            itemsize = X_t.element_size()
            # Fixed-size blocks: a row's float32 features do not depend on the others.
            phi = map_fixed_blocks(
                lambda xb: to_numpy(_tangent.project_tangent_features(
                    module, params, xb, self.n_components,
                    random_state=self._projection_seed, output="trace",
                    memory_budget=self.memory_budget, exclude=exclude, check_hidden=False)),
                X_t, feature_block_rows(self.memory_budget, self.n_components * itemsize,
                                        "The projected tangent features"))
        return _unit_rows(phi) if self.normalize else phi

    def get_feature_names_out(self, input_features=None):
        """Output feature names.

        ``"<parameter>[<index>]"`` for the exact features (``"out<c>:..."`` per output
        when there are several), ``"tangentfeatures<k>"`` for a projection.

        Parameters
        ----------
        input_features : array-like of str or None, default=None
            Ignored; the names come from the network's parameters.

        Returns
        -------
        feature_names_out : ndarray of str objects
        """
        check_is_fitted(self)
        if self.n_components is None:
            return tangent_feature_names(self.trajectory_, self.n_outputs_)
        prefix = type(self).__name__.lower()
        return np.asarray([f"{prefix}{k}" for k in range(self.n_components)], dtype=object)

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.target_tags.required = True
        return declare_feature_dtype(tags, self)


@_doc
class TangentFeatureSVM(_LabelTargetsMixin, ClassifierMixin, TransformerMixin,
                        BasePathKernelNetwork):
    """Support vector classifier on a network's tangent features (Guo, He & Morel, fig. 3).

    ``fit`` trains the network as a classifier on (X, y), then an SVM on what it learned:
    a linear SVM on the tangent features ``phi(x)``, or an SVC on the tangent or path
    kernel. Each sample enters the SVM through ``phi(x)``, not through its coordinates.

    Parameters
    ----------{shared}
    loss : {{"log_loss", "squared_error"}}, default="log_loss"
        The network's training loss, as in :class:`PathKernelClassifier`.
    C : float, default=1.0
        The SVM's regularization (larger: less regularization).
    svm_kernel : {{"linear", "tangent", "path"}}, default="tangent"
        "linear": ``SVC(kernel="linear")`` on the dense tangent features at the final
        parameters (``svm_.coef_`` is then a direction in parameter space). "tangent" /
        "path": ``SVC(kernel="precomputed")`` on the Gram of the
        :class:`~skpathkernel.TangentKernel` / :class:`~skpathkernel.PathKernel` over the
        training set. "linear" and "tangent" are the same SVM (the tangent kernel is the
        linear kernel of ``phi``): "tangent" never forms ``phi`` for ``nn.Linear`` layers
        and is much cheaper (on sklearn's digits, ``phi`` of the default network is
        89,700 wide: the linear SVM on it takes minutes, the Gram a fraction of a
        second), "linear" exposes ``coef_``.

    Attributes
    ----------
    svm_ : SVC
        The fitted SVM; it reads tangent features ("linear") or Gram rows against
        ``X_fit_`` ("tangent", "path").
    classes_ : ndarray of shape (n_classes,)
        Class labels.{fitted}
    See Also
    --------
    TangentFeatures : The transformer alone, for any estimator in a Pipeline.
    PathKernelClassifier : The network's own predictions.

    Examples
    --------
    >>> from skpathkernel import TangentFeatureSVM
    >>> from skpathkernel.datasets import make_circle
    >>> X, y = make_circle(n_samples=100, inner_radius_sq=0.9, random_state=0)
    >>> svm = TangentFeatureSVM(hidden_layer_sizes=(16,), solver="adam", max_iter=100,
    ...                         learning_rate_init=0.02, random_state=0).fit(X, y)
    >>> type(svm.svm_).__name__, bool(svm.score(X, y) > 0.9)
    ('SVC', True)
    """

    _parameter_constraints = {
        **BasePathKernelNetwork._parameter_constraints,
        "loss": [StrOptions({"log_loss", "squared_error"})],
        "C": [Interval(numbers.Real, 0, None, closed="neither")],
        "svm_kernel": [StrOptions({"linear", "tangent", "path"})],
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
        C=1.0,
        svm_kernel="tangent",
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
        self.C = C
        self.svm_kernel = svm_kernel

    def _kernel(self):
        return (TangentKernel if self._svm_kernel == "tangent" else PathKernel)(self)

    def _svm_input(self, X):
        """What ``svm_`` reads: tangent features, or Gram rows against the training set."""
        if self._svm_kernel == "linear":
            return self._tangent_features(X)
        X = self._validate_X(X)
        kernel = self._kernel()
        # Fixed-size row blocks: a row's float32 Gram entries never depend on the others.
        return map_fixed_blocks(lambda xb: kernel(xb, self.X_fit_), X, feature_block_rows(
            self.memory_budget, 8 * len(self.X_fit_), "The SVM's kernel rows"))

    @keep_previous_fit_on_error
    def fit(self, X, y):
        """Train the network on (X, y), then the SVM on its tangent features or kernel.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features) or (n_samples, ...)
            2-D for the default MLP; with ``module``, any ``(n_samples, ...)`` array:
            floats, or integer token ids.
        y : array-like of shape (n_samples,)
            Class labels (binary or multi-class).

        Returns
        -------
        self : TangentFeatureSVM
        """
        self._validate_params()
        # Never half-fitted: keep_previous_fit_on_error restores the previous fit whole
        # when the network or the SVM fails.
        self._fit(X, y)
        # The kernel choice is part of the fitted state: set_params must not change
        # what an already fitted svm_ reads.
        self._svm_kernel = self.svm_kernel
        labels = column_or_1d(y, warn=False)  # _fit has validated y; no second warning
        if self._train_rows is not None:
            # Early stopping held rows out: the SVM learns from the rows the network did.
            labels = labels[self._train_rows]
        # libsvm rather than liblinear's LinearSVC: tangent features have norms in the
        # tens, where liblinear (which also penalizes the intercept) needs 10^4+
        # iterations on the data of figure 3 and libsvm converges in milliseconds.
        kernel = "linear" if self.svm_kernel == "linear" else "precomputed"
        svm = SVC(kernel=kernel, C=self.C)  # deterministic: no probability, no RNG
        # The training Gram is symmetric: computed as K(X, X), its upper blocks only.
        svm.fit(self._tangent_features(self.X_fit_) if kernel == "linear"
                else self._kernel()(self.X_fit_), labels)
        self.svm_ = svm
        return self

    def decision_function(self, X):
        """The SVM's decision values on the tangent features (or kernel rows) of X.

        Returns
        -------
        scores : ndarray of shape (n_samples,) or (n_samples, n_classes)
        """
        check_is_fitted(self)
        return self.svm_.decision_function(self._svm_input(X))

    def predict(self, X):
        """Predicted class labels."""
        check_is_fitted(self)
        return self.svm_.predict(self._svm_input(X))

    def transform(self, X):
        """Tangent features phi(x) at the final parameters (see :class:`TangentFeatures`).

        Returns
        -------
        phi : ndarray of shape (n_samples, `n_params_`) or (n_samples, `n_outputs_` * `n_params_`)
        """
        return self._tangent_features(X)

    def get_feature_names_out(self, input_features=None):
        """Names of the tangent features: ``"<parameter>[<index>]"``."""
        check_is_fitted(self)
        return tangent_feature_names(self.trajectory_, self.n_outputs_)

    def __sklearn_tags__(self):
        return declare_feature_dtype(super().__sklearn_tags__(), self)
