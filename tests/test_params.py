"""Both network trainers agree with the one declaration of the shared parameters.

``skpathkernel._estimators._params.NETWORK_PARAMETERS`` declares each shared parameter once: name,
default, constraints, documentation. The signatures are written out in both trainers
(PathKernelMachine, PathKernelClassifier) and their base; this checks them,
``_parameter_constraints`` and the "Parameters" section of each docstring against the
declaration, so that a parameter added, renamed or re-defaulted in one place and not the
others fails here with the place named.
"""

import inspect
import re
import textwrap

import pytest
from sklearn.utils._param_validation import Interval, StrOptions

import skpathkernel
from skpathkernel._estimators._base import BasePathKernelNetwork
from skpathkernel._estimators._params import NETWORK_PARAMETERS, network_params_doc, signature_names

ESTIMATORS = [getattr(skpathkernel, name) for name in skpathkernel.__all__
              if isinstance(getattr(skpathkernel, name), type)
              and issubclass(getattr(skpathkernel, name), BasePathKernelNetwork)]


def _same(a, b):
    # 0.0 and 0, False and 0, compare equal: the type is part of a default.
    return type(a) is type(b) and a == b


def _constraint_key(c):
    if isinstance(c, StrOptions):
        return ("options", frozenset(c.options), frozenset(c.deprecated))
    if isinstance(c, Interval):
        return ("interval", c.type, c.left, c.right, c.closed)
    return c


def _documented_parameters(doc):
    """{name: (type text, description)} of a numpydoc "Parameters" section."""
    lines = inspect.cleandoc(doc).splitlines()
    start = lines.index("Parameters") + 2
    entries, name = {}, None
    for line, nxt in zip(lines[start:], lines[start + 1:] + [""]):
        if re.fullmatch(r"-+", nxt) or re.fullmatch(r"-+", line):
            break  # the next section's title
        header = re.fullmatch(r"(\S.*?) : (.*)", line)
        if header:
            for name in header.group(1).split(", "):
                assert name not in entries, f"{name} is documented twice"
                entries[name] = [header.group(2), []]
            names = header.group(1).split(", ")
        elif line.startswith("    ") and name is not None:
            for n in names:
                entries[n][1].append(line[4:])
    return {n: (t, "\n".join(d).strip()) for n, (t, d) in entries.items()}


def declaration_problems(cls, abstract=False):
    """What in ``cls`` disagrees with the declaration, one line each (empty: nothing)."""
    problems = []
    where = cls.__name__
    params = list(inspect.signature(cls.__init__).parameters.values())[1:]
    names = [p.name for p in params]
    shared = signature_names()
    if tuple(names[:len(shared)]) != shared:
        problems.append(f"{where}.__init__ starts with {names[:len(shared)]}, the declaration "
                        f"has {list(shared)}")
    by_name = {p.name: p for p in params}
    for i, p in enumerate(params):
        kind = inspect.Parameter.POSITIONAL_OR_KEYWORD if i == 0 else inspect.Parameter.KEYWORD_ONLY
        if p.kind != kind:
            problems.append(f"{where}.__init__: {p.name} should be {kind.description}")
    constraints = cls._parameter_constraints
    doc = {} if abstract else _documented_parameters(cls.__doc__)
    for decl in NETWORK_PARAMETERS:
        if decl.name in by_name and not _same(by_name[decl.name].default, decl.default):
            problems.append(f"{where}.__init__: {decl.name}={by_name[decl.name].default!r}, "
                            f"the declaration has {decl.default!r}")
        got = [_constraint_key(c) for c in constraints.get(decl.name, [])]
        if got != [_constraint_key(c) for c in decl.constraints]:
            problems.append(f"{where}._parameter_constraints[{decl.name!r}] is not the "
                            f"declaration's")
        if abstract:
            continue
        want = (f"{decl.type}, default={decl.default_text()}",
                textwrap.dedent(decl.doc).strip())
        if doc.get(decl.name) != want:
            problems.append(f"{where}'s docstring does not document {decl.name} as declared")
    if abstract:
        return problems
    for name in names:
        if name not in constraints:
            problems.append(f"{where}._parameter_constraints has no entry for {name}")
        if name not in doc:
            problems.append(f"{where}'s docstring does not document {name}")
    for name in set(constraints) - set(names):
        problems.append(f"{where}._parameter_constraints names {name}, not a parameter")
    for name in set(doc) - set(names):
        problems.append(f"{where}'s docstring documents {name}, not a parameter")
    return problems


def test_every_public_network_estimator_is_checked():
    # The trainers own the training parameters; the meta-estimators take a trainer
    # (estimator=) and declare none of them (tests/test_meta.py).
    assert {cls.__name__ for cls in ESTIMATORS} == {"PathKernelMachine", "PathKernelClassifier"}
    for name in ("TangentFeatures", "TangentFeatureSVM", "OODRankDetector"):
        params = getattr(skpathkernel, name)().get_params(deep=False)
        # random_state is their own: it seeds the default trainer (and a projection).
        assert set(params) & {p.name for p in NETWORK_PARAMETERS} == {"random_state"}, name


@pytest.mark.parametrize("cls", ESTIMATORS, ids=lambda c: c.__name__)
def test_estimator_agrees_with_the_declaration(cls):
    assert declaration_problems(cls) == []


def test_the_base_agrees_with_the_declaration():
    assert declaration_problems(BasePathKernelNetwork, abstract=True) == []


def test_documented_defaults_are_the_defaults():
    for decl in NETWORK_PARAMETERS:
        assert _same(eval(decl.default_text(), {}), decl.default), decl.name


def test_the_shared_docs_are_the_declaration():
    # Every declared entry, in order, and nothing else.
    doc = "Parameters\n----------" + textwrap.dedent(network_params_doc())
    assert list(_documented_parameters(doc)) == [p.name for p in NETWORK_PARAMETERS]


def test_the_check_names_what_disagrees():
    # A subclass that re-defaults a parameter, forgets one, constrains one differently
    # and documents one twice: the check must say so (it is no use if it cannot fail).
    Machine = skpathkernel.PathKernelMachine

    class Drifted(Machine):
        """Drifted.

        Parameters
        ----------
        hidden_layer_sizes : array-like of int, default=(64, 64)
            Widths.
        """

        _parameter_constraints = {**Machine._parameter_constraints, "alpha": [None]}

        def __init__(self, hidden_layer_sizes=(64, 64), *, activation="tanh",
                     module=None, normalize_y=True):
            pass

    problems = "\n".join(declaration_problems(Drifted))
    assert "Drifted.__init__ starts with" in problems
    assert "activation='tanh', the declaration has 'gelu'" in problems
    assert "_parameter_constraints['alpha'] is not the declaration's" in problems
    assert "docstring does not document solver as declared" in problems
    assert "names solver, not a parameter" in problems
    assert "docstring does not document normalize_y" in problems
