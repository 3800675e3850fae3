"""What ``X`` may be: 2-D features for the default MLP, ``(n, ...)`` arrays with ``module``.

Every estimator records at fit the form its network takes, ``input_shape_`` (the trailing
shape of ``X``) and a kind, and checks every later ``X`` against both:

- ``"features"``: the default MLP. ``X`` is 2-D and converted to float by scikit-learn's
  ``validate_data``, exactly as scikit-learn's own estimators do.
- ``"float"``: a user's ``module`` fitted on float ``X`` of shape ``(n_samples, ...)``:
  2-D features, images ``(n, C, H, W)``, sequences ``(n, S, d)``; handed to the network
  in its dtype.
- ``"int64"``: a user's ``module`` fitted on integer ``X``: token ids ``(n, S)`` (any
  trailing shape), handed to the network as int64.

With ``module``, the dtype of ``X`` decides: integer ``X`` is token ids, any other numeric
``X`` is floats. ``n_features_in_`` is the number of values per sample,
``prod(input_shape_)``. At fit the new network is run on the first sample (and, for token
ids, on the sample holding the largest id, and with embeddings of several sizes on those
holding each position's largest id), so that a module that cannot take ``X`` (a
float network given token ids, an ``nn.Embedding`` given floats, a wrong trailing shape, an
id beyond the embedding) is refused with a message naming the shape and dtype, before any
training; and so is a module whose output for a sample depends on the samples run with it
(a sequence layer with ``batch_first=False`` reads the samples of ``(n, S, d)`` as time).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from scipy.sparse import issparse
from sklearn.utils.validation import check_array, validate_data

from .._checkpoint import plain_checkpoints
from .._device import forked_rng, forward_input, to_input_tensor
from .._modules import copy_module, without_fastpath

__all__ = [
    "FEATURES",
    "FLOAT",
    "TOKENS",
    "activation_widths",
    "block_widths",
    "check_ids",
    "check_input",
    "check_module_takes",
    "check_representable",
    "fitted_input",
    "probe_module",
    "validate_input",
]

FEATURES, FLOAT, TOKENS = "features", "float", "int64"
_FLOATS = [np.float64, np.float32]
_INT64_MAX = np.iinfo(np.int64).max


def fitted_input(estimator) -> tuple[tuple[int, ...] | None, str | None]:
    """``(input_shape_, kind)`` recorded at fit; ``(None, None)`` when nothing was recorded.

    Without a recorded form, an estimator that counts ``n_features_in_`` takes 2-D
    features.
    """
    kind = getattr(estimator, "_input_kind", None)
    if kind is not None:
        return tuple(estimator.input_shape_), kind
    n_features = getattr(estimator, "n_features_in_", None)
    if n_features is None:
        return None, None
    return (int(n_features),), FEATURES


def _ndim(X) -> int:
    try:
        return int(np.ndim(X))
    except Exception:  # an unusual container: check_array judges it
        return 2


def _numeric_dtype(X):
    """``check_array``'s dtype for a user's module: integers stay integers (token ids).

    scikit-learn converts a DataFrame of pandas' nullable integer columns ("Int64",
    "UInt8": what ``convert_dtypes`` and the nullable readers give) to float64, as they
    may hold ``pd.NA``: token ids in one were refused as floats. Without a missing value
    they are taken as integers, as NumPy integer columns are.
    """
    dtypes = getattr(X, "dtypes", None)
    if dtypes is None or not hasattr(X, "isna") or isinstance(dtypes, np.dtype):
        return "numeric"
    try:
        # Their common type: uint64 ids beyond int64 are refused by _network_form.
        common = np.result_type(*(np.dtype(getattr(d, "numpy_dtype", d)) for d in dtypes))
    except TypeError:  # a column of another kind (category): check_array's rules
        return "numeric"
    if common.kind not in "iu" or bool(X.isna().to_numpy().any()):
        return "numeric"
    return common


def _shape_text(shape) -> str:
    return "(n_samples, " + ", ".join(str(int(d)) for d in shape) + ")"


def _network_form(X: np.ndarray, name: str) -> tuple[np.ndarray, str]:
    """A validated numeric array as the network takes it, and its kind."""
    if X.dtype.kind in "iu":
        if X.size and X.min() < 0:
            raise ValueError(
                f"{name} holds integer token ids, which must be non-negative; found "
                f"{int(X.min())}. Pass float {name} for numeric features."
            )
        if X.dtype == np.uint64 and X.size and X.max() > _INT64_MAX:
            raise ValueError(f"{name} holds token ids beyond int64: {int(X.max())}.")
        return X.astype(np.int64, copy=False), TOKENS
    if X.dtype not in _FLOATS:
        X = X.astype(np.float64)
    return X, FLOAT


def _check_values_per_sample(X: np.ndarray) -> None:
    if X.ndim > 2 and math.prod(X.shape[1:]) == 0:
        raise ValueError(
            f"Found array with 0 feature(s) (shape={X.shape}) while a minimum of 1 is "
            "required."
        )


def _check_like_fit(X, dtype, kind, shape, fitted_kind, name, what) -> None:
    """``X`` (network form, original ``dtype``) against the form recorded at fit."""
    if fitted_kind == TOKENS and kind != TOKENS:
        raise ValueError(
            f"{name} has dtype {dtype}, but {what} was fitted on integer token ids, handed "
            f"to the module as int64: pass integer {name} (e.g. {name}.astype(np.int64)) "
            f"of shape {_shape_text(shape)}."
        )
    if fitted_kind == FLOAT and kind == TOKENS:
        raise ValueError(
            f"{name} has integer dtype {dtype}, but {what} was fitted on float inputs: "
            f"with a module, integer {name} is token ids, which this network does not take. "
            f"Pass floats (e.g. {name}.astype(np.float32)) of shape {_shape_text(shape)}."
        )
    if X.shape[1:] != tuple(shape):
        raise ValueError(
            f"{name} has shape {X.shape}, but {what} is expecting {name} of shape "
            f"{_shape_text(shape)}, as at fit."
            + (f" Token ids: pad (or cut) every sequence to the fit's length, {shape[-1]}."
               if fitted_kind == TOKENS and X.ndim == len(shape) + 1 else "")
        )


def _record(estimator, X, kind) -> None:
    estimator.n_features_in_ = int(math.prod(X.shape[1:]))
    estimator.input_shape_ = tuple(int(d) for d in X.shape[1:])
    estimator._input_kind = kind


def _refuse_sparse(X, who: str, name: str) -> None:
    # check_array's own message says to call .toarray(), which a Pipeline's user cannot
    # do between two steps: name the steps' settings that give dense output.
    if issparse(X):
        raise TypeError(
            f"{who} takes a dense {name} (the network's input is a dense tensor); got a "
            "sparse matrix. Densify it first: in a Pipeline, give the step before it "
            "dense output (OneHotEncoder(sparse_output=False), ColumnTransformer(..., "
            f"sparse_threshold=0)), or pass {name}.toarray()."
        )


def validate_input(estimator, X, y="no_validation", *, reset: bool, flexible: bool = False,
                   **check_params):
    """``validate_data`` for the network's input: returns ``X`` (or ``X, y``) as it takes it.

    Parameters
    ----------
    estimator : estimator
        Receives ``n_features_in_``, ``feature_names_in_``, ``input_shape_`` and the kind
        when ``reset``; checked against them otherwise.
    X, y : array-like
        As :func:`sklearn.utils.validation.validate_data`.
    reset : bool
        True in ``fit``.
    flexible : bool, default=False
        Only with ``reset``: whether ``X`` may be ``(n, ...)`` and token ids (a user's
        ``module``), or must be 2-D features (the default MLP).
    **check_params
        Passed to ``validate_data`` (``ensure_min_samples``, ``multi_output``, ...).
    """
    with_y = not (isinstance(y, str) and y == "no_validation")
    _refuse_sparse(X, type(estimator).__name__, "X")
    if reset:
        kind = FLOAT if flexible else FEATURES
        shape = None
    else:
        shape, kind = fitted_input(estimator)
    if (kind == TOKENS and hasattr(X, "shape") and hasattr(X, "dtype")
            and len(X.shape) == len(shape) + 1 and tuple(X.shape[1:]) != tuple(shape)):
        # Before validate_data, whose n_features check speaks of features, not of the
        # length of the sequences.
        _check_like_fit(X, X.dtype, TOKENS, shape, TOKENS, "X", type(estimator).__name__)
    if kind == FEATURES:
        out = validate_data(estimator, X, y, reset=reset, dtype=_FLOATS, **check_params)
        if reset:
            _record(estimator, out[0] if with_y else out, FEATURES)
        return out
    # Trailing shapes are checked here, not by validate_data's n_features (which reads
    # shape[1] only): then the message can name the whole expected shape.
    nd = _ndim(X) >= 3 or (shape is not None and len(shape) > 1)
    if nd:
        check_params.update(allow_nd=True, ensure_2d=False)
    out = validate_data(estimator, X, y, reset=reset, dtype=_numeric_dtype(X), **check_params)
    X, y = out if with_y else (out, None)
    if X.ndim < 2:  # only reachable with ensure_2d=False, i.e. an (n, ...) fit
        raise ValueError(
            f"Expected an array of shape {_shape_text(shape)}, got {X.ndim}-D shape "
            f"{X.shape}; one row per sample."
        )
    _check_values_per_sample(X)
    dtype = X.dtype
    X, kind = _network_form(X, "X")
    if reset:
        _record(estimator, X, kind)
    else:
        _check_like_fit(X, dtype, kind, shape, fitted_input(estimator)[1], "X",
                        type(estimator).__name__)
        if kind == TOKENS:
            check_ids(getattr(estimator, "module_", None), X, "X")
    return (X, y) if with_y else X


def check_input(shape, fitted_kind, module, X, name: str = "X", *,
                allow_flat: bool = False) -> np.ndarray:
    """``check_array`` against the form a fitted network takes (no feature names).

    For kernels and helpers that take arrays from anywhere: ``shape`` and ``fitted_kind``
    are the network's recorded input form (``None, None``: any ``(n, ...)`` array, as a
    ``RecordedNetwork`` without ``X_train``); ``module`` checks token ids against its
    embeddings. ``allow_flat``: also accept rows of ``prod(shape)`` values for a network
    fitted on ``(n, ...)`` arrays, and reshape them to ``shape`` (scikit-learn's kernel
    consumers, e.g. ``GaussianProcessRegressor``, only pass 2-D arrays).
    """
    what = "the network"  # the kernels' and the verbs' (a RecordedNetwork's too)
    _refuse_sparse(X, what, name)
    if fitted_kind == FEATURES:
        X = check_array(X, dtype=_FLOATS, ensure_all_finite=True, input_name=name)
        if X.shape[1] != shape[0]:
            raise ValueError(
                f"{name} has {X.shape[1]} features, but {what} is expecting {shape[0]} "
                "features as input."
            )
        return X
    nd = _ndim(X) >= 3 or (shape is not None and len(shape) > 1)
    X = check_array(X, dtype=_numeric_dtype(X), ensure_all_finite=True, allow_nd=nd,
                    ensure_2d=not nd, input_name=name)
    if X.ndim < 2:
        raise ValueError(f"Expected {name} of shape (n_samples, ...), got shape {X.shape}.")
    if (allow_flat and shape is not None and len(shape) > 1 and X.ndim == 2
            and X.shape[1] == math.prod(shape)):
        X = X.reshape(X.shape[0], *shape)
    _check_values_per_sample(X)
    dtype = X.dtype
    X, kind = _network_form(X, name)
    if shape is not None:
        _check_like_fit(X, dtype, kind, shape, fitted_kind, name, what)
    if kind == TOKENS:
        check_ids(module, X, name)
    return X


def check_representable(X: np.ndarray, dtype: torch.dtype, input_name: str = "X") -> None:
    """Refuse finite float64 values that overflow the network's float32 dtype.

    ``check_array`` checks finiteness in float64; converted to float32, values beyond
    3.4e38 would become inf inside the network and silently give NaN outputs.
    """
    if dtype != torch.float32 or X.dtype != np.float64 or X.size == 0:
        return
    largest = float(np.max(np.abs(X)))
    limit = float(np.finfo(np.float32).max)
    if largest > limit:
        raise ValueError(
            f"Input {input_name} contains values too large for the network's dtype float32 "
            f"(largest magnitude {largest:.3g}, float32 holds up to {limit:.3g}); rescale "
            f"{input_name} or use dtype='float64'."
        )


def _probe(X: np.ndarray, module: torch.nn.Module | None = None) -> np.ndarray:
    """The samples a module is probed on: the first two (a network's outputs show their
    batch axis on two: a ``.squeeze()`` drops it on one), and for token ids the one
    holding the largest id.

    With embeddings of several sizes, some smaller than the largest id, also one sample
    made of each position's largest id: a table per column (entity embeddings of
    categorical features) may get an id beyond its own rows in any sample, not only in
    the one holding the largest id, which another, larger table reads. One made-up row
    holds every position's largest id (each one that X holds there), where the samples
    holding them would be up to one per position.
    """
    rows = [0, 1] if len(X) > 1 else [0]
    if not (X.dtype == np.int64 and X.size):
        return X[rows]
    rows.append(int(np.unravel_index(np.argmax(X), X.shape)[0]))
    probe = X[np.unique(rows)]
    sizes = [] if module is None else _embedding_sizes(module)
    if sizes and X.max() >= min(sizes):
        probe = np.concatenate([probe, X.max(axis=0, keepdims=True)])
    return probe


def _embedding_sizes(module) -> list[int]:
    return [m.num_embeddings for m in module.modules()
            if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag))]


def _module_device(module: torch.nn.Module) -> torch.device:
    first = next(module.parameters(), None)
    return first.device if first is not None else torch.device("cpu")


def _reads_ids_on_cpu(module: torch.nn.Module) -> bool:
    """Whether ``module`` reads token ids on the CPU, where an id beyond a lookup table
    raises an ``IndexError``."""
    return _module_device(module).type == "cpu"


def _ids_probe(module: torch.nn.Module, ids: np.ndarray) -> torch.nn.Module:
    """The module to run token ids ``ids`` through to find ids beyond its lookup tables:
    ``module`` itself, or a CPU copy of it.

    Only the CPU answers such an id with an ``IndexError``: on a GPU, an embedding read
    beyond its rows is a device-side assert, after which every CUDA call of the process
    fails (the fitted network's too). A GPU module runs the ids itself only when they lie
    within every ``nn.Embedding`` it holds (a lookup of its own, whose size is not
    known here, is probed on the CPU copy); a module that cannot be copied is run as it is.
    """
    if _reads_ids_on_cpu(module):
        return module
    sizes = _embedding_sizes(module)
    if sizes and ids.dtype.kind in "iu" and 0 <= ids.min() and ids.max() < min(sizes):
        return module
    try:
        return copy_module(module).cpu()
    except (RuntimeError, TypeError):  # a module holding what deepcopy refuses (a lock)
        return module


def _ids_on_host(module: torch.nn.Module, ids: np.ndarray) -> bool:
    """Run token ids ``ids`` through the CPU copy of :func:`_ids_probe`, where an id beyond
    a lookup table raises ``IndexError``. False where ``module`` is to run them itself:
    no copy is needed, or the copy cannot run on the CPU (a forward that makes its own
    tensors on the GPU), which leaves the check as it was. Forked: a lazy layer's copy
    draws its weights from the generator that the module's own first pass is seeded for.
    """
    host = _ids_probe(module, ids)
    if host is module:
        return False
    try:
        with forked_rng():
            _run(host, torch.as_tensor(ids))
    except IndexError:
        raise
    except (RuntimeError, TypeError, ValueError, NotImplementedError):
        return False
    return True

def _largest_ids(X: np.ndarray, sizes: list[int]) -> str:
    """What to say of token ids ``X`` that an embedding of ``sizes`` rows refused."""
    largest = int(X.max())
    if not sizes or largest >= max(sizes):
        return f"the largest token id is {largest}"
    # Beyond a smaller table only: the largest id is not the one refused.
    per = X.reshape(len(X), -1).max(axis=0)
    shown = ", ".join(str(int(v)) for v in per[:16]) + (", ..." if per.size > 16 else "")
    return f"the largest token id at each position is [{shown}]"


def _run(module: torch.nn.Module, x: torch.Tensor):
    """One forward pass in eval mode (no dropout draw, no BatchNorm statistics update),
    with torch's attention fast path off like every verb's forward. The checks run it
    before a verb takes the switch: with the fast path on, nn.TransformerEncoder under a
    padding mask packs a nested tensor, and a verb on another thread turning the
    process's switch off before its MultiheadAttention runs made it raise
    (AssertionError: does not support NestedTensor outside of its fast path)."""
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        # Checkpointed regions plainly: a reentrant one warns that no input requires grad.
        with torch.no_grad(), without_fastpath(module), plain_checkpoints():
            return module(forward_input(x))  # a copy: a module may write into its input
    finally:
        for m, mode in modes:
            m.training = mode


def activation_widths(module: torch.nn.Module, x: torch.Tensor) -> list[int]:
    """Values per sample of every module's output, on one forward pass of the rows ``x``.

    What bounds a block's memory for any network: a convolution's feature maps or a
    sequence's hidden states outgrow the input, where the default MLP's widest activation
    is its widest ``nn.Linear``.
    """
    sizes: list[int] = []

    def hook(layer, args, out):
        outs = out if isinstance(out, (tuple, list)) else (out,)
        sizes.extend(t.numel() // len(x) for t in outs if isinstance(t, torch.Tensor))

    handles = [m.register_forward_hook(hook) for m in module.modules()]
    try:
        _run(module, x)
    finally:
        for h in handles:
            h.remove()
    return sizes or [1]


def block_widths(module: torch.nn.Module, x: torch.Tensor | None, *,
                 linear_only: bool) -> list[int]:
    """Values per sample of a network's activations, which bound a block's memory.

    ``linear_only``: the default MLP, whose widest activation is its widest
    ``nn.Linear`` (``x`` unused); otherwise measured on one forward pass of ``x``.
    """
    if linear_only:
        return [m.out_features for m in module.modules()
                if isinstance(m, torch.nn.Linear)] or [1]
    return activation_widths(module, x)


def probe_module(module: torch.nn.Module, X: np.ndarray, *, dtype: torch.dtype,
                 device: torch.device, n_outputs: int | None = None,
                 outputs_hint: str = "") -> None:
    """Refuse, with a message naming X's shape and dtype, a module that cannot take X;
    with ``n_outputs``, one whose output is not ``n_outputs`` values per sample
    (``outputs_hint`` says what they are); and one that mixes the samples of a batch."""
    x, out = _take(module, X, dtype=dtype, device=device)
    if n_outputs is not None:
        check_outputs(out, len(x), n_outputs, outputs_hint)
    _check_per_sample(module, x, out)


def check_module_takes(module: torch.nn.Module, X: np.ndarray, *, dtype: torch.dtype,
                       device: torch.device, name: str = "X") -> None:
    """Refuse, with :func:`probe_module`'s message naming X's shape and dtype, a module
    that cannot take X: training inputs given with a recorded path, and what a network
    without them (a ``RecordedNetwork`` without ``X_train``) knows of its input form,
    instead of torch's own error from inside a kernel or a prediction; and, as fit does,
    one that mixes the samples of a batch (a recorded loop's ``batch_first=False`` RNN,
    whose kernels described no network, without a word)."""
    x, out = _take(module, X, dtype=dtype, device=device, name=name)
    check_outputs(out, len(x))
    _check_per_sample(module, x, out)


def _take(module: torch.nn.Module, X: np.ndarray, *, dtype: torch.dtype,
          device: torch.device, name: str = "X") -> tuple[torch.Tensor, object]:
    """The module run on X's probe rows (as a tensor) and its output; a ValueError naming
    X's shape and dtype when it cannot take them."""
    x = to_input_tensor(_probe(X, module), dtype=dtype, device=device)
    try:
        if x.dtype == torch.int64:
            # Ids beyond a lookup table fail here, on the CPU where that is an IndexError,
            # before the module runs them on its GPU (see _ids_probe).
            _ids_on_host(module, _probe(X, module))
        out = _run(module, x)
    except (RuntimeError, IndexError, TypeError, ValueError) as e:
        given = f"{name} of shape {X.shape}, handed to it as {x.dtype}"
        if X.dtype == np.int64:
            sizes = _embedding_sizes(module)
            hint = ("integer X is token ids: the module needs an nn.Embedding (or its own "
                    "lookup) to read them; pass float X (X.astype(np.float32)) for numeric "
                    "features")
            if isinstance(e, IndexError) and sizes:
                hint = (f"{_largest_ids(X, sizes)}, and the module's embeddings have "
                        f"{sizes} rows")
        else:
            hint = ("float X is handed to the module in the network's dtype: token ids "
                    "must be integers (X.astype(np.int64)), and images or sequences must "
                    "have the trailing shape the module's first layer expects")
        raise ValueError(
            f"The module could not take {given} ({type(e).__name__}: {e}). Note: {hint}."
        ) from e
    return x, out


# A sample's outputs run with others and alone differ by more than this, relative to the
# largest output, when the module mixes the samples of a batch (by 0.4 to 1.2 for the
# sequence layers below). Round-off stays well below it: a batch and a single row may
# take other kernels (matrix products moved float32 outputs by ~1e-7 of their size; a
# GPU's convolution algorithms, Winograd or FFT with TF32, by more).
_MIXING_RTOL = {torch.float32: 1e-2, torch.float64: 1e-6}


def _check_per_sample(module: torch.nn.Module, x: torch.Tensor, out) -> None:
    """Refuse a module whose output for a sample depends on the samples passed with it.

    Every method reads the network one sample at a time, on blocks of samples (padded
    predictions, per-sample gradients, Grams): a module that mixes them gave results
    that depend on the blocks, without a word. The common cause is a layer reading the
    first axis of ``(n, S, d)`` sequences as time (torch's ``batch_first=False``).
    """
    if len(x) < 2 or not isinstance(out, torch.Tensor) or not out.numel() \
            or out.numel() % len(x) or not out.is_floating_point():
        return
    batch = out.reshape(len(x), -1)
    tol = _MIXING_RTOL.get(batch.dtype, 1e-2) * (float(batch.abs().max()) or 1.0)
    if not torch.isfinite(batch).all():
        return  # left to the training's divergence check
    if float((_run(module, x).reshape(len(x), -1) - batch).abs().max()) > tol:
        return  # a random forward: warn_random_forward says so
    try:
        # Two samples alone show what the others mixed into them: the probe may hold a
        # row of every position's largest id (_probe), which needs no forward of its own.
        alone = [_run(module, x[i : i + 1]) for i in range(2)]
    except (RuntimeError, IndexError, TypeError, ValueError):
        return  # a module that takes no single sample: not this check's business
    if any(not isinstance(a, torch.Tensor) or a.numel() != batch.shape[1] for a in alone):
        return
    gap = float((torch.stack([a.reshape(-1) for a in alone]) - batch[:2]).abs().max())
    if gap > tol:
        raise ValueError(
            f"The module's output for a sample depends on the other samples passed with "
            f"it: {len(x)} samples of X run together and one at a time gave outputs "
            f"differing by {gap:.3g} (largest output {float(batch.abs().max()):.3g}). "
            "Every method reads the network one sample at a time, on blocks of samples, "
            "so its results would depend on the blocks. A layer that reads the first axis "
            "of X as something else than the samples mixes them: nn.MultiheadAttention, "
            "nn.TransformerEncoderLayer / DecoderLayer and nn.RNN / LSTM / GRU default to "
            "batch_first=False, which reads (n_samples, S, d) sequences as one sequence "
            "over the samples; build them with batch_first=True.")


def check_outputs(out, n: int, n_outputs: int | None = None, hint: str = "") -> None:
    """Refuse a network output that is not ``n_outputs`` values for each of ``n`` samples.

    Every method reads the output as ``(n_samples, n_outputs)``: another width trained
    without a word (three classes on one output predicted two of them; four outputs for
    three classes failed in predict with an IndexError). ``n_outputs=None`` (a recorded
    network, whose outputs are whatever its module returns) refuses only what is not one
    tensor with a row per sample: a module returning a tuple failed deep inside every
    kernel with "'tuple' object has no attribute 'reshape'".
    """
    # The estimators' factories get the same advice as a recorded network: a library
    # model returns a dict-like output (Hugging Face's ModelOutput) more often than not.
    wrap = (f"it returned a {type(out).__name__}. Wrap it in a module whose forward "
            "returns the output to analyse (e.g. module(x)[0], or module(x).logits for a "
            "Hugging Face ModelOutput).")
    if n_outputs is None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(
                "The module must return one tensor of shape (n_samples, ...), its "
                f"outputs for each sample; {wrap}")
        if out.ndim == 0 or out.shape[0] != n:
            raise ValueError(
                f"The module returned shape {tuple(out.shape)} for {n} sample(s): it must "
                f"return its outputs with one row per sample, shape ({n}, ...).")
        return
    if not isinstance(out, torch.Tensor):
        raise TypeError(
            f"The module must return one tensor of shape (n_samples, {n_outputs}); {wrap}")
    if out.ndim == 0 or out.shape[0] != n or out.numel() != n * n_outputs:
        raise ValueError(
            f"The module returned shape {tuple(out.shape)} for {n} sample(s), where "
            f"{n_outputs} value(s) per sample were expected, shape ({n}, {n_outputs}): "
            f"the factory is called as module(n_features_in, n_outputs={n_outputs}) and "
            f"its network must return n_outputs values per sample{hint}.")


def check_ids(module, X: np.ndarray, name: str) -> None:
    """Token ids beyond the embedding would fail deep inside torch: refuse them here.

    ``X`` is int64 token ids (the network's form); ``module`` is the fitted network's
    (None: nothing to check against).
    """
    if module is None or not X.size:
        return
    ids = _probe(X, module)
    try:
        if not _ids_on_host(module, ids):
            _run(module, torch.as_tensor(ids, device=_module_device(module)))
    except IndexError as e:
        sizes = _embedding_sizes(module)
        if not sizes or X.max() >= max(sizes):
            what = (f"token id {int(X.max())}, out of range for the network's embeddings "
                    f"({sizes} rows)")
        else:
            what = (f"a token id out of range for one of the network's embeddings "
                    f"({sizes} rows; {_largest_ids(X, sizes)})")
        raise ValueError(f"{name} holds {what}: {e}.") from e
