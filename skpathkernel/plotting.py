"""Visualizations of the kernel machine inside a trained network.

Every class follows scikit-learn's Display convention
(:class:`sklearn.metrics.ConfusionMatrixDisplay`): the constructor stores the data to draw,
``plot(ax=None, ...)`` draws it and sets ``ax_``, ``figure_`` and the artists, and the
``from_estimator`` class method computes the data from a fitted
:class:`~skpathkernel.PathKernelMachine` / :class:`~skpathkernel.PathKernelClassifier` and
plots it. matplotlib is imported only inside ``plot``, so importing this module costs
nothing without it; ``from_estimator`` checks that it is installed before computing
anything, as scikit-learn's displays do (the kernels can take minutes).

- :class:`KernelMatrixDisplay`: the (normalized) kernel matrix with samples ordered by
  class (Guo, He & Morel 2026, figures 2, 5, 6).
- :class:`KernelNeighborsDisplay`: the training points nearest to anchors under a kernel at
  a recorded step, or in input space (figures 1, 9).
- :class:`KernelEvolutionDisplay`: ``K_hat_t(x, y_j)`` along the recorded path (figure 10).
- :class:`RankGapDisplay`: numerical rank of the tangent features of ``X_train`` versus
  ``[X_train; X_test]`` along the path (figure 7, third column).
- :class:`TangentEmbeddingDisplay`: a 2-D embedding of tangent features (figure 4).
"""

from __future__ import annotations

import difflib
import inspect
import math
import numbers
import uuid
import warnings

import numpy as np
from scipy.sparse import issparse
from sklearn.base import is_classifier, is_outlier_detector, is_regressor
from sklearn.decomposition import KernelPCA
from sklearn.manifold import TSNE
from sklearn.utils._optional_dependencies import check_matplotlib_support
from sklearn.utils._param_validation import InvalidParameterError
from sklearn.utils.multiclass import type_of_target
from sklearn.utils.validation import check_array

from ._analysis._rank_gap import TangentSpan
from ._network._inputs import FEATURES
from ._network._trained import (
    _check_n_neighbors,
    check_step_applies,
    network_of,
    pipeline_last_step,
)
from ._validation import check_column_names, check_flag, is_option
from .kernels import PathKernel, step_kernel

__all__ = [
    "KernelEvolutionDisplay",
    "KernelMatrixDisplay",
    "KernelNeighborsDisplay",
    "RankGapDisplay",
    "TangentEmbeddingDisplay",
]


# --------------------------------------------------------------------------- helpers
def _axes(ax, display, colorbar=False):
    """The axes to draw ``display`` on, its figure, the artists already there, and the
    axes of the colour bar to draw into (None: a new one, taking room from ``ax``).

    None makes a new figure, as scikit-learn's displays do. An axes ``display`` drew on
    before is redrawn: its artists there are removed first, where drawing over them
    stacked a second colour bar beside the first (and a legend of both draws). A drawing
    with a colour bar (``colorbar``) draws it into the previous one's axes: removing that
    gave ``ax`` back the room it had when the bar was made, over a colour bar of the
    user's made since, which the heat map or points then covered."""
    import matplotlib.pyplot as plt

    cax = None
    if ax is None:
        _, ax = plt.subplots()
    else:
        key = display.__dict__.get("_drawing_key")
        artists, old = _drawings_on(ax).get(key, ((), None))
        if old is not None and old.ax in ax.figure.axes:
            if colorbar:
                cax = old.ax
                cax.clear()
            else:
                if old.mappable.axes is None:
                    # ax.clear() took the image or points it maps, through which its
                    # removal gives ax its room back (matplotlib failed on None).
                    old.mappable.axes = ax
                old.remove()
        there = set(ax.get_children())
        for artist in artists:
            if artist in there:  # not removed (ax.clear()) since
                artist.remove()
    return ax, ax.figure, set(ax.get_children()), cax


def _colorbar(fig, ax, cax, mappable):
    """A colour bar of ``mappable``: into ``cax`` (see :func:`_axes`), else beside ``ax``."""
    return fig.colorbar(mappable, ax=ax) if cax is None else fig.colorbar(mappable, cax=cax)


def _drawings_on(ax):
    """The displays' drawings on ``ax``, by display key (see :func:`_drawn`)."""
    return ax.__dict__.setdefault("_skpathkernel_drawings", {})


def _drawn(display, ax, fig, before):
    """Set ``display``'s ``ax_`` and ``figure_``, and note the artists its ``plot`` added
    to ``ax`` (its children not in ``before``) and its colour bar, for :func:`_axes` to
    remove when ``display`` draws on ``ax`` again (after drawing elsewhere too).

    The note is kept on ``ax``, under a key of the display's own: kept on the display,
    keyed by axes, it held every figure the display had drawn (plot() in a loop, each
    figure closed) alive as long as the display. A key, not the display's id, which a
    later display could reuse; the figure and the display pickle as before."""
    key = display.__dict__.setdefault("_drawing_key", uuid.uuid4().hex)
    _drawings_on(ax)[key] = ([a for a in ax.get_children() if a not in before],
                             getattr(display, "colorbar_", None))
    display.ax_, display.figure_ = ax, fig
    return display


# matplotlib's aliases (scikit-learn's _validate_style_kwargs resolves them as well): a
# user's ls= or lw= beside the display's linestyle= or linewidth= failed in matplotlib
# ("Got both 'linestyle' and 'ls'"), often after a first artist was drawn.
_ALIASES = {"ls": "linestyle", "c": "color", "ec": "edgecolor", "fc": "facecolor",
            "lw": "linewidth", "ds": "drawstyle", "aa": "antialiased", "ms": "markersize",
            "mec": "markeredgecolor", "mew": "markeredgewidth", "mfc": "markerfacecolor"}
# ax.scatter's own parameters are plural; its c= is not an alias of color=.
_SCATTER_ALIASES = {"lw": "linewidths", "linewidth": "linewidths", "ec": "edgecolors",
                    "edgecolor": "edgecolors", "fc": "facecolors", "facecolor": "facecolors",
                    "ls": "linestyles", "linestyle": "linestyles"}


def _style(own, user, scatter=False):
    """The user's matplotlib keywords over the display's ``own``, each under one name."""
    out, given = dict(own), {}
    for key, value in (user or {}).items():
        name = _SCATTER_ALIASES.get(key, key) if scatter else _ALIASES.get(key, key)
        if name in given:
            raise TypeError(f"Got both {given[name]!r} and {key!r}, which are aliases of "
                            "one another.")
        given[name] = key
        out[name] = value
    return out


def _check_kernel(kernel, allowed=("tangent", "path")):
    if not is_option(kernel, *allowed):
        raise ValueError(f"kernel must be one of {allowed}, got {kernel!r}.")


def _gram(estimator, X, *, kernel, step, normalized):
    """Gram of the tangent kernel at ``step`` or of the path kernel, as float64."""
    _check_kernel(kernel)
    if kernel == "tangent":
        return step_kernel(estimator, X, step=step, normalized=normalized)
    check_step_applies(kernel, step)
    return PathKernel(estimator, normalized=normalized)(X)


def _check_label_count(labels, n, name, what):
    """Refuse ``labels`` (None passes) that are not one per ``what``: they are drawn by
    position, and a count that differs fails in matplotlib, or only after the kernels."""
    if labels is not None and (isinstance(labels, str) or not hasattr(labels, "__len__")):
        # A string was taken for one label per character; an int failed in len().
        raise TypeError(f"{name} must be a sequence of labels, one per {what}, got "
                        f"{labels!r}.")
    if labels is not None and len(labels) != n:
        raise ValueError(f"{name} must name each {what} ({n}), got {len(labels)}.")


def _check_display_labels(display_labels, y):
    """Refuse ``display_labels`` without ``y``: they name the class blocks of ``y``, and
    without it there are none (they were silently not drawn)."""
    if display_labels is not None and y is None:
        raise ValueError("display_labels name the class blocks of y; pass y, the class of "
                         "each row, to draw them.")


def _check_class_colours(y, scatter_kw):
    """Refuse a colour of the user's where the points are coloured by class: matplotlib
    refused ``c`` only after the embedding was computed, and ``color`` drew over it."""
    clash = sorted({"c", "color"} & set(scatter_kw))
    if y is not None and clash:
        raise ValueError(
            f"{clash[0]}= conflicts with the colouring by class of y: choose the class "
            "colours with cmap, or pass y=None to colour the points yourself."
        )


