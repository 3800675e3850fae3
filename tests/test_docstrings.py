"""numpydoc validation of the public API, and the API reference lists every exported name.

The public API is what ``skpathkernel`` and its public modules export in ``__all__``, with
the public methods and properties that skpathkernel itself defines on each class
(scikit-learn's inherited ``get_params`` / ``set_params`` are scikit-learn's to document).
"""

import doctest
import importlib
import inspect
import io
import re
import warnings
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import docutils.core
import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import pytest
import torch
from numpydoc.docscrape import ClassDoc
from numpydoc.docscrape_sphinx import get_doc_object
from numpydoc.validate import validate
from sklearn.exceptions import ConvergenceWarning

import skpathkernel
from skpathkernel import (
    OODRankDetector,
    PathKernelClassifier,
    PathKernelMachine,
    PathRecorder,
    TangentFeatures,
    TangentFeatureSVM,
    datasets,
    diagnostics,
    kernels,
    metrics,
    plotting,
    rules,
)

API_RST = Path(__file__).resolve().parent.parent / "docs" / "api.rst"
MODULES = [skpathkernel, datasets, diagnostics, kernels, metrics, plotting, rules]

# The checks that matter to a reader: a docstring with a summary line, every parameter
# documented with a description and no stray ones, what a function returns.
CHECKS = {
    "GL08",  # no docstring
    "SS01",  # no summary
    "SS02",  # summary does not start with a capital letter
    "SS03",  # summary does not end with a period
    "PR01",  # a parameter not documented
    "PR02",  # a documented parameter that does not exist
    "PR07",  # a parameter without a description
    "RT01",  # no Returns section
}
# Runnable Examples on the classes and functions themselves (not on every method).
CHECKS_TOP_LEVEL = CHECKS | {"EX01"}


def _public_names(module):
    return [name for name in module.__all__ if not name.startswith("_")]


def _members(cls, qualname):
    """The public methods and properties skpathkernel defines on ``cls`` or its bases."""
    for name, _ in inspect.getmembers(cls):
        if name.startswith("_"):
            continue
        owner = next(k for k in cls.__mro__ if name in vars(k))
        if not owner.__module__.startswith("skpathkernel"):
            continue
        raw = vars(owner)[name]
        if (
            isinstance(raw, property)
            or inspect.isfunction(raw)
            or isinstance(raw, (classmethod, staticmethod))
        ):
            yield f"{qualname}.{name}"


def _api():
    """``(import path, checks)`` for every public object, deduplicated by path."""
    seen = {}
    for module in MODULES:
        for name in _public_names(module):
            obj = getattr(module, name)
            if not (inspect.isclass(obj) or inspect.isfunction(obj)):
                continue
            path = f"{module.__name__}.{name}"
            seen.setdefault(path, CHECKS_TOP_LEVEL)
            if inspect.isclass(obj):
                for member in _members(obj, path):
                    seen.setdefault(member, CHECKS)
    return sorted(seen.items())


API = _api()


def test_api_is_collected():
    paths = [path for path, _ in API]
    assert "skpathkernel.PathKernelClassifier.fit" in paths
    assert "skpathkernel.diagnostics.HessianTrace" in paths
    assert len(paths) > 100


def _resolve(path):
    """The object at the dotted ``path``."""
    parts, obj = path.split("."), None
    # The longest importable prefix is the module; the rest are attributes of it.
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for name in parts[i:]:
            obj = getattr(obj, name)
        break
    return obj


def _foreign_constructor(path):
    """Whether ``path`` is a class whose constructor no skpathkernel class defines (an
    ndarray subclass made by views): its signature is NumPy's, whose parameters NumPy <
    2 exposes to introspection and which the class does not document."""
    obj = _resolve(path)
    return inspect.isclass(obj) and not any(
        "__init__" in vars(k) or "__new__" in vars(k)
        for k in obj.__mro__ if k.__module__.startswith("skpathkernel"))


@pytest.mark.parametrize("path, checks", API, ids=[path for path, _ in API])
def test_docstring(path, checks):
    if _foreign_constructor(path):
        checks = checks - {"PR01", "PR02"}
    errors = [(code, msg) for code, msg in validate(path)["errors"] if code in checks]
    assert not errors, "\n".join(f"{path}: {code} {msg}" for code, msg in errors)


# reST that docutils alone can judge: a word ending in ``_`` outside backticks is a link
# to a target (``n_params_`` in a shape), an error that fails the ``sphinx-build -W`` of
# CI minutes after the tests pass. Sphinx's own roles are unknown to docutils and left to
# the docs build.
RST_ERRORS = ("Unknown target name", "Duplicate explicit target name", "Inline")


