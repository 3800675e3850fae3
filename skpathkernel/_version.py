"""The package's version: one place, read by the build (pyproject.toml) and by the
version stamp of pickles (:mod:`skpathkernel._warnings`)."""

__version__ = "0.1.0.dev0"