def _neighbor_kws(scatter_kw, neighbor_kw, anchor_kw):
    """:class:`KernelNeighborsDisplay`'s artist keywords as dicts, the anchors' over
    their defaults. Checked before drawing (and, in ``from_estimator``, before the
    kernels): the points' colours are ``y``'s, and matplotlib refused a ``color`` beside
    the ``c`` they are drawn with only once the first scatter was on the axes."""
    kws = []
    for name, kw in (("scatter_kw", scatter_kw), ("neighbor_kw", neighbor_kw),
                     ("anchor_kw", anchor_kw)):
        if kw is not None and not isinstance(kw, dict):
            raise TypeError(f"{name} must be a dict of matplotlib keywords or None, got "
                            f"{type(kw).__name__}.")
        kws.append(_style({}, kw, scatter=True))
    for name, kw in zip(("scatter_kw", "neighbor_kw"), kws):
        # A norm failed beside the display's vmin/vmax (after the first scatter was
        # drawn); a cmap, vmin or vmax coloured these points unlike the others and the
        # colour bar.
        clash = sorted({"c", "color", "facecolors", "cmap", "norm", "vmin", "vmax"}
                       & set(kw))
        if clash:
            raise ValueError(f"{name}: {clash[0]}= conflicts with the colouring of the "
                             "points by y: choose their colours with cmap.")
    # The user's colour replaces the black (both c and color fail in matplotlib; c= won
    # over facecolors=, with a warning).
    colour = {"c", "color", "facecolors", "edgecolors"} & set(kws[2])
    own = {} if colour else {"c": "black"}
    kws[2] = {"marker": "x", "s": 80, "linewidths": 2.5, "zorder": 5, **own, **kws[2]}
    return kws


# Inputs with more values than this are named by their index in legends, not spelled out.
_SPELLED_OUT = 4


def _recorded_points(net, steps):
    """Recorded-point indices (non-negative, increasing, each once): all of them when
    ``steps`` is None. The displays draw against the optimizer step, so points given out
    of order would zigzag back along the axis."""
    n = len(net.trajectory)
    if steps is None:
        return np.arange(n)
    points = np.asarray(steps)
    if points.ndim != 1 or points.size == 0 or not np.issubdtype(points.dtype, np.integer):
        raise ValueError("steps must be None or a non-empty 1-D sequence of ints.")
    if np.any(points < -n) or np.any(points >= n):
        raise IndexError(f"steps must index the {n} recorded points, got {steps!r}.")
    return np.unique(points % n)


def _point_label(point, steps) -> str:
    """``point`` of a trajectory whose optimizer steps are ``steps``, as the titles say it:
    with ``record_every > 1`` its index is not the optimizer step the x-axes count."""
    point = point % len(steps)
    return f"recorded point {point} (optimizer step {int(steps[point])})"


def _kernel_label(kernel, step, normalized, steps):
    hat = "normalized " if normalized else ""
    if kernel == "path":
        return f"{hat}path kernel"
    return f"{hat}tangent kernel at {_point_label(step, steps)}"


# --------------------------------------------------------------------------- kernel matrix
class KernelMatrixDisplay:
    """Heat map of a kernel matrix over samples ordered by class, with block boundaries.

    Figures 2, 5 and 6 of Guo, He & Morel (2026): with samples sorted by class, a network
    whose tangent features have learned the task shows bright diagonal blocks (high
    within-class normalized kernel) on a dark background.

    Create it with :meth:`from_estimator`, or directly from a matrix.

    Parameters
    ----------
    kernel_matrix : ndarray of shape (n_samples, n_samples)
        The matrix to draw, rows and columns in display order.
    y : array-like of shape (n_samples,), default=None
        Class of each row, in display order (contiguous runs form the blocks). None draws
        no boundaries.
    display_labels : array-like, default=None
        Tick label of each block, in block order; defaults to the block's class value.
    title : str, default=None
        Title of the axes.

    Attributes
    ----------
    im_ : matplotlib AxesImage
    boundary_lines_ : list of matplotlib Line2D
    colorbar_ : matplotlib Colorbar or None
    ax_ : matplotlib Axes
    figure_ : matplotlib Figure

    See Also
    --------
    skpathkernel.kernels.step_kernel : The Gram at one recorded step.

    Examples
    --------
    >>> import numpy as np
    >>> from skpathkernel import PathKernelClassifier
    >>> from skpathkernel.plotting import KernelMatrixDisplay
    >>> rng = np.random.RandomState(0)
    >>> X = rng.uniform(-1, 1, (20, 2)); y = (X[:, 0] > 0).astype(int)
    >>> clf = PathKernelClassifier(hidden_layer_sizes=(8,), max_iter=5, tol=None, random_state=0)
    >>> disp = KernelMatrixDisplay.from_estimator(clf.fit(X, y), X, y)
    >>> disp.kernel_matrix.shape, bool(np.allclose(np.diag(disp.kernel_matrix), 1))
    ((20, 20), True)
    >>> disp.block_means().shape
    (2, 2)
    """

    def __init__(self, kernel_matrix, *, y=None, display_labels=None, title=None):
        self.kernel_matrix = kernel_matrix
        self.y = y
        self.display_labels = display_labels
        self.title = title

    def _blocks(self):
        """(class values, start indices, stop indices) of the contiguous runs of y."""
        y = np.asarray(self.y)
        same = y[1:] == y[:-1]
        if y.dtype.kind in "fc":
            # NaN != NaN made each NaN label a block of its own, where np.unique (which
            # counts the classes that display_labels must name) sees one class.
            same |= np.isnan(y[1:]) & np.isnan(y[:-1])
        starts = np.flatnonzero(np.r_[True, ~same])
        stops = np.r_[starts[1:], len(y)]
        return y[starts], starts, stops

    def block_means(self, *, include_diagonal: bool = False) -> np.ndarray:
        """Mean of the matrix over each pair of class blocks.

        Parameters
        ----------
        include_diagonal : bool, default=False
            The diagonal of a normalized kernel is 1 by construction; leaving it out makes
            the within-class means measure similarity between *different* samples.

        Returns
        -------
        means : ndarray of shape (n_blocks, n_blocks)
        """
        if self.y is None:
            raise ValueError("block_means needs the class of each row (y).")
        K = np.asarray(self.kernel_matrix, dtype=np.float64)
        mask = np.ones(K.shape, dtype=bool)
        if not include_diagonal:
            np.fill_diagonal(mask, False)
        _, starts, stops = self._blocks()
        out = np.empty((len(starts), len(starts)))
        for a, (i0, i1) in enumerate(zip(starts, stops)):
            for b, (j0, j1) in enumerate(zip(starts, stops)):
                m = mask[i0:i1, j0:j1]
                out[a, b] = K[i0:i1, j0:j1][m].mean() if m.any() else np.nan
        return out

    def plot(self, *, ax=None, cmap: str = "viridis", vmin=None, vmax=None,
             colorbar: bool = True, boundary_kw: dict | None = None, im_kw: dict | None = None):
        """Draw the heat map.

        Parameters
        ----------
        ax : matplotlib Axes, default=None
            Axes to draw on; a new figure is created when None. An axes this display
            drew on before is redrawn (its image there removed, its colour bar drawn
            again in place; the user's own artists stay).
        cmap : str or Colormap, default="viridis"
            Matplotlib colormap.
        vmin, vmax : float, default=None
            Colour limits (default: the data's range).
        colorbar : bool, default=True
            Whether to draw a colorbar.
        boundary_kw : dict, default=None
            Keyword arguments of the block-boundary lines (``ax.axhline``), over the
            display's own (an alias, ``c``, ``ls`` or ``lw``, replaces the keyword it
            stands for).
        im_kw : dict, default=None
            Keyword arguments of ``ax.imshow`` (as scikit-learn's
            :class:`~sklearn.metrics.ConfusionMatrixDisplay`), over the display's own:
            ``norm=matplotlib.colors.LogNorm()`` for an unnormalized kernel's range (with
            ``vmin=vmax=None``), ``interpolation``, ``aspect``.

        Returns
        -------
        display : KernelMatrixDisplay
        """
        check_matplotlib_support("KernelMatrixDisplay.plot")
        _check_display_labels(self.display_labels, self.y)
        if self.y is not None:
            # Checked before drawing, which a refusal would leave half done.
            values, starts, stops = self._blocks()
            _check_label_count(self.display_labels, len(starts), "display_labels", "class")
        ax, fig, before, cax = _axes(ax, self, colorbar)
        K = np.asarray(self.kernel_matrix)
        self.im_ = ax.imshow(K, **{"cmap": cmap, "vmin": vmin, "vmax": vmax,
                                   "interpolation": "nearest", **(im_kw or {})})
        self.boundary_lines_ = []
        if self.y is not None:
            kw = _style({"color": "white", "linestyle": "--", "linewidth": 0.8}, boundary_kw)
            for s in starts[1:]:
                self.boundary_lines_.append(ax.axhline(s - 0.5, **kw))
                self.boundary_lines_.append(ax.axvline(s - 0.5, **kw))
            labels = values if self.display_labels is None else self.display_labels
            centres = (starts + stops - 1) / 2
            ax.set_xticks(centres, [str(v) for v in labels], fontsize="small")
            ax.set_yticks(centres, [str(v) for v in labels], fontsize="small")
        self.colorbar_ = _colorbar(fig, ax, cax, self.im_) if colorbar else None
        if self.title is not None:
            ax.set_title(self.title)
        return _drawn(self, ax, fig, before)

    @classmethod
    def from_estimator(cls, estimator, X, y=None, *, kernel: str = "tangent", step: int = -1,
                       normalized: bool = True, display_labels=None, ax=None,
                       cmap: str = "viridis", vmin=None, vmax=None, colorbar: bool = True,
                       boundary_kw: dict | None = None, im_kw: dict | None = None):
        """Compute the kernel matrix of ``X`` under a fitted network and plot it.

        Parameters
        ----------
        estimator : fitted skpathkernel estimator, RecordedNetwork or TrainedNetwork
            The fitted network whose recorded path is read; or a fitted Pipeline ending
            in one, whose steps before it transform the inputs, or a search refitted on
            one (its ``best_estimator_``).
        X : array-like of shape (n_samples, n_features) or (n_samples, ...)
            In the form of the estimator's training inputs (images, token ids, ...).
        y : array-like of shape (n_samples,), default=None
            Class of each sample: samples are reordered by class (stably) and the class
            blocks are outlined. None keeps the order of ``X``. Continuous values (a
            regressor's float targets, see :class:`KernelNeighborsDisplay`) are refused.
        kernel : {"tangent", "path"}, default="tangent"
            The tangent kernel at recorded point ``step`` or the path kernel (over every
            recorded point: ``step`` other than -1 is refused).
        step : int, default=-1
            Recorded point of ``estimator.trajectory_`` (0: initialization).
        normalized : bool, default=True
            Plot ``K(x, x') / sqrt(K(x, x) K(x', x'))`` (Guo, He & Morel's ``K_hat``).
        display_labels, ax, cmap, vmin, vmax, colorbar, boundary_kw, im_kw
            See :meth:`plot`.

        Returns
        -------
        display : KernelMatrixDisplay
            ``display.order`` holds the indices into ``X`` of the displayed rows.
        """
        check_matplotlib_support(f"{cls.__name__}.from_estimator")
        _check_display_labels(display_labels, y)
        estimator, X = pipeline_last_step(estimator, X)
        net = network_of(estimator)
        check_column_names(estimator, X)
        X = net.check(X)
        order = np.arange(X.shape[0])
        if y is not None:
            y = _labels(y, X.shape[0])
            if _drawn_as_values(y, _regressor_values(estimator, y)):
                # Each distinct value was a class of its own: a boundary between every
                # two rows, and display_labels checked against as many classes.
                raise ValueError(
                    "KernelMatrixDisplay outlines the blocks of classes, and y holds "
                    "continuous values (a regression target): pass class labels (e.g. "
                    "np.digitize(y, bins)) or y=None.")
            order = np.argsort(y, kind="stable")
            y = y[order]
            _check_label_count(display_labels, len(np.unique(y)), "display_labels", "class")
        K = _gram(net, X[order], kernel=kernel, step=step, normalized=normalized)
        title = _kernel_label(kernel, step, normalized, net.trajectory.steps)
        disp = cls(K, y=y, display_labels=display_labels, title=title)
        disp.order = order
        return disp.plot(ax=ax, cmap=cmap, vmin=vmin, vmax=vmax, colorbar=colorbar,
                         boundary_kw=boundary_kw, im_kw=im_kw)


