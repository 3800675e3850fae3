"""The two network trainers agree on their training parameters.

The training parameters are written out in the signatures of PathKernelMachine,
PathKernelClassifier and their base, in the base's ``_parameter_constraints`` and in the
trainers' docstrings. This checks every copy against the base's signature (names, order,
defaults) and every documented default against the signature, so that a parameter
added, renamed or re-defaulted in one place and not the others fails here, named.
"""

import inspect
import re

import numpy as np
import pytest
import sklearn
from sklearn.neural_network import MLPClassifier
from sklearn.utils._param_validation import InvalidParameterError

import skpathkernel
from skpathkernel import OODRankDetector, PathKernelClassifier, TangentFeatures
from skpathkernel._estimators._base import BasePathKernelNetwork

ESTIMATORS = [getattr(skpathkernel, name) for name in skpathkernel.__all__
              if isinstance(getattr(skpathkernel, name), type)
              and issubclass(getattr(skpathkernel, name), BasePathKernelNetwork)]

# The shared training parameters: the base's signature.
SHARED = list(inspect.signature(BasePathKernelNetwork.__init__).parameters.values())[1:]


def _same(a, b):
    # 0.0 and 0, False and 0, compare equal: the type is part of a default.
    return type(a) is type(b) and a == b


def _documented_parameters(doc):
    """{name: (type text, description)} of a numpydoc "Parameters" section."""
    lines = inspect.cleandoc(doc).splitlines()
    start = lines.index("Parameters") + 2
    entries, names = {}, []
    for line, nxt in zip(lines[start:], lines[start + 1:] + [""]):
        if re.fullmatch(r"-+", nxt) or re.fullmatch(r"-+", line):
            break  # the next section's title
        header = re.fullmatch(r"(\S.*?) : (.*)", line)
        if header:
            names = header.group(1).split(", ")
            for name in names:
                assert name not in entries, f"{name} is documented twice"
                entries[name] = [header.group(2), []]
        elif line.startswith("    ") and names:
            for n in names:
                entries[n][1].append(line[4:])
    return {n: (t, "\n".join(d).strip()) for n, (t, d) in entries.items()}


def _documented_default(type_text):
    """The value a numpydoc ``..., default=<value>`` type text gives."""
    match = re.search(r"default=(.*)$", type_text)
    return eval(match.group(1), {}) if match else inspect.Parameter.empty


def parameter_problems(cls):
    """What in ``cls`` disagrees with the base's signature or itself, one line each."""
    problems, where = [], cls.__name__
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    by_name = {p.name: p for p in params}
    names = [p.name for p in params]
    own_order = [n for n in names if n in {p.name for p in SHARED}]
    if own_order != [p.name for p in SHARED]:
        problems.append(f"{where}.__init__ has the shared parameters as {own_order}")
    for i, p in enumerate(params):
        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD if i == 0 else inspect.Parameter.KEYWORD_ONLY
        if p.kind != kind:
            problems.append(f"{where}.__init__: {p.name} should be {kind.description}")
    for ref in SHARED:
        if ref.name == "loss":
            continue  # shared by name and position; its default is each trainer's own
        if ref.name in by_name and not _same(by_name[ref.name].default, ref.default):
            problems.append(f"{where}.__init__: {ref.name}={by_name[ref.name].default!r}, "
                            f"the base has {ref.default!r}")
    constraints = cls._parameter_constraints
    doc = _documented_parameters(cls.__doc__)
    for name in names:
        if name not in constraints:
            problems.append(f"{where}._parameter_constraints has no entry for {name}")
        if name not in doc:
            problems.append(f"{where}'s docstring does not document {name}")
        elif not _same(_documented_default(doc[name][0]), by_name[name].default):
            problems.append(f"{where}'s docstring gives {name} another default")
    for name in set(constraints) - set(names):
        problems.append(f"{where}._parameter_constraints names {name}, not a parameter")
    for name in set(doc) - set(names):
        problems.append(f"{where}'s docstring documents {name}, not a parameter")
    return problems


def test_the_trainers_are_the_estimators_checked():
    assert {cls.__name__ for cls in ESTIMATORS} == {"PathKernelMachine", "PathKernelClassifier"}
    for name in ("TangentFeatures", "TangentFeatureSVM", "OODRankDetector"):
        params = getattr(skpathkernel, name)().get_params(deep=False)
        # The meta-estimators take a trainer (estimator=); random_state is their own: it
        # seeds the default trainer (and a projection).
        assert set(params) & {p.name for p in SHARED} == {"random_state"}, name


@pytest.mark.parametrize("cls", ESTIMATORS, ids=lambda c: c.__name__)
def test_trainer_agrees_with_the_base_and_documents_its_defaults(cls):
    assert parameter_problems(cls) == []


def test_the_trainers_document_the_shared_parameters_alike():
    docs = [_documented_parameters(cls.__doc__) for cls in ESTIMATORS]
    shared = [p.name for p in SHARED if p.name != "loss"]  # loss: each trainer's own
    assert [docs[0][n] for n in shared] == [docs[1][n] for n in shared]


def test_the_check_names_what_disagrees():
    # A subclass that re-defaults a parameter, forgets one, documents another default and
    # constrains a parameter it does not take: the check must say so (it is no use if it
    # cannot fail).
    Machine = skpathkernel.PathKernelMachine

    class Drifted(Machine):
        """Drifted.

        Parameters
        ----------
        hidden_layer_sizes : array-like of int, default=(32,)
            Widths.
        activation : str, default="tanh"
            Activation.
        """

        _parameter_constraints = {**Machine._parameter_constraints}

        def __init__(self, hidden_layer_sizes=(64, 64), *, activation="tanh",
                     module=None):
            pass

    problems = "\n".join(parameter_problems(Drifted))
    assert "Drifted.__init__ has the shared parameters as" in problems
    assert "activation='tanh', the base has 'gelu'" in problems
    assert "docstring gives hidden_layer_sizes another default" in problems
    assert "names solver, not a parameter" in problems
    assert "docstring does not document module" in problems


@pytest.mark.filterwarnings("ignore::sklearn.exceptions.ConvergenceWarning")
def test_skip_parameter_validation_is_honoured_as_by_sklearns_estimators():
    """``set_config(skip_parameter_validation=True)`` skips scikit-learn's own fits'
    validation (their ``_fit_context``); ours called ``_validate_params()`` directly and
    validated anyway. MLPClassifier is the reference for both settings."""
    X = np.random.RandomState(0).normal(size=(20, 2))
    y = (X[:, 0] > 0).astype(int)
    small = dict(hidden_layer_sizes=(3,), max_iter=2)
    cases = [MLPClassifier(**small), PathKernelClassifier(**small),
             TangentFeatures(PathKernelClassifier(**small)),
             OODRankDetector(PathKernelClassifier(**small))]
    for est in cases:
        with pytest.raises(InvalidParameterError):
            sklearn.base.clone(est).set_params(random_state="bad").fit(X, y)
    calls = []
    for est in cases:
        est = sklearn.base.clone(est)
        # Record the validations a fit runs under the config.
        est._validate_params = lambda est=est: calls.append(type(est).__name__)
        with sklearn.config_context(skip_parameter_validation=True):
            est.fit(X, y)
    assert calls == []
