"""Every public verb that differentiates the network, called inside the caller's
``torch.no_grad()`` or ``torch.inference_mode()``: the same result as outside any such
block, bit for bit, and the caller's modes back after it (also after an error)."""

import dataclasses
import warnings

import numpy as np
import pytest
import torch
from numpy.testing import assert_array_equal
from sklearn.exceptions import NotFittedError

from skpathkernel import (
    OODRankDetector,
    PathKernel,
    PathKernelClassifier,
    PathKernelMachine,
    PathRecorder,
    TangentFeatures,
    TangentFeatureSVM,
    TangentKernel,
)
from skpathkernel._device import differentiable
from skpathkernel.diagnostics import hessian_trace, hessian_trace_path, loss_path
from skpathkernel.metrics import retrain_on_subsets
from skpathkernel.rules import check_rule, layer_routes

SMALL = dict(hidden_layer_sizes=(6,), max_iter=5, random_state=0)
MODES = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}


@pytest.fixture(scope="module")
def fitted():
    rng = np.random.RandomState(0)
    X = rng.randn(40, 3)
    y = X[:, 0]
    labels = np.where(X[:, 1] > 0, "a", "b")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reg = PathKernelMachine(**SMALL).fit(X, y)
        clf = PathKernelClassifier(**SMALL).fit(X, labels)
        ood = OODRankDetector(PathKernelMachine(**SMALL)).fit(X, y)
        features = TangentFeatures(PathKernelMachine(**SMALL)).fit(X, y)
        svm = TangentFeatureSVM(PathKernelClassifier(**SMALL)).fit(X, labels)
    # The user's own loop, recorded.
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Tanh(),
                                 torch.nn.Linear(5, 1)).double()
    opt = torch.optim.SGD(module.parameters(), lr=0.1)
    Xt, yt = torch.as_tensor(X), torch.as_tensor(y)[:, None]
    with PathRecorder(module, opt, n_samples=len(X)) as rec:
        for start in range(0, 40, 10):
            idx = np.arange(start, start + 10)
            opt.zero_grad()
            torch.nn.functional.mse_loss(module(Xt[idx]), yt[idx]).backward()
            rec.set_batch(idx)
            opt.step()
    recorded = rec.as_estimator(X, y, loss="squared_error")
    return dict(X=X, y=y, labels=labels, reg=reg, clf=clf, ood=ood, features=features,
                svm=svm, recorded=recorded, module=module)


def _fit_and_decompose(est, f, fit):
    y = f["labels"] if isinstance(est, PathKernelClassifier) else f["y"]
    getattr(est, fit)(f["X"], y)
    return (est.predict(f["X"][:5]), est.decompose(f["X"][:5]),
            [p.detach().numpy() for p in est.module_.parameters()])


VERBS = {
    "transform": lambda f: f["reg"].transform(f["X"][:5]),
    "decompose": lambda f: f["reg"].decompose(f["X"][:5]),
    "decompose_first_order": lambda f: f["reg"].decompose(f["X"][:5], method="first_order"),
    "decompose_second_order": lambda f: f["reg"].decompose(f["X"][:5],
                                                           method="second_order"),
    "decompose_n_jobs": lambda f: f["reg"].decompose(f["X"][:5], n_jobs=2),
    "attribute": lambda f: f["reg"].attribute(f["X"][:5]),
    "attribute_first_order": lambda f: f["reg"].attribute(f["X"][:5], method="first_order"),
    "attribute_second_order": lambda f: f["reg"].attribute(f["X"][:5],
                                                           method="second_order"),
    "attribute_unrolled": lambda f: f["reg"].attribute(f["X"][:5], method="unrolled"),
    "attribute_classifier": lambda f: f["clf"].attribute(f["X"][:5], f["labels"][:5]),
    "self_influence": lambda f: f["reg"].self_influence(),
    "self_influence_classifier": lambda f: f["clf"].self_influence(),
    "kneighbors": lambda f: f["reg"].kneighbors(f["X"][:5], 3),
    "kneighbors_path": lambda f: f["reg"].kneighbors(f["X"][:5], 3, kernel="path"),
    "explain": lambda f: f["clf"].explain(f["X"][:5], 3),
    "tangent_kernel": lambda f: TangentKernel(f["reg"])(f["X"][:5], f["X"][5:9]),
    "tangent_kernel_diag": lambda f: TangentKernel(f["reg"]).diag(f["X"][:5]),
    "path_kernel": lambda f: PathKernel(f["reg"])(f["X"][:5]),
    "path_kernel_diag": lambda f: PathKernel(f["reg"]).diag(f["X"][:5]),
    "ood_score_samples": lambda f: f["ood"].score_samples(f["X"][:5]),
    "ood_fit": lambda f: OODRankDetector(f["reg"]).fit(f["X"], f["y"]).score_samples(
        f["X"][:5]),
    "tangent_features": lambda f: f["features"].transform(f["X"][:5]),
    "svm_decision": lambda f: f["svm"].decision_function(f["X"][:5]),
    "hessian_trace": lambda f: hessian_trace(f["reg"], f["X"], f["y"], n_samples=3,
                                             random_state=0),
    "hessian_trace_path": lambda f: hessian_trace_path(f["reg"], steps=[0, -1], n_samples=3,
                                                       random_state=0),
    "loss_path": lambda f: loss_path(f["reg"], f["X"], f["y"]),
    # A fit in the caller's block, then its analyses: no inference tensor in the path.
    "fit": lambda f: _fit_and_decompose(PathKernelMachine(**SMALL), f, "fit"),
    "partial_fit": lambda f: _fit_and_decompose(PathKernelMachine(**SMALL), f,
                                                "partial_fit"),
    "classifier_fit": lambda f: _fit_and_decompose(PathKernelClassifier(**SMALL), f, "fit"),
    "retrain_on_subsets": lambda f: retrain_on_subsets(
        PathKernelMachine(**SMALL), f["X"], f["y"], f["X"][:4], n_subsets=2, random_state=0),
    "recorded_decompose": lambda f: f["recorded"].decompose(f["X"][:5]),
    "recorded_attribute": lambda f: f["recorded"].attribute(f["X"][:5]),
    "recorded_self_influence": lambda f: f["recorded"].self_influence(),
    "recorded_tangent_kernel": lambda f: TangentKernel(f["recorded"])(f["X"][:5]),
    "check_rule": lambda f: check_rule(f["module"], f["X"][:4]),
    "layer_routes": lambda f: layer_routes(f["module"], f["X"][:4]),
}