# --------------------------------------------------------------------------- neighbours
class KernelNeighborsDisplay:
    """Training points nearest to anchor inputs, on a scatter plot of the training set.

    Figure 1 of Guo, He & Morel (2026): the training set coloured by label, anchors as black
    crosses, and for each anchor its ``n_neighbors`` nearest training points (under the
    normalized kernel at a recorded step, or Euclidean in input space) drawn larger and
    outlined. Training sharpens kernel neighbourhoods into label-homogeneous sets, which
    :meth:`purity` measures. Inputs must be 2-D.

    Parameters
    ----------
    X : ndarray of shape (n_train, 2)
        The training inputs.
    y : ndarray of shape (n_train,)
        Their labels.
    anchors : ndarray of shape (n_anchors, 2)
        The points whose kernel neighbours are drawn.
    neighbors : ndarray of int of shape (n_anchors, n_neighbors)
        Indices into ``X`` of each anchor's neighbours.
    distances : ndarray of shape (n_anchors, n_neighbors), default=None
        Their distances to the anchor, increasing along each row: in the kernel's feature
        space (``sqrt(2 - 2 K_hat)`` for the normalized kernel, see
        :meth:`~skpathkernel.PathKernelMachine.kneighbors`) or Euclidean in input space.
        Not drawn; :meth:`from_estimator` fills it.
    continuous : bool, default=None
        Whether ``y`` holds values (a regression target), drawn by value on a colour bar
        and refused by :meth:`purity`, rather than labels. None decides from ``y`` as
        scikit-learn's ``type_of_target`` does ("continuous": floats that are not all
        integers); :meth:`from_estimator` decides by the estimator (a regressor's
        targets or predictions are values whatever their dtype: ``load_diabetes``' are
        all integers).
    title : str, default=None
        Title of the axes.

    Attributes
    ----------
    scatter_ : matplotlib PathCollection
        The training set.
    neighbor_scatters_ : list of matplotlib PathCollection
        One per anchor.
    anchor_scatter_ : matplotlib PathCollection
    colorbar_ : matplotlib Colorbar or None
        The colour bar of continuous ``y`` (regression targets or a regressor's
        predictions), else None.
    ax_ : matplotlib Axes
    figure_ : matplotlib Figure

    Examples
    --------
    >>> import numpy as np
    >>> from skpathkernel import PathKernelClassifier
    >>> from skpathkernel.plotting import KernelNeighborsDisplay
    >>> rng = np.random.RandomState(0)
    >>> X = rng.uniform(-1, 1, (30, 2)); y = (X[:, 0] > 0).astype(int)
    >>> clf = PathKernelClassifier(hidden_layer_sizes=(8,), max_iter=5, tol=None, random_state=0)
    >>> disp = KernelNeighborsDisplay.from_estimator(clf.fit(X, y), [[0.5, 0.0]],
    ...                                              n_neighbors=5, y=y, kernel="euclidean")
    >>> disp.neighbors.shape, float(disp.purity()[0])
    ((1, 5), 1.0)
    """

    def __init__(self, X, y, anchors, neighbors, *, distances=None, continuous=None,
                 title=None):
        self.X = X
        self.y = y
        self.anchors = anchors
        self.neighbors = neighbors
        self.distances = distances
        self.continuous = continuous
        self.title = title

    def purity(self) -> np.ndarray:
        """Fraction of each anchor's neighbours that carry their most common label.

        1 means a label-homogeneous neighbourhood; ``1 / n_classes`` a fully mixed one.
        Continuous ``y`` (a regression target) is refused: each value is a label of its
        own, and the purity of any neighbourhood of distinct values is ``1 / n_neighbors``.

        Returns
        -------
        purity : ndarray of shape (n_anchors,)
        """
        if _drawn_as_values(self.y, self.continuous):
            raise ValueError(
                "purity counts labels, and y holds continuous values (a regression target "
                "or a regressor's predictions): compare the neighbours' values, "
                "y[neighbors], instead."
            )
        labels = _labels(self.y, len(self.y))[np.asarray(self.neighbors)]
        out = np.empty(labels.shape[0])
        for a, row in enumerate(labels):
            _, counts = np.unique(row, return_counts=True)
            out[a] = counts.max() / row.size
        return out

    def plot(self, *, ax=None, cmap: str = "coolwarm", legend: bool = True,
             scatter_kw: dict | None = None, neighbor_kw: dict | None = None,
             anchor_kw: dict | None = None):
        """Draw the training set, the anchors and their neighbourhoods.

        Parameters
        ----------
        ax : matplotlib Axes, default=None
            Axes to draw on; None creates a new figure. An axes this display drew on
            before is redrawn (its drawing there removed, its colour bar drawn again in
            place; the user's own artists stay).
        cmap : str or Colormap, default="coolwarm"
            Colours of the labels; continuous ``y`` (regression targets) is drawn by value
            on this map, read off a colour bar (``colorbar_``).
        legend : bool, default=True
            Name each anchor by its coordinates.
        scatter_kw : dict, default=None
            Keyword arguments of ``ax.scatter`` for the training set (``scatter_``), over
            the display's own (``s=6``, ``alpha=0.25``, ``linewidths=0``). The points
            are coloured by ``y``: ``c``, ``color``, ``facecolors``, ``cmap``, ``norm``,
            ``vmin`` or ``vmax`` is refused (choose the colours with ``cmap``).
            matplotlib's aliases (``lw``, ``ec``, ``linewidth``, ...) replace the
            display's keyword they stand for.
        neighbor_kw : dict, default=None
            Keyword arguments of ``ax.scatter`` for each anchor's neighbours
            (``neighbor_scatters_``), over the display's own (``s=22``, a marker per
            anchor, ``edgecolors="black"``, ``linewidths=0.4``). A ``marker`` given is
            every anchor's, in the legend too; the colours are refused and the aliases
            resolved, as in ``scatter_kw``.
        anchor_kw : dict, default=None
            Keyword arguments of ``ax.scatter`` for the anchors (``anchor_scatter_``),
            over the display's own (``marker="x"``, black, ``s=80``, ``linewidths=2.5``);
            ``c``, ``color``, ``facecolor(s)`` or ``edgecolor(s)`` replaces the black.

        Returns
        -------
        display : KernelNeighborsDisplay
        """
        check_matplotlib_support("KernelNeighborsDisplay.plot")
        scatter_kw, neighbor_kw, anchor_kw = _neighbor_kws(scatter_kw, neighbor_kw,
                                                           anchor_kw)
        X, y = np.asarray(self.X), np.asarray(self.y)
        values = _drawn_as_values(y, self.continuous)
        ax, fig, before, cax = _axes(ax, self, values)
        if values:
            # Coded by rank as classes, each value was a class of its own: the colours
            # were spaced by rank, not value, with no scale to read them by.
            codes = y.astype(np.float64)
            vmin, vmax = np.nanmin(codes), np.nanmax(codes)
        else:
            classes, codes = np.unique(y, return_inverse=True)
            vmin, vmax = 0, max(len(classes) - 1, 1)
        # The whole set faint, so that the highlighted neighbourhoods stand out.
        self.scatter_ = ax.scatter(X[:, 0], X[:, 1], c=codes, **{
            "cmap": cmap, "vmin": vmin, "vmax": vmax, "s": 6, "alpha": 0.25,
            "linewidths": 0, **scatter_kw})
        self.neighbor_scatters_ = []
        markers = ["o", "s", "^", "D", "v", "P"]
        A = np.asarray(self.anchors)
        # Each anchor's marker, for its neighbours and its legend entry alike.
        marks = [neighbor_kw.get("marker", markers[a % len(markers)]) for a in range(len(A))]
        for idx, marker in zip(np.asarray(self.neighbors), marks):
            self.neighbor_scatters_.append(ax.scatter(X[idx, 0], X[idx, 1], c=codes[idx], **{
                "cmap": cmap, "vmin": vmin, "vmax": vmax, "s": 22, "edgecolors": "black",
                "linewidths": 0.4, **neighbor_kw, "marker": marker}))
        # Opaque, on the neighbours' scale (the faint set's alpha would wash it out).
        self.colorbar_ = (_colorbar(fig, ax, cax, (self.neighbor_scatters_ or [self.scatter_])[0])
                          if values else None)
        self.anchor_scatter_ = ax.scatter(A[:, 0], A[:, 1], **anchor_kw)
        if legend:
            handles = [
                ax.scatter([], [], marker=marker, facecolors="none",
                           edgecolors="black", label=f"({p[0]:.2g}, {p[1]:.2g})")
                for marker, p in zip(marks, A)
            ]
            ax.legend(handles=handles, fontsize="x-small", loc="upper right",
                      title="anchors", title_fontsize="x-small")
        ax.set_aspect("equal", adjustable="datalim")
        if self.title is not None:
            ax.set_title(self.title, fontsize="small")
        return _drawn(self, ax, fig, before)

    @classmethod
    def from_estimator(cls, estimator, anchors, n_neighbors: int = 100, *, y=None,
                       step: int = -1, kernel: str = "tangent", normalized: bool = True,
                       continuous=None, ax=None, cmap: str = "coolwarm", legend: bool = True,
                       scatter_kw: dict | None = None, neighbor_kw: dict | None = None,
                       anchor_kw: dict | None = None):
        """Find each anchor's nearest training points and plot them.

        Parameters
        ----------
        estimator : fitted PathKernelMachine or PathKernelClassifier on 2-D inputs
            Its training inputs ``X_fit_`` are the candidates; or a fitted Pipeline
            ending in one, whose steps before it transform the anchors (the points are
            then drawn as the network takes them, after those steps), or a search
            refitted on one (its ``best_estimator_``). Its
            ``network_`` (a TrainedNetwork), which has no predictions, and a
            RecordedNetwork kept with its ``X_train``, which predicts raw outputs, not
            labels, need ``y``.
        anchors : array-like of shape (n_anchors, 2)
            The points whose kernel neighbours are drawn.
        n_neighbors : int, default=100
            Number of kernel neighbours drawn per anchor.
        y : array-like of shape (n_train,), default=None
            Labels of the training set, in fit order. None colours the points by the
            network's prediction instead (the estimator does not keep ``y``). A
            regressor's ``y`` (or predictions), float or int, is drawn by value, see
            ``continuous``.
        step : int, default=-1
            Recorded point of the tangent kernel (0: initialization).
        kernel : {"tangent", "path", "euclidean"}, default="tangent"
            Kernel neighbours (see :meth:`~skpathkernel.PathKernelMachine.kneighbors`) or, for
            comparison, Euclidean neighbours in input space.
        normalized : bool, default=True
            Rank by the normalized kernel ``K_hat`` (Guo, He & Morel's choice).
        continuous : bool, default=None
            Whether ``y`` holds values, drawn by value on a colour bar, rather than
            labels. None decides by the estimator: a regressor's ``y`` (or predictions)
            are values whatever their dtype; otherwise as scikit-learn's
            ``type_of_target`` says ("continuous": floats that are not all integers).
            False draws a regressor's int groups as labels.
        ax, cmap, legend, scatter_kw, neighbor_kw, anchor_kw
            See :meth:`plot`.

        Returns
        -------
        display : KernelNeighborsDisplay
        """
        check_matplotlib_support(f"{cls.__name__}.from_estimator")
        # The artists' keywords and continuous, before the kernels.
        _neighbor_kws(scatter_kw, neighbor_kw, anchor_kw)
        if continuous is not None:
            check_flag(continuous, "continuous")
        estimator, anchors = pipeline_last_step(estimator, anchors)
        net = network_of(estimator)
        _check_kernel(kernel, ("tangent", "path", "euclidean"))
        X = net.X_fit
        if X is None:
            # A RecordedNetwork kept without X_train: no candidates to draw (X.ndim
            # below failed on None).
            raise ValueError(
                "KernelNeighborsDisplay needs the training inputs: this network was kept "
                "without them (pass X_train to PathRecorder.as_estimator)."
            )
        if X.ndim != 2 or X.shape[1] != 2:
            raise ValueError(
                "KernelNeighborsDisplay draws 2-D inputs; the estimator's inputs have shape "
                f"(n_samples, {', '.join(map(str, X.shape[1:]))})."
            )
        check_column_names(estimator, anchors)
        # As given to kneighbors, which checks their names (and warns on an array's lack
        # of them when the fit had names).
        queries, anchors = anchors, check_array(anchors, dtype=np.float64)
        if y is None and not (hasattr(estimator, "__sklearn_tags__") and (
                is_classifier(estimator) or is_regressor(estimator)
                or is_outlier_detector(estimator))):
            # A TrainedNetwork or a transformer has no predict, and a RecordedNetwork's
            # gives the raw outputs (logits, shape (n, C)): none predicts labels.
            raise TypeError(
                f"{type(estimator).__name__} predicts no labels to colour the training "
                "points by: pass the training labels as y."
            )
        if y is None:
            with warnings.catch_warnings():
                # X_fit_ is the fit's own data, kept without its column names.
                warnings.filterwarnings("ignore", "X does not have valid feature names",
                                        UserWarning)
                y = estimator.predict(X)
        y = _labels(y, X.shape[0], "y (default: the estimator's predictions on X_fit_)")
        # Before the kernels: labels that are not numbers, said to be values, failed in
        # plot's float conversion after them.
        continuous = _values_by_estimator(estimator, y, continuous)
        if kernel == "euclidean":
            # As kneighbors checks them for the kernels: a bool is not a count, and the
            # kernels' options, unused here, were taken whatever they were (step="a").
            _check_n_neighbors(n_neighbors, len(X))
            check_step_applies(kernel, step)
            check_flag(normalized, "normalized")
            # kneighbors checks the kernel's queries; these distances would broadcast a
            # one-feature anchor against both columns.
            if anchors.shape[1] != X.shape[1]:
                raise ValueError(
                    f"anchors have {anchors.shape[1]} features, but the estimator is "
                    f"expecting {X.shape[1]} features as input."
                )
            d = ((anchors[:, None, :] - X[None, :, :]) ** 2).sum(-1)
            neighbors = np.argsort(d, axis=1, kind="stable")[:, :n_neighbors]
            distances = np.sqrt(np.take_along_axis(d, neighbors, axis=1))
            title = f"{n_neighbors} nearest training points, Euclidean"
        else:
            # The estimator's own kneighbors where it has one: an estimator's also
            # checks the anchors' column names against the fit's.
            finder = estimator if hasattr(estimator, "kneighbors") else net
            distances, neighbors = finder.kneighbors(queries, n_neighbors, kernel=kernel,
                                                     step=step, normalized=normalized)
            title = (f"{n_neighbors} nearest under the "
                     f"{_kernel_label(kernel, step, normalized, net.trajectory.steps)}")
        disp = cls(X, y, anchors, neighbors, distances=distances,
                   continuous=continuous, title=title)
        return disp.plot(ax=ax, cmap=cmap, legend=legend, scatter_kw=scatter_kw,
                         neighbor_kw=neighbor_kw, anchor_kw=anchor_kw)


