"""Attribution scores from the decomposition, and the model output they explain.

The output function of training-data attribution for classifiers is the *margin* (TRAK,
Park et al. 2023): ``m(x, y) = log(p_y / (1 - p_y))`` with ``p`` the softmax of the logits,
that is ``f_y - logsumexp_{k != y} f_k``; for a binary network with one output ``f`` (the
logit of the second class) it is ``+f`` for the second class and ``-f`` for the first.

A multilabel network (one logit per label, each a binary problem) has no single class:
its margin is the sum of the per-label binary margins, ``sum_k s_k f_k`` with ``s_k = +1``
for a label that is on and ``-1`` for one that is off (the query's given labels, or the
predicted ones, ``f_k > 0``): how far the logits push the query towards that label set.

The decomposition splits the network's *outputs* exactly over the training points. The
binary margin is one of them (up to its sign), and the multilabel margin a signed sum of
them, so their split is exact. The multi-class margin
is not linear in the logits: its attribution is the exact split of its linear part at the
final logits, ``w . f`` with ``w = grad_f m(f(x; theta_T))`` (``w_y = 1``, ``w_k = -q_k``,
``q`` the softmax over the other classes), which is how much removing a training point moves
the margin to first order in the outputs.
"""

from __future__ import annotations

import numbers

import numpy as np
import scipy.sparse as sp
from scipy.special import logsumexp, softmax
from sklearn.utils import check_array

__all__ = ["check_indicator", "check_output", "check_output_weights", "class_indices",
           "label_codes", "margin", "margin_weights", "output_weights", "query_codes"]


def label_codes(classes: np.ndarray, y) -> np.ndarray:
    """Positions of the labels ``y`` in ``classes`` (sorted, as LabelEncoder keeps them)."""
    y = np.asarray(y)
    if y.ndim != 1:
        raise ValueError(f"y must be one label per query (1-D), got shape {y.shape}.")
    codes = np.searchsorted(classes, y)
    codes = np.clip(codes, 0, len(classes) - 1)
    unknown = classes[codes] != y
    if np.any(unknown):
        raise ValueError(
            f"y contains labels the classifier was not trained on: "
            f"{sorted(set(y[unknown].tolist()))[:5]}; its classes are {classes.tolist()}."
        )
    return codes


def check_indicator(y, n_labels: int | None = None) -> np.ndarray:
    """A multilabel indicator matrix checked as 0/1 values (``n_labels`` columns when
    given), as integer codes of shape (n, n_labels)."""
    y = np.asarray(y)
    if y.ndim != 2:
        raise ValueError("Multilabel targets are an indicator matrix of shape (n_samples, "
                         f"n_labels), got shape {y.shape}.")
    if n_labels is not None and y.shape[1] != n_labels:
        raise ValueError(f"y has {y.shape[1]} label columns, but the classifier was fitted "
                         f"on {n_labels} (classes_ = 0..{n_labels - 1}).")
    values = np.unique(y)
    bad = values[~np.isin(values, (0, 1))]
    if bad.size:
        raise ValueError(f"Multilabel targets must be 0/1 (or bool) indicators; y holds "
                         f"{bad[:5].tolist()}.")
    return y.astype(np.intp)


def dense_indicator(y):
    """A sparse ``y`` of two or more columns (a multilabel indicator, which
    MLPClassifier takes sparse) as a dense array; anything else as it is (a sparse
    column is refused by the checks, as MLPClassifier refuses it)."""
    if sp.issparse(y) and y.ndim == 2 and y.shape[1] > 1:
        return y.toarray()
    return y


def class_indices(y: np.ndarray, n_classes: int) -> np.ndarray:
    """``y`` checked as class indices in ``[0, n_classes)`` (a network without labels)."""
    if (not np.issubdtype(y.dtype, np.integer) or y.size and (y.min() < 0
                                                              or y.max() >= n_classes)):
        raise ValueError(f"y must hold class indices in [0, {n_classes}), got {y[:5]}.")
    return y


def query_codes(prediction: np.ndarray, y, encode, multilabel: bool = False) -> np.ndarray:
    """Class positions of the queries whose margin is explained.

    ``encode(y)`` for given labels (one per query), else the predicted class: the largest
    output, or a positive single output. ``multilabel``: a 0/1 code per query and label
    (n, C), the given indicator rows, else the labels predicted on (positive outputs).
    """
    if y is None:
        if multilabel:
            return (prediction > 0).astype(np.intp)
        return ((prediction[:, 0] > 0).astype(np.intp) if prediction.shape[1] == 1
                else np.argmax(prediction, axis=1))
    # Sparse indicator rows, as the multilabel classifier's fit takes them.
    y = np.asarray(dense_indicator(y))
    shape = prediction.shape if multilabel else (len(prediction),)
    if y.shape != shape:
        what = "an indicator row" if multilabel else "one label"
        raise ValueError(f"y must hold {what} per query, shape {shape}, got {y.shape}.")
    return encode(y)


