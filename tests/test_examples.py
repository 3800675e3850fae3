"""Every gallery example runs headless (Agg) and leaves figures behind."""

import pathlib
import runpy

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt
import pytest

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
    runpy.run_path(str(path), run_name="__main__")
    assert plt.get_fignums(), f"{path.name} drew no figure"
    plt.close("all")