# --------------------------------------------------------------------------- evolution
class KernelEvolutionDisplay:
    """The (normalized) kernel between a fixed ``x`` and several ``y_j`` over training.

    Figure 10 of Guo, He & Morel (2026): same-label pairs keep a normalized tangent kernel
    near 1 while opposite-label pairs decay towards 0 or below.

    Parameters
    ----------
    steps : ndarray of shape (n_points,)
        Optimizer step index of each recorded point shown (``trajectory_.steps``).
    kernel_values : ndarray of shape (n_points, n_Y)
        ``K_t(x, y_j)`` at each of them.
    x : ndarray of shape (n_features,) or the estimator's ``input_shape_``
        The fixed point.
    Y : ndarray of shape (n_Y, n_features) or (n_Y, ...)
        The points whose kernel with ``x`` is drawn, one curve each.
    labels : list of str, default=None
        Legend entry of each ``y_j`` (default: its coordinates, or ``y_j`` for inputs of
        more than 4 values, such as images).
    ylabel : str, default="normalized tangent kernel"
        Label of the y axis.

    Attributes
    ----------
    lines_ : list of matplotlib Line2D
    ax_ : matplotlib Axes
    figure_ : matplotlib Figure

    Examples
    --------
    >>> import numpy as np
    >>> from skpathkernel import PathKernelClassifier
    >>> from skpathkernel.plotting import KernelEvolutionDisplay
    >>> rng = np.random.RandomState(0)
    >>> X = rng.uniform(-1, 1, (20, 2)); y = (X[:, 0] > 0).astype(int)
    >>> clf = PathKernelClassifier(hidden_layer_sizes=(8,), max_iter=4, tol=None, random_state=0)
    >>> disp = KernelEvolutionDisplay.from_estimator(clf.fit(X, y), [0, 0], [[0, 0], [1, 0]])
    >>> disp.kernel_values.shape, bool(np.allclose(disp.kernel_values[:, 0], 1))
    ((5, 2), True)
    """

    def __init__(self, steps, kernel_values, *, x, Y, labels=None,
                 ylabel="normalized tangent kernel"):
        self.steps = steps
        self.kernel_values = kernel_values
        self.x = x
        self.Y = Y
        self.labels = labels
        self.ylabel = ylabel

    def plot(self, *, ax=None, legend: bool = True, **line_kw):
        """Draw one line per ``y_j``.

        Parameters
        ----------
        ax : matplotlib Axes, default=None
            Axes to draw on; None creates a new figure. An axes this display drew on
            before is redrawn (its lines there removed; the user's own artists stay).
        legend : bool, default=True
            Whether to draw a legend.
        **line_kw : dict
            Passed to ``ax.plot``.

        Returns
        -------
        display : KernelEvolutionDisplay
        """
        check_matplotlib_support("KernelEvolutionDisplay.plot")
        ax, fig, before, _ = _axes(ax, self)
        labels = self.labels
        values = np.asarray(self.kernel_values)
        _check_label_count(labels, values.shape[1], "labels", "row of Y")
        spelled = np.asarray(self.x).size <= _SPELLED_OUT
        if labels is None and spelled:
            # Raveled: an input of a few values may have several axes (a 2 x 2 image),
            # whose rows cannot be formatted as numbers.
            labels = ["y=(" + ", ".join(f"{v:.3g}" for v in np.ravel(yj)) + ")"
                      for yj in self.Y]
        elif labels is None:
            labels = [f"y_{j}" for j in range(len(self.Y))]
        self.lines_ = [
            # The user's label wins (scikit-learn's displays let keywords override).
            ax.plot(self.steps, values[:, j], **{"label": labels[j], **line_kw})[0]
            for j in range(values.shape[1])
        ]
        ax.set_xlabel("optimizer step")
        if spelled:
            x = ", ".join(f"{v:.3g}" for v in np.asarray(self.x).ravel())
            ax.set_ylabel(f"{self.ylabel} with x=({x})")
        else:
            ax.set_ylabel(f"{self.ylabel} with x")
        if legend:
            ax.legend(fontsize="small")
        return _drawn(self, ax, fig, before)

    @classmethod
    def from_estimator(cls, estimator, x, Y, *, steps=None, normalized: bool = True,
                       preconditioned: bool = False, labels=None, ax=None, **line_kw):
        """Evaluate the step kernel between ``x`` and each row of ``Y`` along the path.

        Parameters
        ----------
        estimator : fitted skpathkernel estimator, RecordedNetwork or TrainedNetwork
            The fitted network whose recorded path is read; or a fitted Pipeline ending
            in one, whose steps before it transform the inputs, or a search refitted on
            one (its ``best_estimator_``).
        x : array-like of shape (n_features,) or the estimator's ``input_shape_``
            One input, without the sample axis. For a network kept without its training
            inputs (a ``RecordedNetwork`` without ``X_train``), whose input form is
            unknown, a 1-D ``x`` is one input and any other is taken with its sample axis.
        Y : array-like of shape (n_Y, n_features) or (n_Y, ...)
            The points whose kernel with ``x`` is drawn, one curve each.
        steps : sequence of int, default=None
            Recorded points to evaluate (indices into ``trajectory_``; negative count from
            the end); None: all of them. They are drawn along the path, in increasing
            order, each once.
        normalized : bool, default=True
            ``K_hat_t(x, y) = K_t(x, y) / sqrt(K_t(x, x) K_t(y, y))``.
        preconditioned : bool, default=False
            Use the optimizer-weighted step kernel ``J_t D_t J_t^T`` instead of the tangent
            kernel (see :func:`skpathkernel.kernels.step_kernel`).
        labels, ax, **line_kw
            See :meth:`plot` and the class parameters.

        Returns
        -------
        display : KernelEvolutionDisplay
        """
        check_matplotlib_support(f"{cls.__name__}.from_estimator")
        if hasattr(x, "to_frame"):
            # A Series as a one-row frame: the steps may read its names, and they are
            # checked against the fit's below (a Series has no columns to check).
            x = x.to_frame().T
        if pipeline_last_step(estimator)[0] is not estimator:
            # x has no sample axis: one row through the steps, and back (a one-row
            # DataFrame as it is; an array, images too, with a sample axis in front).
            row = x if hasattr(x, "iloc") else np.asarray(x)[np.newaxis]
            if len(row) != 1:
                raise ValueError(f"x is one input, without the sample axis; got {len(row)} "
                                 "rows.")
            estimator, row, Y = pipeline_last_step(estimator, row, Y)
            # Checked as the frame it still is: the row, a Series, has no names to check,
            # and where no step read them (a search, a FrozenEstimator, "passthrough")
            # reordered columns would be read by position.
            check_column_names(estimator, row)
            x = row[0] if isinstance(row, np.ndarray) else row.iloc[0]
        net = network_of(estimator)
        for values in (x, Y):
            check_column_names(estimator, values)
        shape, kind = net.input_shape, net.input_kind
        if kind == FEATURES:
            if issparse(x):
                # np.asarray made it a 0-d object array: "setting an array element with a
                # sequence".
                raise TypeError("Sparse data was passed for x, but dense data is required. "
                                "Use '.toarray()' to convert to a dense numpy array.")
            x = np.asarray(x, dtype=np.float64)
            # Flattening several rows would make them one input of more features.
            if x.ndim > 2:
                raise ValueError("x is one input of n_features values, got shape "
                                 f"{x.shape}.")
            if x.ndim == 2 and x.shape[0] != 1:
                raise ValueError("x is one input, without the sample axis; got "
                                 f"{x.shape[0]} rows.")
            x = check_array(x.reshape(1, -1))
            Y = check_array(Y, dtype=np.float64)
        else:
            x = np.asarray(x)
            if shape is None:
                # A network kept without its training inputs: the form of one input is
                # unknown. A 1-D x is one (token ids, features); any other is as given.
                one = x.ndim == 1
            elif x.ndim <= len(shape) and x.shape != shape:
                # No more axes than one input, but another shape (a flattened image): the
                # check below would read it as rows and ask for (n_samples, ...).
                raise ValueError(
                    f"x is one input of shape {shape}, as the estimator's inputs at fit "
                    f"(without the sample axis); got shape {x.shape}.")
            else:
                one = x.shape == shape
            # One input (image, token ids) gets its sample axis.
            x = net.check(x[None] if one else x, "x")
            if x.shape[0] != 1:
                raise ValueError(f"x must be one input, got {x.shape[0]} of them.")
            Y = net.check(Y, "Y")
        _check_label_count(labels, Y.shape[0], "labels", "row of Y")
        points = _recorded_points(net, steps)
        values = np.vstack([
            step_kernel(net, x, Y, step=int(k), normalized=normalized,
                        preconditioned=preconditioned)[0]
            for k in points
        ])
        ylabel = ("normalized " if normalized else "") + (
            "step kernel" if preconditioned else "tangent kernel")
        disp = cls(np.asarray(net.trajectory.steps)[points], values, x=x[0], Y=Y,
                   labels=labels, ylabel=ylabel)
        return disp.plot(ax=ax, **line_kw)