@pytest.mark.parametrize("path", [path for path, _ in API])
def test_docstring_renders_as_rest_without_errors(path):
    rst = str(get_doc_object(_resolve(path), config={"show_class_members": False}))
    stream = io.StringIO()
    docutils.core.publish_doctree(
        rst, settings_overrides={"warning_stream": stream, "report_level": 3, "halt_level": 5})
    errors = [line for line in stream.getvalue().splitlines()
              if any(kind in line for kind in RST_ERRORS)]
    assert not errors, f"{path}:\n" + "\n".join(errors)


def _listed_in_api_rst():
    """The objects that docs/api.rst's autosummary tables document."""
    listed, current = [], None
    for line in API_RST.read_text().splitlines():
        if match := re.match(r"\.\. (?:current)?module:: (\S+)", line):
            current = importlib.import_module(match[1])
        elif re.fullmatch(r"   [A-Za-z_][\w.]*", line):
            obj = current
            for part in line.strip().split("."):
                obj = getattr(obj, part)
            listed.append(obj)
    return listed


def test_api_reference_lists_every_exported_name():
    listed = _listed_in_api_rst()
    missing = [
        f"{module.__name__}.{name}"
        for module in MODULES
        for name in _public_names(module)
        if name != "__version__" and not any(getattr(module, name) is obj for obj in listed)
    ]
    assert not missing, f"not in docs/api.rst: {missing}"


def _documented_attributes(cls):
    """The attributes ``cls``'s docstring documents: the entries of its Attributes section,
    the attributes those entries name (the meta-estimators' ``module_``, read from their
    ``estimator_``), and the properties skpathkernel gives a docstring of their own."""
    doc = ClassDoc(cls, config={"show_class_members": False})
    names = {name.strip() for entry in doc["Attributes"] for name in entry.name.split(",")}
    text = " ".join(line for entry in doc["Attributes"] for line in entry.desc)
    own = {name for name, member in inspect.getmembers(cls)
           if isinstance(member, property) and member.__doc__
           and member.fget.__module__.startswith("skpathkernel")}
    return names | set(re.findall(r"``(\w+_)``", text)) | own


def _fitted_estimators():
    X = pd.DataFrame(np.random.default_rng(0).normal(size=(40, 3)), columns=list("abc"))
    y = (X["a"] > 0).to_numpy().astype(int)
    small = dict(hidden_layer_sizes=(4,), max_iter=2, tol=None, random_state=0)
    module = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)
    with PathRecorder(module, optimizer, n_samples=len(X)) as recorder:
        optimizer.zero_grad()
        module(torch.tensor(X.to_numpy(), dtype=torch.float32)).pow(2).mean().backward()
        recorder.set_batch(np.arange(len(X)))
        optimizer.step()
    return [
        PathKernelMachine(**small).fit(X, X["b"]),
        PathKernelClassifier(**small).fit(X, y),
        TangentFeatures(PathKernelClassifier(**small)).fit(X, y),
        TangentFeatureSVM(PathKernelClassifier(**small), C=1.0, probability=True).fit(X, y),
        OODRankDetector(PathKernelClassifier(**small), method="residual").fit(X, y),
        recorder.as_estimator(X.to_numpy(), X["b"].to_numpy()),
    ]


def test_every_fitted_attribute_is_documented():
    """Every public fitted attribute (``name_``) an estimator has after fit is in its
    docstring: ``dtype_`` of the trainers and ``dtype_`` / ``X_fit_`` of RecordedNetwork
    were there undocumented."""
    undocumented = {}
    for est in _fitted_estimators():
        public = {name for name in dir(est)
                  if name.endswith("_") and not name.startswith("_") and hasattr(est, name)}
        missing = public - _documented_attributes(type(est))
        if missing:
            undocumented[type(est).__name__] = sorted(missing)
    assert not undocumented, f"fitted attributes missing from the docstrings: {undocumented}"


def _examples():
    """Each distinct docstring of the public API that has Examples, under one of its paths
    (a method inherited by several estimators is run once)."""
    seen = {}
    for path, _ in API:
        doc = inspect.getdoc(_resolve(path)) or ""
        if ">>>" in doc:
            seen.setdefault(doc, path)
    return sorted((path, doc) for doc, path in seen.items())


@pytest.mark.parametrize("path, doc", _examples(), ids=[path for path, _ in _examples()])
def test_examples_leave_no_convergence_warning(path, doc):
    """A docstring's Examples run as a reader pastes them, without a ConvergenceWarning
    (the user guide's blocks are held to the same, tests/test_docs.py): a trainer stopped
    by ``max_iter`` before its ``tol`` rule warns, so short examples pass ``tol=None``."""
    test = doctest.DocTestParser().get_doctest(doc, {}, path, None, 0)
    runner, report = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS), []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", ConvergenceWarning)
            runner.run(test, out=report.append)
    finally:
        plt.close("all")
    # A ConvergenceWarning raised as an error fails its example like any exception.
    assert runner.failures == 0, "".join(report)[-3000:]