def margin(outputs: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """The margin of the true class, per query, from network outputs (n, C); for 0/1
    multilabel ``codes`` (n, C), the sum of the labels' signed logits."""
    outputs = np.asarray(outputs, dtype=np.float64)
    if outputs.ndim == 1:
        outputs = outputs[:, None]
    if np.ndim(codes) == 2:
        return ((2.0 * codes - 1.0) * outputs).sum(axis=1)
    n, C = outputs.shape
    if C == 1:
        return np.where(codes == 1, 1.0, -1.0) * outputs[:, 0]
    others = outputs.copy()
    others[np.arange(n), codes] = -np.inf
    return outputs[np.arange(n), codes] - logsumexp(others, axis=1)


def margin_weights(outputs: np.ndarray, codes: np.ndarray) -> np.ndarray:
    """``grad_f m`` at the outputs (n, C): the margin's linear part (see module doc)."""
    if np.ndim(codes) == 2:  # multilabel: the margin is linear, +-1 per label
        return 2.0 * np.asarray(codes, dtype=np.float64) - 1.0
    outputs = np.asarray(outputs, dtype=np.float64)
    n, C = outputs.shape
    rows = np.arange(n)
    if C == 1:
        return np.where(codes == 1, 1.0, -1.0)[:, None]
    others = outputs.copy()
    others[rows, codes] = -np.inf
    weights = -softmax(others, axis=1)
    weights[rows, codes] = 1.0
    return weights


def check_output(output, n_outputs: int, margin: str, also: str = "", *,
                 n_queries: int):
    """The explained output, checked: "margin", an output column index, or the output
    weights (float64, (n_queries, n_outputs)).

    ``margin`` says what the margin is to this network: "default" (a classifier: None
    means "margin"), "allowed" (None means column 0 of a single output) or "no" (a
    regressor). ``also``: the caller's other choices, named in the errors (explain's
    ``"'all'"``), which the caller handles before. ``n_queries``: the rows of a weight
    matrix (one per query); a weight vector of shape (n_outputs,) is repeated over them.
    """
    # Every choice the caller takes, so that an error names them all.
    choices = [c for c in ("" if margin == "no" else "'margin'", also) if c]
    if output is None:
        if margin == "default":
            return "margin"
        if n_outputs > 1:
            raise ValueError(f"The network has {n_outputs} outputs: pass output=<index> to "
                             "choose the one to explain, or output=<weights of shape "
                             f"({n_outputs},)> to explain their weighted sum"
                             + "".join(f", or output={c}" for c in choices) + ".")
        return 0
    if isinstance(output, str) and output == "margin":
        if margin == "no":
            raise ValueError("output='margin' needs class labels: it is for classifiers; "
                             "pass an output index or output weights.")
        return output
    # Not a scalar (np.ndim would fail on a ragged list): weights, whose own check
    # names their shapes.
    if not isinstance(output, (str, numbers.Number, np.ndarray)) or (
            isinstance(output, np.ndarray) and output.ndim > 0):
        return check_output_weights(output, n_outputs, n_queries)
    if (isinstance(output, bool) or not isinstance(output, numbers.Integral)
            or not 0 <= output < n_outputs):
        allowed = "".join(f"{c} or " for c in choices)
        raise ValueError(f"output must be {allowed}an output index in [0, {n_outputs}) "
                         f"or output weights of shape ({n_outputs},) or (n_queries, "
                         f"{n_outputs}), got {output!r}.")
    return int(output)


def check_output_weights(output, n_outputs: int, n_queries: int) -> np.ndarray:
    """Output weights ``w`` (explaining ``sum_c w_c f_c``) as a finite float64 matrix of
    shape (n_queries, n_outputs): a vector of shape (n_outputs,) repeated for every
    query, or a matrix with one row per query (``n_queries`` rows)."""
    expected = f"({n_outputs},) or ({n_queries}, {n_outputs})"
    try:
        # check_array refuses what float64 would not hold as given: complex weights
        # (astype dropped their imaginary parts with a mere ComplexWarning), NaN and
        # infinity (checked before a vector is repeated over no query), text, ragged rows.
        weights = check_array(output, dtype=np.float64, ensure_2d=False, allow_nd=True,
                              ensure_min_samples=0, ensure_min_features=0,
                              input_name="output weights")
    except (TypeError, ValueError) as error:
        raise ValueError(f"output weights must be real numbers of shape {expected}, "
                         f"finite (no NaN or infinity); {str(error).rstrip('.')}.") from None
    if weights.shape not in ((n_outputs,), (n_queries, n_outputs)):
        raise ValueError(f"output weights must have shape {expected} (one weight per "
                         f"network output, for every query or one row per query), got "
                         f"shape {weights.shape}.")
    if not weights.any():
        # The zero function, every score 0: output=[0] read as the index of the only
        # output (a binary classifier's, a single regressor's) is a weight of 0.
        raise ValueError("output weights are all 0, whose weighted sum of the outputs is "
                         "0 and explains nothing; a list or array is weights, never "
                         "output indices: pass an int to explain one output (output=0).")
    # A copy: writable, the caller's array never aliased by the scaled weights.
    return np.array(np.broadcast_to(weights, (n_queries, n_outputs)))


def output_weights(output, prediction: np.ndarray, codes) -> np.ndarray:
    """Weights (n, C) of the scalar output an attribution explains (a checked ``output``).

    "margin": the margin's linear part at ``prediction`` for labels ``codes``; an int
    ``k``: output column ``k``; an array: the weights themselves (from
    :func:`check_output`, one row per query).
    """
    if isinstance(output, np.ndarray):
        return output
    if isinstance(output, str):  # "margin"
        return margin_weights(prediction, codes)
    weights = np.zeros(prediction.shape)
    weights[:, output] = 1.0
    return weights