# --------------------------------------------------------------------------- rank gap
class RankGapDisplay:
    """Numerical rank of the tangent features of ``X_train`` and of ``[X_train; X_test]``.

    Figure 7 of Guo, He & Morel (2026), third column: when the network extrapolates badly on
    ``X_test``, ``rank(J([X_train; X_test])) > rank(J(X_train))``: test gradients have a
    component outside the span of the stored training features.

    Ranks are computed from the tangent Gram ``G = J J^T`` (never forming ``J``): the
    singular values of ``J`` are ``sqrt(eig(G))``, and both ranks count those above
    ``rtol`` times the training features' largest (as
    :meth:`~skpathkernel.OODRankDetector.rank_gap`), so the gap is not negative unless a
    query's features exceed the training features' by more than ``rtol / 1e-7``, where
    the joint Gram no longer resolves that threshold.

    Parameters
    ----------
    steps : ndarray of shape (n_points,)
        Optimizer step index of each recorded point shown.
    rank_train : ndarray of int of shape (n_points,)
        Numerical rank of the tangent features of ``X_train`` at each point.
    rank_joint : ndarray of int of shape (n_points,)
        Numerical rank of the tangent features of ``[X_train; X_test]`` at each point.
    rtol : float
        The relative tolerance the ranks were computed with.

    Attributes
    ----------
    lines_ : list of two matplotlib Line2D
    ax_ : matplotlib Axes
    figure_ : matplotlib Figure

    Examples
    --------
    >>> import numpy as np
    >>> from skpathkernel import PathKernelMachine
    >>> from skpathkernel.plotting import RankGapDisplay
    >>> X = np.linspace(0, 1, 10).reshape(-1, 1)
    >>> est = PathKernelMachine(hidden_layer_sizes=(4,), activation="relu", max_iter=3, tol=None,
    ...                         random_state=0).fit(X, 2 * X.ravel())
    >>> disp = RankGapDisplay.from_estimator(est, X, 3 + X)
    >>> disp.rank_train.shape, bool(np.all(disp.rank_joint >= disp.rank_train))
    ((4,), True)
    """

    def __init__(self, steps, rank_train, rank_joint, *, rtol):
        self.steps = steps
        self.rank_train = rank_train
        self.rank_joint = rank_joint
        self.rtol = rtol

    @property
    def rank_gap(self) -> np.ndarray:
        """``rank_joint - rank_train`` at each step shown."""
        return np.asarray(self.rank_joint) - np.asarray(self.rank_train)

    def plot(self, *, ax=None, legend: bool = True, **line_kw):
        """Draw both ranks against the optimizer step.

        Parameters
        ----------
        ax : matplotlib Axes, default=None
            Axes to draw on; None creates a new figure. An axes this display drew on
            before is redrawn (its lines there removed; the user's own artists stay).
        legend : bool, default=True
            Whether to draw a legend.
        **line_kw : dict
            Passed to ``ax.step`` for both lines (as :class:`KernelEvolutionDisplay`'s
            to its lines), over the display's own: ``where="post"``, blue for the
            training rank, red dashed for the joint one, and their labels (an alias,
            ``c`` or ``ls``, replaces the keyword it stands for). One line alone is
            styled through ``lines_`` (``lines_[1].set_color(...)``).

        Returns
        -------
        display : RankGapDisplay
        """
        check_matplotlib_support("RankGapDisplay.plot")
        ax, fig, before, _ = _axes(ax, self)
        own = [{"color": "tab:blue", "label": "rank J(X_train)"},
               {"color": "tab:red", "linestyle": "--", "label": "rank J([X_train; X_test])"}]
        self.lines_ = [
            ax.step(self.steps, ranks, **_style({"where": "post", **kw}, line_kw))[0]
            for ranks, kw in zip((self.rank_train, self.rank_joint), own)
        ]
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(f"numerical rank (rtol={self.rtol:.2g})")
        if legend:
            ax.legend(fontsize="small")
        return _drawn(self, ax, fig, before)

    @classmethod
    def from_estimator(cls, estimator, X_train, X_test, *, steps=None, rtol=None, ax=None,
                       legend: bool = True, **line_kw):
        """Compute both ranks at recorded points of the path and plot them.

        Parameters
        ----------
        estimator : fitted skpathkernel estimator, RecordedNetwork or TrainedNetwork
            The fitted network whose recorded path is read; or a fitted Pipeline ending
            in one, whose steps before it transform the inputs, or a search refitted on
            one (its ``best_estimator_``).
        X_train : array-like of shape (n_train, n_features) or (n_train, ...)
            The training inputs, whose tangent features span the reference space.
        X_test : array-like of shape (n_test, n_features) or (n_test, ...)
            The inputs tested for leaving that span.
        steps : sequence of int, default=None
            Recorded points (indices into ``trajectory_``; negative count from the end);
            None: all of them. They are drawn along the path, in increasing order, each
            once.
        rtol : float, default=None
            Relative tolerance on the singular values of ``J``: ``sigma_i`` counts when
            ``sigma_i > rtol * sigma_max``. None uses ``sqrt(n * eps)`` with ``n`` the
            number of rows and ``eps`` the machine epsilon of the estimator's dtype: the
            Gram's eigenvalues carry an absolute error of about ``n * eps * sigma_max^2``,
            so singular values below ``sqrt(n * eps) * sigma_max`` cannot be told from 0
            (3.4e-3 for 100 rows in float32, 1.5e-7 in float64).
        ax : matplotlib Axes, default=None
            Axes to draw on; None creates a new figure.
        legend : bool, default=True
            Whether to draw a legend.
        **line_kw : dict
            See :meth:`plot`.

        Returns
        -------
        display : RankGapDisplay
        """
        check_matplotlib_support(f"{cls.__name__}.from_estimator")
        estimator, X_train, X_test = pipeline_last_step(estimator, X_train, X_test)
        net = network_of(estimator)
        for values in (X_train, X_test):
            check_column_names(estimator, values)
        X_train = net.check(X_train, "X_train")
        X_test = net.check(X_test, "X_test")
        X = np.concatenate([X_train, X_test])
        if rtol is None:
            rtol = float(np.sqrt(X.shape[0] * np.finfo(net.dtype).eps))
        elif isinstance(rtol, (bool, np.bool_)) or not isinstance(rtol, numbers.Real):
            # Checked before np.isfinite, which fails on a string with numpy's own words.
            raise TypeError(f"rtol must be a float in [0, 1) or None, got {rtol!r}.")
        elif not np.isfinite(rtol) or not 0 <= rtol < 1:
            raise ValueError(f"rtol must be in [0, 1), got {rtol!r}.")
        points = _recorded_points(net, steps)
        n = X_train.shape[0]
        rank_train, rank_joint = [], []
        for k in points:
            # One Gram per step: the training block is its top-left corner.
            train, joint = TangentSpan.rank_gap(step_kernel(net, X, step=int(k)), n, rtol)
            rank_train.append(train)
            rank_joint.append(joint)
        disp = cls(np.asarray(net.trajectory.steps)[points], np.asarray(rank_train),
                   np.asarray(rank_joint), rtol=rtol)
        return disp.plot(ax=ax, legend=legend, **line_kw)


