"""The training parameters of the network trainers, declared once.

Each :class:`NetworkParameter` holds a parameter's name, default, scikit-learn constraints
and documentation. From this table come ``BasePathKernelNetwork._parameter_constraints``
and the shared "Parameters" entries of the trainers' docstrings (:class:`PathKernelMachine`,
:class:`PathKernelClassifier`; the meta-estimators take a trainer as ``estimator=`` and
own none of these). The ``__init__`` signatures stay written out (scikit-learn reads
parameters from the signature, and a written signature is what users and their tools
see); ``tests/test_params.py`` checks each of them, each trainer's constraints and each
docstring against this table, and names what disagrees. Adding a parameter: one entry
here, then the two signatures and the base's ``__init__``.

``loss`` is shared by name and position (after ``shuffle``) but not by meaning: its default,
options and documentation are each trainer's own.
"""

from __future__ import annotations

import dataclasses
import numbers
import os
import textwrap

import torch
from sklearn.utils._param_validation import Interval, StrOptions

__all__ = [
    "ACTIVATIONS",
    "LOSS_AFTER",
    "NETWORK_PARAMETERS",
    "NetworkParameter",
    "network_constraints",
    "network_params_doc",
    "signature_names",
]

# The default MLP's activations, by the name ``activation`` takes.
ACTIVATIONS = {
    "relu": torch.nn.ReLU,
    "tanh": torch.nn.Tanh,
    "gelu": torch.nn.GELU,
    "softplus": torch.nn.Softplus,
    "identity": torch.nn.Identity,
}


@dataclasses.dataclass(frozen=True)
class NetworkParameter:
    """One shared parameter: what the signature, the constraints and the docs must say."""

    name: str
    default: object
    constraints: tuple
    type: str
    doc: str
    # How the docs write the default, where repr() is not how a user writes it (2**30).
    default_doc: str | None = None

    def default_text(self) -> str:
        if self.default_doc is not None:
            return self.default_doc
        if isinstance(self.default, str):
            return f'"{self.default}"'
        return repr(self.default)

    def doc_entry(self) -> str:
        """The numpydoc entry, indented as in a class docstring."""
        body = textwrap.indent(textwrap.dedent(self.doc).strip(), " " * 8)
        return f"    {self.name} : {self.type}, default={self.default_text()}\n{body}\n"


def _positive_int(low=1):
    return Interval(numbers.Integral, low, None, closed="left")


