"""PathKernelMachine and PathKernelClassifier: a trained network and its kernel machine."""

from __future__ import annotations

import numpy as np
import torch
from scipy.special import expit, softmax
from sklearn.base import ClassifierMixin, RegressorMixin
from sklearn.preprocessing import LabelEncoder
from sklearn.utils._param_validation import StrOptions
from sklearn.utils.metaestimators import available_if
from sklearn.utils.multiclass import check_classification_targets, type_of_target
from sklearn.utils.validation import validate_data

from ._base import BasePathKernelNetwork
from ._device import to_tensor

__all__ = ["PathKernelClassifier", "PathKernelMachine"]

_SHARED_PARAMS_DOC = """
    hidden_layer_sizes : array-like of int, default=(64, 64)
        Widths of the hidden layers of the default MLP (ignored when ``module`` is given).
    activation : {"relu", "tanh", "gelu", "softplus", "identity"}, default="tanh"
        Activation of the default MLP.
    module : callable, default=None
        ``module(n_features_in, n_outputs) -> torch.nn.Module`` replacing the default MLP.
        Any module without cross-sample state (no BatchNorm in train mode) works. It is
        called with torch's global RNG seeded from ``random_state`` (and restored after).
    solver : {"sgd", "adam", "adamw", "rmsprop"}, default="sgd"
        The torch.optim optimizer whose path is recorded.
    learning_rate_init : float, default=0.01
        Step size.
    momentum : float, default=0.0
        Heavy-ball momentum, used by ``solver="sgd"`` only (torch.optim.SGD's convention).
    alpha : float, default=0.0
        Weight decay: L2 added to the gradient (``grad + alpha * theta``, all parameters)
        for sgd, adam and rmsprop; decoupled weight decay for adamw. Unlike MLPRegressor it
        is not divided by the number of samples and applies to biases too.
    beta_1, beta_2, epsilon : float, default=0.9, 0.999, 1e-8
        Adam / AdamW moment decays and the denominator's epsilon (epsilon is RMSprop's too;
        RMSprop's smoothing constant is torch's default, 0.99).
    batch_size : int, default=None
        ``None`` trains by full-batch gradient descent (Domingos' setting); an int trains
        by minibatch steps (the seeds' stochastic setting).
    max_iter : int, default=200
        Number of epochs. Training always runs all of them: the recorded path is the
        object of study, so there is no early stopping.
    shuffle : bool, default=True
        Reshuffle the samples every epoch (minibatch training only).
    record_every : int, default=1
        Record the parameters every ``record_every`` optimizer steps (and at the end).
        1 keeps the per-training-point decomposition exact.
    device : {"auto", "cpu", "cuda"}, default="auto"
        "auto" trains on CUDA when available, else on the CPU.
    dtype : {"float32", "float64"}, default="float32"
        Parameter dtype; float64 is for exactness checks.
    memory_budget : int, default=2**30
        Bytes that one block of a computation (prediction, kernels) may use.
    random_state : int, RandomState instance or None, default=None
        Seeds the initialization and the batch order: the same seed on the same device gives
        bit-identical results. A local generator is used; torch's global seed is untouched.
    verbose : int, default=0
        Show a progress bar (tqdm, when installed) with the training loss.
"""

_FITTED_ATTRS_DOC = """
    module_ : torch.nn.Module
        The trained network (on ``device_``).
    trajectory_ : Trajectory
        The recorded optimisation path.
    loss_curve_ : list of float
        Mean training loss of each epoch.
    n_iter_ : int
        Epochs run.
    t_ : int
        Optimizer steps taken.
    n_params_ : int
        Number of trainable parameters P.
    n_outputs_ : int
        Network outputs C.
    device_ : str
        Device the network lives on.
    n_features_in_ : int
        Number of features seen during fit.
    feature_names_in_ : ndarray of shape (n_features_in_,)
        Names of features seen during fit, when X has string column names.
"""


def _doc(cls):
    cls.__doc__ = cls.__doc__.format(shared=_SHARED_PARAMS_DOC, fitted=_FITTED_ATTRS_DOC)
    return cls