# --------------------------------------------------------------------------- embedding
def _resolve_method(method):
    if not is_option(method, "auto", "umap", "tsne", "pca"):
        raise ValueError(f"method must be 'auto', 'umap', 'tsne' or 'pca', got {method!r}.")
    if method in ("auto", "umap"):
        try:
            import umap  # noqa: F401
        except ImportError:
            if method == "umap":
                raise ImportError(
                    "method='umap' needs umap-learn: pip install umap-learn"
                ) from None
            return "tsne"
        return "umap"
    return method


_METHOD_NAMES = {"umap": "UMAP", "tsne": "t-SNE", "pca": "kernel PCA"}


def _continuous(y) -> bool:
    """Whether ``y`` holds regression values rather than labels (scikit-learn's
    "continuous": floats that are not all integers)."""
    y = np.asarray(y)
    return y.dtype.kind == "f" and np.isfinite(y).all() and type_of_target(y) == "continuous"


def _drawn_as_values(y, continuous) -> bool:
    """A display's ``continuous``, or, when None, whether ``y`` is continuous."""
    if continuous is None:
        return _continuous(y)
    check_flag(continuous, "continuous")
    if continuous:
        _check_numbers(y)
    return bool(continuous)


def _check_numbers(y):
    """Refuse ``y`` said to be values (``continuous=True``) that are not numbers: the
    points' colours are their float values, and the conversion failed in numpy's words
    once the kernels were computed (and the axes' previous drawing removed)."""
    try:
        np.asarray(y, dtype=np.float64)
    except (TypeError, ValueError):
        raise ValueError(
            f"continuous=True draws y by value on a colour bar, and y holds labels that "
            f"are not numbers ({np.asarray(y).dtype}): pass continuous=None or False to "
            "draw them as classes.") from None


def _is_regressor(estimator) -> bool:
    return hasattr(estimator, "__sklearn_tags__") and is_regressor(estimator)


def _regressor_values(estimator, y):
    """Whether :class:`KernelMatrixDisplay`'s class labels ``y`` are a regressor's float
    targets, which type_of_target calls "multiclass" when they are all integers
    (load_diabetes' target): True, or None (decided from ``y``), so that int labels
    (``np.digitize(y, bins)``, the blocks asked for) stay classes."""
    return True if _is_regressor(estimator) and np.asarray(y).dtype.kind == "f" else None