NETWORK_PARAMETERS: tuple[NetworkParameter, ...] = (
    NetworkParameter(
        "hidden_layer_sizes", (64, 64), ("array-like", _positive_int()), "array-like of int",
        """
        Widths of the hidden layers of the default MLP (ignored when ``module`` is given).
        """),
    NetworkParameter(
        "activation", "gelu", (StrOptions(set(ACTIVATIONS)),),
        '{"relu", "tanh", "gelu", "softplus", "identity"}',
        """
        Activation of the default MLP. The default is smooth, which keeps the exact
        decomposition exact: "relu"'s kinks cost it about 1e-4 (see the user guide,
        "Training"), and "tanh" is what Guo, He & Morel (2026) used.
        """),
    NetworkParameter(
        "module", None, (callable, None), "callable",
        """
        ``module(n_features_in, n_outputs) -> torch.nn.Module`` replacing the default MLP.
        Any module without cross-sample state (no BatchNorm in train mode) works. It is
        called with torch's global RNG seeded from ``random_state`` (and restored after).
        With a module, ``X`` may have any shape ``(n_samples, ...)``: float images
        ``(n, C, H, W)`` or sequences ``(n, S, d)`` are handed to it in ``dtype``, integer
        token ids ``(n, S)`` as int64 (``n_features_in`` is then the number of values
        per sample); see the user guide, "Images, sequences and token ids".
        """),
    NetworkParameter(
        "solver", "adam", (StrOptions({"sgd", "adam", "adamw", "rmsprop"}),),
        '{"sgd", "adam", "adamw", "rmsprop"}',
        """
        The torch.optim optimizer whose path is recorded. Adam (MLPClassifier's default)
        learns at one step size whatever the scale of X; SGD keeps each step of the path
        kernel a structured Gram (Adam's preconditioner makes it a dense product, 20-50
        times slower) and is Domingos' setting (see ``batch_size``).
        """),
    NetworkParameter(
        "learning_rate_init", 1e-3, (Interval(numbers.Real, 0, None, closed="neither"),),
        "float",
        """
        Step size (MLPClassifier's; plain SGD wants a larger one, e.g. 0.1).
        """),
    NetworkParameter(
        "learning_rate", "constant", (StrOptions({"constant", "invscaling", "adaptive"}),),
        '{"constant", "invscaling", "adaptive"}',
        """
        Step-size schedule of ``solver="sgd"`` (MLPClassifier's; the other solvers keep
        ``learning_rate_init``). "constant": ``learning_rate_init`` throughout.
        "invscaling": an epoch that starts after ``t`` samples were seen (``t`` counts
        across ``warm_start`` fits and ``partial_fit`` calls) steps with
        ``learning_rate_init / (t + 1) ** power_t``. "adaptive": the step size is divided
        by 5 whenever more than ``n_iter_no_change`` consecutive epochs fail to improve
        by ``tol`` (the stopping rule), and training stops when it is at most 1e-6. The
        recorded path holds every step's size (``trajectory_.learning_rates``), so the
        kernels and the decomposition follow the schedule exactly.
        """),
    NetworkParameter(
        "power_t", 0.5, (Interval(numbers.Real, 0, None, closed="left"),), "float",
        """
        Exponent of ``learning_rate="invscaling"`` (sgd only).
        """),
    NetworkParameter(
        "momentum", 0.0, (Interval(numbers.Real, 0, 1, closed="left"),), "float",
        """
        Heavy-ball momentum, used by ``solver="sgd"`` only (torch.optim.SGD's convention).
        """),
    NetworkParameter(
        "nesterovs_momentum", False, ("boolean",), "bool",
        """
        Nesterov's momentum instead of heavy-ball (``solver="sgd"`` with ``momentum > 0``
        only; torch.optim.SGD's ``nesterov``). Off by default, unlike MLPClassifier: the
        path kernel, :meth:`decompose` and :meth:`attribute` model heavy-ball momentum
        and refuse a Nesterov path with a clear error.
        """),
    NetworkParameter(
        "alpha", 0.0, (Interval(numbers.Real, 0, None, closed="left"),), "float",
        """
        Weight decay: L2 added to the gradient (``grad + alpha * theta``, all parameters)
        for sgd, adam and rmsprop; decoupled weight decay for adamw. Unlike MLPRegressor it
        is not divided by the number of samples and applies to biases too.
        """),
    NetworkParameter(
        "beta_1", 0.9, (Interval(numbers.Real, 0, 1, closed="left"),), "float",
        """
        Adam / AdamW decay of the first moment (the running mean of the gradient).
        """),
    NetworkParameter(
        "beta_2", 0.999, (Interval(numbers.Real, 0, 1, closed="left"),), "float",
        """
        Adam / AdamW decay of the second moment (RMSprop's smoothing constant is torch's
        default, 0.99).
        """),
    NetworkParameter(
        "epsilon", 1e-8, (Interval(numbers.Real, 0, None, closed="neither"),), "float",
        """
        The epsilon of Adam's, AdamW's and RMSprop's denominator.
        """, default_doc="1e-8"),
    NetworkParameter(
        "batch_size", "auto", (_positive_int(), StrOptions({"auto"}), None),
        'int, "auto" or None',
        """
        Samples per optimizer step. "auto" is ``min(200, n_samples)`` (MLPClassifier's);
        ``None`` trains on the whole training set at every step; with ``solver="sgd"``
        (no momentum) that is Domingos' full-batch gradient descent.
        """),
    NetworkParameter(
        "max_iter", 200, (_positive_int(),), "int",
        """
        Most epochs (passes over the training set).
        """),
    NetworkParameter(
        "tol", 1e-4, (Interval(numbers.Real, 0, None, closed="left"), None), "float or None",
        """
        Stopping tolerance, with MLPClassifier's meaning: training stops when for more
        than ``n_iter_no_change`` consecutive epochs the training loss has not gone below
        its best value minus ``tol`` (with ``early_stopping``: the validation score has
        not gone above its best value plus ``tol``). A ``ConvergenceWarning`` says when
        ``max_iter`` epochs end without that. ``None`` (SGDClassifier's convention) trains
        exactly ``max_iter`` epochs, with no warning: a path of fixed length.
        """, default_doc="1e-4"),
    NetworkParameter(
        "n_iter_no_change", 10, (_positive_int(),), "int",
        """
        Epochs without improvement by ``tol`` tolerated before stopping (one more stops).
        """),
    NetworkParameter(
        "early_stopping", False, ("boolean",), "bool",
        """
        Hold out ``validation_fraction`` of the training set (stratified for classes),
        score the network on it after every epoch (accuracy, or R^2) and stop on that
        score; the fitted network is then the one of the best-scoring epoch, as in
        MLPClassifier, and ``trajectory_`` ends at it. The held-out samples are not
        training points: ``X_fit_``, the kernels and :meth:`decompose` cover the others.
        """),
    NetworkParameter(
        "validation_fraction", 0.1, (Interval(numbers.Real, 0, 1, closed="neither"),),
        "float in (0, 1)",
        """
        Fraction of the training set held out by ``early_stopping``; it must leave at
        least two samples, and one of each class, on both sides.
        """),
    NetworkParameter(
        "shuffle", True, ("boolean",), "bool",
        """
        Reshuffle the samples every epoch (minibatch training only).
        """),
    NetworkParameter(
        "record_every", "auto", (_positive_int(), StrOptions({"auto"})), 'int or "auto"',
        """
        Record the parameters every ``record_every`` optimizer steps (and at the end).
        "auto": every step when the points of ``max_iter`` epochs fit in
        ``memory_budget`` bytes, else every k-th step with the smallest k that fits (see
        the user guide, "Training"). Every step (1) keeps the per-training-point
        decomposition exact; with k > 1 it is approximate (it warns and reports its true
        ``error``), and the path kernel is a Riemann sum.
        """),
    NetworkParameter(
        "device", "auto", (StrOptions({"auto", "cpu", "cuda"}),), '{"auto", "cpu", "cuda"}',
        """
        "auto" trains on CUDA when available, else on the CPU.
        """),
    NetworkParameter(
        "dtype", "float32", (StrOptions({"float32", "float64"}),), '{"float32", "float64"}',
        """
        Parameter dtype; float64 is for exactness checks.
        """),
    NetworkParameter(
        "memory_budget", 2**30, (_positive_int(2**20),), "int",
        """
        Bytes that one block of a computation (prediction, kernels) may use, and the
        most that the recorded points may take in memory with ``record_every="auto"``.
        """, default_doc="2**30"),
    NetworkParameter(
        "trajectory_storage", "memory", (StrOptions({"memory", "disk", "auto"}),),
        '{"memory", "disk", "auto"}',
        """
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
        the user guide, "Scaling").
        """),
    NetworkParameter(
        "trajectory_dir", None, (str, os.PathLike, None), "str, path-like or None",
        """
        Where ``trajectory_storage="disk"`` creates its directories; None is the
        system's temporary directory (``tempfile.gettempdir()``, ``TMPDIR``).
        """),
    NetworkParameter(
        "trajectory_compression", None, (StrOptions({"float16", "bfloat16"}), None),
        '{None, "float16", "bfloat16"}',
        """
        With the trajectory on disk, store each recorded point's parameters as its
        difference from the previous stored point in this dtype (the first point of
        each chunk file in full precision): about half the disk of float32 parameters
        (optimizer states stay in full precision). Lossy: each stored point is within
        one rounding of its step of the trained one, and the kernels and
        :meth:`decompose` read the stored path, so ``decompose(...).error`` reports
        what it costs (the contributions follow the stored points' gradients, the
        reconstruction the stored steps). ``trajectory_.parameters(-1)`` is the stored
        last point; ``module_`` keeps the trained one.
        """),
    NetworkParameter(
        "random_state", None, ("random_state",), "int, RandomState instance or None",
        """
        Seeds the initialization, the batch order and the early-stopping split: the same
        seed on the same device gives bit-identical results. A local generator is used;
        torch's global seed is untouched.
        """),
    NetworkParameter(
        "verbose", 0, ("verbose",), "int",
        """
        Show a progress bar (tqdm, when installed) with the training loss.
        """),
    NetworkParameter(
        "warm_start", False, ("boolean",), "bool",
        """
        ``fit`` continues from the fitted network and its optimizer's state (moments,
        step count, the schedule's step size) instead of a new initialization, and
        extends ``trajectory_``: one path from the first initialization to the last
        step, over which the kernels and :meth:`decompose` stay exact. On the same
        training data the batches index it as before; on other data the training set
        becomes the concatenation of both (as with ``partial_fit``). The network
        (``hidden_layer_sizes``, ``activation``, ``module``), the optimizer's rule
        (``solver``, ``momentum``, ``beta_1``, ...), ``dtype`` and the targets' encoding
        must be the previous fit's; the trajectory must be in memory.
        """),
)

# ``loss`` comes right after this parameter in every signature.
LOSS_AFTER = "shuffle"


def signature_names() -> tuple[str, ...]:
    """The first parameters of both trainers' ``__init__``, in order."""
    names = [p.name for p in NETWORK_PARAMETERS]
    names.insert(names.index(LOSS_AFTER) + 1, "loss")
    return tuple(names)


def network_constraints() -> dict:
    """``_parameter_constraints`` of the shared parameters (a new dict: extend it freely)."""
    return {p.name: list(p.constraints) for p in NETWORK_PARAMETERS}


def network_params_doc() -> str:
    """The shared "Parameters" entries, to follow a ``----------`` line."""
    return "\n" + "".join(p.doc_entry() for p in NETWORK_PARAMETERS)