def _leaves(result):
    """Every array and number a result holds, in a fixed order."""
    if isinstance(result, np.ndarray) or np.isscalar(result) or result is None:
        return [np.asarray(result)]
    if isinstance(result, (tuple, list)):
        return [leaf for item in result for leaf in _leaves(item)]
    if isinstance(result, dict):
        return [leaf for key in sorted(result) for leaf in _leaves(result[key])]
    if dataclasses.is_dataclass(result):
        return _leaves({f.name: getattr(result, f.name) for f in dataclasses.fields(result)})
    if hasattr(result, "__dict__"):
        return _leaves(vars(result))
    return [np.asarray(result)]


@pytest.mark.parametrize("verb", list(VERBS))
def test_verb_in_callers_mode(fitted, verb):
    results = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name, mode in MODES.items():
            with mode():
                results[name] = VERBS[verb](fitted)
                # The caller's modes, as it set them, after the call.
                assert not torch.is_grad_enabled()
                assert torch.is_inference_mode_enabled() == (name == "inference_mode")
        reference = VERBS[verb](fitted)
    assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
    expected = _leaves(reference)
    for name, result in results.items():
        got = _leaves(result)
        assert len(got) == len(expected), name
        for a, b in zip(got, expected):
            assert_array_equal(a, b, err_msg=f"{verb} under {name}")


@pytest.mark.parametrize("name", list(MODES))
def test_modes_restored_after_error(fitted, name):
    with MODES[name]():
        # Errors raised inside the verb's block (the module's forward on rows of the
        # wrong width, a fit on one class), and before it (validation).
        with pytest.raises(RuntimeError):
            layer_routes(fitted["module"], np.ones((2, 4)))
        with pytest.raises(ValueError, match="class"):
            PathKernelClassifier(**SMALL).fit(fitted["X"], np.zeros(40))
        with pytest.raises(ValueError):
            fitted["reg"].decompose(np.full((2, 3), np.nan))
        with pytest.raises(NotFittedError):
            PathKernelMachine().decompose(fitted["X"][:2])
        assert not torch.is_grad_enabled()
        assert torch.is_inference_mode_enabled() == (name == "inference_mode")
    assert torch.is_grad_enabled()


@pytest.mark.parametrize("name", list(MODES))
def test_differentiable_block(name):
    x = torch.ones(3, requires_grad=True)
    with MODES[name]():
        with differentiable():
            assert torch.is_grad_enabled() and not torch.is_inference_mode_enabled()
            (g,) = torch.autograd.grad((x * x).sum(), x)
        assert not torch.is_grad_enabled()
        assert torch.is_inference_mode_enabled() == (name == "inference_mode")
        with pytest.raises(KeyError):
            with differentiable():
                raise KeyError
        assert not torch.is_grad_enabled()
        assert torch.is_inference_mode_enabled() == (name == "inference_mode")
    assert_array_equal(g.numpy(), 2 * np.ones(3))