def _values_by_estimator(estimator, y, continuous=None):
    """``continuous`` for a display colouring the points by ``y`` under ``estimator``:
    the user's, else True for a regressor's numeric targets or predictions whatever their
    dtype (an int target, counts or ages, was drawn as one class per value, with a
    legend entry each), else None (decided from ``y`` by type_of_target: a classifier's
    labels, or ``y`` of a network without an estimator's type)."""
    if continuous is not None:
        return _drawn_as_values(y, continuous)
    numeric = np.asarray(y).dtype.kind in "iuf"
    return True if _is_regressor(estimator) and numeric else None


class TangentEmbeddingDisplay:
    """2-D embedding of tangent features at a recorded step, coloured by label.

    Figure 4 of Guo, He & Morel (2026) (a UMAP of MNIST tangent features). The embedding
    works on the geometry of the *normalized* tangent features (cosine similarity ``K_hat``,
    distance ``sqrt(2 - 2 K_hat)``, 1 from a zero feature, which lies at the origin),
    computed from the tangent Gram alone, so the number of parameters does not matter:
    UMAP when ``umap-learn`` is importable, else t-SNE (``method="auto"``), both on the
    precomputed distances; ``method="pca"`` is kernel PCA
    of ``K_hat`` (deterministic and fast). The method is named in the title.

    Parameters
    ----------
    embedding : ndarray of shape (n_samples, 2)
        The 2-D embedding of the tangent features, one row per sample.
    y : array-like of shape (n_samples,), default=None
        Labels of the samples, for their colours; None draws one colour.
    continuous : bool, default=None
        Whether ``y`` holds values (a regression target), drawn on a colour bar, rather
        than labels. None decides from ``y`` as scikit-learn's ``type_of_target`` does
        ("continuous": floats that are not all integers); :meth:`from_estimator` decides
        by the estimator (a regressor's ``y`` is values whatever its dtype).
    method : str, default=None
        Name of the embedding method, for the title.
    title : str, default=None
        Title of the axes.

    Attributes
    ----------
    scatter_ : matplotlib PathCollection
    colorbar_ : matplotlib Colorbar or None
        The colour bar of continuous ``y`` (regression targets), else None.
    ax_ : matplotlib Axes
    figure_ : matplotlib Figure

    Examples
    --------
    >>> import numpy as np
    >>> from skpathkernel import PathKernelClassifier
    >>> from skpathkernel.plotting import TangentEmbeddingDisplay
    >>> rng = np.random.RandomState(0)
    >>> X = rng.uniform(-1, 1, (20, 2)); y = (X[:, 0] > 0).astype(int)
    >>> clf = PathKernelClassifier(hidden_layer_sizes=(8,), max_iter=4, tol=None, random_state=0)
    >>> disp = TangentEmbeddingDisplay.from_estimator(clf.fit(X, y), X, y, method="pca")
    >>> disp.embedding.shape, disp.method
    ((20, 2), 'kernel PCA')
    """

    def __init__(self, embedding, y=None, *, continuous=None, method=None, title=None):
        self.embedding = embedding
        self.y = y
        self.continuous = continuous
        self.method = method
        self.title = title

    def plot(self, *, ax=None, cmap: str = "tab10", legend: bool = True, **scatter_kw):
        """Scatter the embedding, one colour per class.

        Parameters
        ----------
        ax : matplotlib Axes, default=None
            Axes to draw on; None creates a new figure. An axes this display drew on
            before is redrawn (its points there removed, its colour bar drawn again in
            place; the user's own artists stay).
        cmap : str or Colormap, default="tab10"
            Matplotlib colormap. A qualitative map with fewer entries than classes is
            interpolated between its entries, so that each class keeps its own colour.
            Continuous ``y`` (regression targets) is drawn on a sequential map,
            "viridis" in place of the default.
        legend : bool, default=True
            Whether to draw a legend (a colour bar, ``colorbar_``, for continuous ``y``).
        **scatter_kw : dict
            Passed to ``ax.scatter``.

        Returns
        -------
        display : TangentEmbeddingDisplay
        """
        check_matplotlib_support("TangentEmbeddingDisplay.plot")
        import matplotlib as mpl

        _check_class_colours(self.y, scatter_kw)
        values = self.y is not None and _drawn_as_values(self.y, self.continuous)
        ax, fig, before, cax = _axes(ax, self, values and legend)
        E = np.asarray(self.embedding)
        kw = {"s": 10, **scatter_kw}
        self.colorbar_ = None
        if self.y is None:
            self.scatter_ = ax.scatter(E[:, 0], E[:, 1], **kw)
        elif values:
            # A regression target: one colour per distinct value made a legend entry per
            # sample. Values on a sequential map, read off a colour bar.
            self.scatter_ = ax.scatter(E[:, 0], E[:, 1], c=np.asarray(self.y, dtype=float),
                                       cmap="viridis" if cmap == "tab10" else cmap, **kw)
            if legend:
                self.colorbar_ = _colorbar(fig, ax, cax, self.scatter_)
        else:
            classes, codes = np.unique(np.asarray(self.y), return_inverse=True)
            cm = mpl.colormaps[cmap] if isinstance(cmap, str) else cmap
            if len(classes) > cm.N:
                # Indexing past a qualitative map's last entry returns that entry: the
                # classes beyond it would share one colour. Interpolating its entries
                # keeps the palette and gives each class its own.
                cm = mpl.colors.LinearSegmentedColormap.from_list(
                    cm.name, cm(np.arange(cm.N)), N=256)
            # Qualitative maps (tab10, ...) have few entries: index them; spread others.
            colors = np.array([cm(i) if cm.N < 256 else cm(i / max(len(classes) - 1, 1))
                               for i in range(len(classes))])
            self.scatter_ = ax.scatter(E[:, 0], E[:, 1], c=colors[codes], **kw)
            if legend:
                handles = [
                    ax.scatter([], [], color=colors[i], s=kw["s"], label=str(c))
                    for i, c in enumerate(classes)
                ]
                ax.legend(handles=handles, fontsize="x-small", markerscale=1.5,
                          loc="best", ncol=2 if len(classes) > 5 else 1)
        ax.set_xticks([])
        ax.set_yticks([])
        title = self.title
        if title is None and self.method is not None:
            title = f"tangent features ({self.method})"
        if title is not None:
            ax.set_title(title, fontsize="small")
        return _drawn(self, ax, fig, before)

    @classmethod
    def from_estimator(cls, estimator, X, y=None, *, step: int = -1, method: str = "auto",
                       random_state=0, method_kw: dict | None = None, continuous=None,
                       ax=None, cmap: str = "tab10", legend: bool = True, **scatter_kw):
        """Embed the tangent features of ``X`` at recorded point ``step`` and plot them.

        Parameters
        ----------
        estimator : fitted skpathkernel estimator, RecordedNetwork or TrainedNetwork
            The fitted network whose recorded path is read; or a fitted Pipeline ending
            in one, whose steps before it transform the inputs, or a search refitted on
            one (its ``best_estimator_``).
        X : array-like of shape (n_samples, n_features) or (n_samples, ...)
            The samples, in the form the network was fitted on.
        y : array-like of shape (n_samples,), default=None
            Colours: labels, or a regressor's targets (float or int), drawn by value (see
            ``continuous``).
        step : int, default=-1
            Recorded point (0: initialization).
        method : {"auto", "umap", "tsne", "pca"}, default="auto"
            "auto": UMAP if ``umap-learn`` is importable, else t-SNE.
        random_state : int, RandomState instance or None, default=0
            Seeds UMAP / t-SNE.
        method_kw : dict, default=None
            Keyword arguments of the method's estimator: :class:`sklearn.manifold.TSNE`
            (``perplexity``, ``early_exaggeration``, ``max_iter``, ...),
            ``umap.UMAP`` (``n_neighbors``, ``min_dist``, ...) or
            :class:`sklearn.decomposition.KernelPCA` (``eigen_solver``, ...), over the
            display's own: t-SNE's ``perplexity=min(30, max(2, (n_samples - 1) / 3))``
            (under the number of samples, which t-SNE requires) and ``init="random"``,
            UMAP's ``n_neighbors=min(15, n_samples - 1)``. The keywords the display sets
            itself (``n_components``, ``metric``, ``kernel``, ``random_state``) are
            refused, and so is ``method="auto"`` with ``method_kw``, whose estimator
            depends on what is installed: name the method. The options are checked
            before the kernel is computed: their names, their types and ranges
            (scikit-learn's own checks), and what fails on the tangent features'
            precomputed kernel or distances (t-SNE's ``init="pca"``, KernelPCA's
            ``fit_inverse_transform``, UMAP's ``unique``), on the 2 components drawn
            (KernelPCA's ``remove_zero_eig``) or on too few samples (a perplexity or
            ``n_neighbors`` not under their number, an ``init`` array not of shape
            ``(n_samples, 2)``).
        continuous : bool, default=None
            Whether ``y`` holds values, drawn on a colour bar, rather than labels. None
            decides by the estimator: a regressor's ``y`` are values whatever their dtype;
            otherwise as scikit-learn's ``type_of_target`` says ("continuous": floats that
            are not all integers). False draws a regressor's int groups as labels.
        ax, cmap, legend, **scatter_kw
            See :meth:`plot`.

        Returns
        -------
        display : TangentEmbeddingDisplay
        """
        check_matplotlib_support(f"{cls.__name__}.from_estimator")
        if continuous is not None:
            check_flag(continuous, "continuous")
        estimator, X = pipeline_last_step(estimator, X)
        net = network_of(estimator)
        check_column_names(estimator, X)
        X = net.check(X)
        if y is not None:
            y = _labels(y, X.shape[0])
            # Before the kernel (see KernelNeighborsDisplay.from_estimator).
            continuous = _values_by_estimator(estimator, y, continuous)
        _check_class_colours(y, scatter_kw)
        resolved = _resolve_method(method)
        # Checked before the kernel: TSNE and UMAP refused a perplexity or neighbours
        # beyond the samples only in fit.
        embedder = _embedder(resolved, method, method_kw, random_state, X.shape[0])
        K = step_kernel(net, X, step=step, normalized=True)
        if resolved == "pca":
            E = embedder.fit_transform(K)
        else:
            # The normalized features' distances from the Gram's own diagonal, 1 or 0
            # for a zero feature (at the origin: 1 from the others, 0 from another one).
            d = np.diag(K)
            D = np.sqrt(np.clip(d[:, None] + d[None, :] - 2.0 * K, 0.0, None))
            np.fill_diagonal(D, 0.0)
            with warnings.catch_warnings():
                # umap-learn's: a precomputed metric has no inverse_transform (never
                # called here).
                warnings.filterwarnings("ignore", "using precomputed metric", UserWarning)
                E = embedder.fit_transform(D)
        name = _METHOD_NAMES[resolved]
        title = f"tangent features at {_point_label(step, net.trajectory.steps)} ({name})"
        disp = cls(E, y=y, continuous=None if y is None else continuous, method=name,
                   title=title)
        return disp.plot(ax=ax, cmap=cmap, legend=legend, **scatter_kw)


