"""Sphinx configuration for the skpathkernel documentation."""

import os
import sys
import warnings

sys.path.insert(0, os.path.abspath(".."))
os.environ.setdefault("MPLBACKEND", "Agg")
warnings.filterwarnings("ignore", category=DeprecationWarning, message=".*torch.jit.script.*")

import numpy as np  # noqa: E402

import skpathkernel  # noqa: E402

project = "skpathkernel"
author = "skpathkernel developers"
copyright = "2026, skpathkernel developers"
release = skpathkernel.__version__
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.intersphinx",
    "sphinx.ext.mathjax",
    # MathJax served from the built site: formulas render offline and behind firewalls.
    "sphinx-mathjax-offline",
    "sphinx.ext.viewcode",
    "numpydoc",
    "sphinx_gallery.gen_gallery",
]

autosummary_generate = True
autodoc_default_options = {"members": True}
numpydoc_show_class_members = False
numpydoc_class_members_toctree = False
templates_path = ["_templates"]
exclude_patterns = ["_build", "auto_examples/*.ipynb", "auto_examples/*.py"]

_INTERSPHINX = {
    "python": ("https://docs.python.org/3", None),
    "numpy": ("https://numpy.org/doc/stable", None),
    "sklearn": ("https://scikit-learn.org/stable", None),
    "torch": ("https://pytorch.org/docs/stable", None),
}


def _online(host="scikit-learn.org"):
    import socket

    try:
        socket.create_connection((host, 443), timeout=3).close()
    except OSError:
        return False
    return True


# Offline builds (CI reaches only package registries) skip the cross-links rather than
# warn; with network access the links to numpy, sklearn and torch are added.
intersphinx_mapping = _INTERSPHINX if _online() else {}
intersphinx_timeout = 5

sphinx_gallery_conf = {
    "examples_dirs": "../examples",
    "gallery_dirs": "auto_examples",
    "filename_pattern": "/plot_",
    "download_all_examples": False,
    "remove_config_comments": True,
    "reference_url": {"skpathkernel": None},
}

html_theme = "pydata_sphinx_theme"
html_title = f"skpathkernel {release}"
html_theme_options = {"navigation_with_keys": False}


def _skip_numpy_members(app, what, name, obj, skip, options):
    """NumPy's own members of an ndarray subclass (AttributionScores runs some of them on
    the plain array, so they are in its own namespace) are NumPy's to document."""
    return True if obj is getattr(np.ndarray, name, _skip_numpy_members) else None


def setup(app):
    app.connect("autodoc-skip-member", _skip_numpy_members)