@_doc
class PathKernelMachine(RegressorMixin, BasePathKernelNetwork):
    """Regressor that trains a network and records its optimisation path.

    The trained network is, exactly, a kernel machine over its training set along the
    recorded path (Domingos 2020; Guo, He & Morel 2026).

    Parameters
    ----------{shared}
    loss : {{"squared_error"}}, default="squared_error"
        ``1/2 * mean squared error`` over samples and outputs (MLPRegressor's convention).

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
    >>> est = PathKernelMachine(hidden_layer_sizes=(32,), learning_rate_init=0.1,
    ...                         max_iter=300, random_state=0).fit(X, y)
    >>> est.score(X, y) > 0.9
    True
    >>> len(est.trajectory_)  # initialization + one point per full-batch step
    301
    """

    _parameter_constraints = {
        **BasePathKernelNetwork._parameter_constraints,
        "loss": [StrOptions({"squared_error"})],
    }

    def __init__(
        self,
        hidden_layer_sizes=(64, 64),
        *,
        activation="tanh",
        module=None,
        solver="sgd",
        learning_rate_init=0.01,
        momentum=0.0,
        alpha=0.0,
        beta_1=0.9,
        beta_2=0.999,
        epsilon=1e-8,
        batch_size=None,
        max_iter=200,
        shuffle=True,
        loss="squared_error",
        record_every=1,
        device="auto",
        dtype="float32",
        memory_budget=2**30,
        random_state=None,
        verbose=0,
    ):
        super().__init__(
            hidden_layer_sizes=hidden_layer_sizes, activation=activation, module=module,
            solver=solver, learning_rate_init=learning_rate_init, momentum=momentum,
            alpha=alpha, beta_1=beta_1, beta_2=beta_2, epsilon=epsilon,
            batch_size=batch_size, max_iter=max_iter, shuffle=shuffle, loss=loss,
            record_every=record_every, device=device, dtype=dtype,
            memory_budget=memory_budget, random_state=random_state, verbose=verbose,
        )

    def _encode_targets(self, y):
        self_y_2d = y.ndim == 2
        Y = y.reshape(len(y), -1)
        return Y, Y.shape[1], {"_y_2d": self_y_2d}

    def fit(self, X, y):
        """Train the network on (X, y), recording its path.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features)
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
        out = self._forward(X)
        return out if self._y_2d else out[:, 0]

    def __sklearn_tags__(self):
        tags = super().__sklearn_tags__()
        tags.target_tags.multi_output = True
        tags.target_tags.single_output = True
        return tags


@_doc
class PathKernelClassifier(ClassifierMixin, BasePathKernelNetwork):
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
        activation="tanh",
        module=None,
        solver="sgd",
        learning_rate_init=0.01,
        momentum=0.0,
        alpha=0.0,
        beta_1=0.9,
        beta_2=0.999,
        epsilon=1e-8,
        batch_size=None,
        max_iter=200,
        shuffle=True,
        loss="log_loss",
        record_every=1,
        device="auto",
        dtype="float32",
        memory_budget=2**30,
        random_state=None,
        verbose=0,
    ):
        super().__init__(
            hidden_layer_sizes=hidden_layer_sizes, activation=activation, module=module,
            solver=solver, learning_rate_init=learning_rate_init, momentum=momentum,
            alpha=alpha, beta_1=beta_1, beta_2=beta_2, epsilon=epsilon,
            batch_size=batch_size, max_iter=max_iter, shuffle=shuffle, loss=loss,
            record_every=record_every, device=device, dtype=dtype,
            memory_budget=memory_budget, random_state=random_state, verbose=verbose,
        )

    def _validate_y(self, X, y):
        X, y = validate_data(self, X, y, dtype=[np.float64, np.float32])
        check_classification_targets(y)
        kind = type_of_target(y)
        if kind not in ("binary", "multiclass"):
            raise ValueError(
                f"{type(self).__name__} supports binary and multi-class targets, got {kind}."
            )
        return X, y

    def _encode_targets(self, y):
        encoder = LabelEncoder().fit(y)
        classes = encoder.classes_
        if len(classes) < 2:
            raise ValueError(
                "The number of classes has to be greater than one; got "
                f"{len(classes)} class ({classes[0]!r}). A classifier needs at least two."
            )
        codes = encoder.transform(y)
        n_outputs = 1 if len(classes) == 2 else len(classes)
        if self.loss == "log_loss":
            Y = codes.astype(np.float64) if n_outputs == 1 else codes.astype(np.int64)
        elif n_outputs == 1:
            Y = (2.0 * codes - 1.0).reshape(-1, 1)
        else:
            Y = np.eye(len(classes))[codes]
        return Y, n_outputs, {"classes_": classes}

    def _target_tensor(self, Y, dtype, device):
        if Y.dtype == np.int64:
            return torch.as_tensor(Y, device=device)
        return to_tensor(Y, dtype=dtype, device=device)

    def fit(self, X, y):
        """Train the network on (X, y), recording its path.

        Parameters
        ----------
        X : array-like of shape (n_samples, n_features)
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