# The keywords TangentEmbeddingDisplay sets itself, per method.
_FIXED_KW = {"pca": ("n_components", "kernel"),
             "tsne": ("n_components", "metric", "random_state"),
             "umap": ("n_components", "metric", "random_state")}


def _embedder(resolved, method, method_kw, random_state, n):
    """The embedding estimator of :class:`TangentEmbeddingDisplay`: the user's
    ``method_kw`` over the display's own choices, checked against the ``n`` samples.

    Every option is checked here, before the kernel: the estimators check theirs only in
    ``fit``, which runs on the kernel (the expensive part), and some combinations with
    the display's precomputed kernel or distances only fail there."""
    if method_kw is not None and not isinstance(method_kw, dict):
        raise TypeError(f"method_kw must be a dict of keyword arguments or None, got "
                        f"{type(method_kw).__name__}.")
    kw = dict(method_kw or {})
    if kw and method == "auto":
        raise ValueError(f"method_kw are keyword arguments of one method's estimator, and "
                         f"method='auto' picks UMAP or t-SNE by what is installed (here "
                         f"{_METHOD_NAMES[resolved]}): name the method, "
                         f"method={resolved!r}.")
    fixed = sorted(set(_FIXED_KW[resolved]) & set(kw))
    if fixed:
        raise ValueError(f"method_kw: {fixed[0]} is set by the display (2 components on "
                         "the tangent features' precomputed kernel or distances; the seed "
                         "is random_state).")
    if resolved == "pca":
        cls, own = KernelPCA, {"n_components": 2, "kernel": "precomputed"}
    elif resolved == "tsne":
        cls = TSNE
        own = {"n_components": 2, "metric": "precomputed", "random_state": random_state}
        # The default perplexity adapts to the samples: at least 2, under their number.
        kw = {"init": "random", "perplexity": float(min(30.0, max(2.0, (n - 1) / 3))), **kw}
    else:
        import umap

        cls, own = umap.UMAP, {"metric": "precomputed", "random_state": random_state}
        # The display's own choices, said to its user by umap-learn as warnings: a seed
        # runs on one job (umap overrides its default of all of them) and the neighbours
        # fit the samples (it truncates 15 to n - 1).
        kw = {**({} if random_state is None else {"n_jobs": 1}),
              "n_neighbors": min(15, n - 1), **kw}
    _check_option_names(cls, kw)
    embedder = cls(**kw, **own)
    if resolved != "umap":
        try:
            # scikit-learn's own checks of types and ranges (_parameter_constraints),
            # which fit runs first: here before the kernel.
            embedder._validate_params()
        except InvalidParameterError as e:
            raise InvalidParameterError(f"method_kw: {e}") from None
    _check_against_samples(resolved, kw, set(method_kw or ()), n)
    # set_output(transform="default"): under a global set_config(transform_output=
    # "pandas") the embedding (documented an ndarray) came back a DataFrame of KernelPCA's
    # / TSNE's column names.
    return embedder if resolved == "umap" else embedder.set_output(transform="default")


def _check_option_names(cls, kw):
    """Refuse a keyword the embedding estimator does not take, naming it (the class's
    own TypeError named neither method_kw nor the options there are)."""
    params = inspect.signature(cls).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    unknown = sorted(set(kw) - set(params))
    if unknown:
        close = difflib.get_close_matches(unknown[0], list(params), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise TypeError(f"method_kw: {unknown[0]!r} is not an option of "
                        f"{cls.__name__}{hint}.")


def _check_against_samples(resolved, kw, given, n):
    """The options that only fail in the embedder's fit, against the ``n`` samples or
    the display's precomputed kernel (KernelPCA) or distances (t-SNE, UMAP): ``kw``,
    the embedder's keywords, ``given`` the names of the user's among them."""
    name = _METHOD_NAMES[resolved]
    if resolved == "pca":
        if kw.get("fit_inverse_transform"):
            raise ValueError("method_kw: fit_inverse_transform=True maps the embedding "
                             "back to the input features, and kernel PCA here has only "
                             "the precomputed tangent kernel (scikit-learn refuses it).")
        if kw.get("remove_zero_eig"):
            raise ValueError("method_kw: remove_zero_eig=True drops a component whose "
                             "eigenvalue is zero, and the display draws 2 (always one of "
                             "them for 2 samples).")
        # Two points make a direction.
        low, why = 2, ""
    elif resolved == "tsne":
        if isinstance(kw["init"], str) and kw["init"] == "pca":
            raise ValueError("method_kw: init='pca' takes the principal components of the "
                             "input features, and t-SNE here has only the tangent features' "
                             "precomputed distances (scikit-learn refuses it): pass "
                             "init='random', the display's, or an array of shape "
                             f"({n}, 2).")
        # t-SNE needs a perplexity under the number of samples (the display's default
        # is, from 3 samples on).
        perplexity = kw["perplexity"]
        if isinstance(perplexity, (bool, np.bool_)):
            # A Real to scikit-learn's check (True ran as a perplexity of 1).
            raise TypeError(f"method_kw: perplexity must be a float, got {perplexity!r}.")
        low = max(2, math.floor(perplexity) + 1)
        why = (f" with perplexity={perplexity!r} (t-SNE's must be under the sample count)"
               if "perplexity" in given else "")
    else:
        if kw.get("unique"):
            raise ValueError("method_kw: unique=True drops duplicate input rows, which "
                             "precomputed distances do not have (umap-learn refuses it).")
        k = kw["n_neighbors"]
        if "n_neighbors" not in given:
            # The display's n - 1, at least umap's least, 2.
            low, why = 3, ""
        elif (isinstance(k, (bool, np.bool_)) or not isinstance(k, numbers.Integral)
                or k < 2):
            raise ValueError(f"method_kw: n_neighbors must be an int of at least 2 "
                             f"(UMAP's), got {k!r}.")
        else:
            # umap-learn truncated more with a warning, after the kernel.
            low = k + 1
            why = f" with n_neighbors={k!r} (UMAP's must be under the sample count)"
    init = kw.get("init")
    # t-SNE descends on the array in its own dtype (an int one fails on the first step);
    # umap-learn converts it to float32, so ints are starting points to it.
    kinds, what = ("f", "floats") if resolved == "tsne" else ("iuf", "numbers")
    if isinstance(init, np.ndarray) and (init.shape != (n, 2) or init.dtype.kind not in kinds
                                         or not np.isfinite(init).all()):
        raise ValueError(f"method_kw: init must be an array of finite {what} of shape "
                         f"({n}, 2), one starting point per sample, got {init.dtype} of "
                         f"shape {init.shape}.")
    if n < low:
        raise ValueError(f"A {name} embedding{why} needs at least {low} samples, got {n}.")


def _labels(y, n: int, name: str = "y") -> np.ndarray:
    """``y`` as one label per sample, shape ``(n,)``: the displays colour and count by it
    (a multilabel indicator's rows are label sets, which no colour or purity reads)."""
    y = np.asarray(y)
    if y.shape != (n,):
        raise ValueError(f"{name} must hold one label per sample, shape ({n},), got shape "
                         f"{y.shape}" + (": for a multilabel indicator, pass one label "
                                         "column" if y.ndim == 2 else "") + ".")
    return y
