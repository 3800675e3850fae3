"""Every gallery example runs headless (Agg) and leaves figures behind."""

import pathlib
import runpy
import warnings

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import pytest
from sklearn.exceptions import ConvergenceWarning

EXAMPLES = sorted((pathlib.Path(__file__).parent.parent / "examples").glob("plot_*.py"))


def test_examples_found():
    assert len(EXAMPLES) >= 5


@pytest.mark.parametrize(
    "path",
    # Examples that start a Dask cluster are deselected with the dask tests.
    [pytest.param(p, marks=pytest.mark.dask) if "dask" in p.name else p for p in EXAMPLES],
    ids=lambda p: p.name,
)
def test_example_runs(path):
    plt.close("all")
    with warnings.catch_warnings(record=True) as caught:
        # An example that leaves its reader with a ConvergenceWarning is a wrong example
        # (as a user guide block is, tests/test_docs.py); one that shows it on purpose
        # catches it itself.
        warnings.simplefilter("error", ConvergenceWarning)
        runpy.run_path(str(path), run_name="__main__")
    assert plt.get_fignums(), f"{path.name} drew no figure"
    plt.close("all")
    # A path kernel over a thinned path warns that it is a Riemann sum of unknown accuracy:
    # an example whose kernel is one says so in its text.
    thinned = [w for w in caught if "Riemann sum" in str(w.message)]
    assert not thinned or "Riemann sum" in path.read_text(), (
        f"{path.name}: {thinned[0].message}")
