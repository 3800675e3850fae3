"""Printed glyphs rendered offline from the fonts that ship inside matplotlib.

The images imitate :func:`sklearn.datasets.load_digits`: 8x8 images whose pixels are
integers 0..16 stored as float64, ink high on a 0 background. ``load_digits`` counts the on
pixels of 4x4 blocks of a 32x32 bitmap whose glyph was size-normalised to its bounding box;
here each glyph is rendered once per (font, character) at high resolution with
matplotlib's ``TextPath`` and Agg rasteriser, then, per sample, rotated slightly, cropped to
its bounding box, padded to a square (keeping the aspect ratio), scaled slightly down,
shifted by up to one pixel of the 32x32 grid, resampled to a 32x32 grid with 4x4
supersampling, thresholded at half coverage and counted in 4x4 blocks.

Nothing is downloaded: only the TrueType files under ``matplotlib.get_data_path()`` are read.
"""

from __future__ import annotations

import functools
import os

import numpy as np
from scipy.ndimage import affine_transform
from sklearn.utils import Bunch, check_random_state

__all__ = ["load_printed_digits", "load_printed_letters"]

# (display name, file name under mpl-data/fonts/ttf), ordered so that the first samples of a
# class already cover every family: sample j of a class uses font j % n_fonts.
_FONTS = (
    ("DejaVu Sans", "DejaVuSans.ttf"),
    ("DejaVu Serif", "DejaVuSerif.ttf"),
    ("DejaVu Sans Mono", "DejaVuSansMono.ttf"),
    ("STIX General", "STIXGeneral.ttf"),
    ("Computer Modern Roman (cmr10)", "cmr10.ttf"),
    ("DejaVu Sans Bold", "DejaVuSans-Bold.ttf"),
    ("DejaVu Serif Italic", "DejaVuSerif-Italic.ttf"),
    ("DejaVu Sans Mono Bold", "DejaVuSansMono-Bold.ttf"),
    ("STIX General Italic", "STIXGeneralItalic.ttf"),
    ("Computer Modern Sans (cmss10)", "cmss10.ttf"),
    ("DejaVu Sans Oblique", "DejaVuSans-Oblique.ttf"),
    ("DejaVu Serif Bold", "DejaVuSerif-Bold.ttf"),
    ("DejaVu Sans Mono Oblique", "DejaVuSansMono-Oblique.ttf"),
    ("STIX General Bold", "STIXGeneralBol.ttf"),
    ("Computer Modern Typewriter (cmtt10)", "cmtt10.ttf"),
    ("DejaVu Sans Bold Oblique", "DejaVuSans-BoldOblique.ttf"),
    ("DejaVu Serif Bold Italic", "DejaVuSerif-BoldItalic.ttf"),
    ("DejaVu Sans Mono Bold Oblique", "DejaVuSansMono-BoldOblique.ttf"),
    ("STIX General Bold Italic", "STIXGeneralBolIta.ttf"),
    ("Computer Modern Bold (cmb10)", "cmb10.ttf"),
)

_RENDER_SIZE = 192.0  # font size (points at 72 dpi = pixels) of the cached high-res render
_GRID = 32  # the bitmap grid of load_digits, counted in 4x4 blocks to 8x8
_SUPERSAMPLE = 4  # sub-pixels per grid pixel along each axis when resampling
_MAX_ROTATION_DEG = 8.0
_SCALE_RANGE = (0.85, 1.0)  # glyph side / box side after bounding-box normalisation
_MAX_SHIFT = 1.0  # in pixels of the 32x32 grid


def _require_matplotlib(caller):
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise ImportError(
            f"{caller} renders glyphs with matplotlib, which is not installed; "
            "install it with `pip install skpathkernel[plot]`."
        ) from exc


def _font_dir():
    import matplotlib

    return os.path.join(matplotlib.get_data_path(), "fonts", "ttf")


@functools.cache
def _available_fonts():
    """The (name, path) pairs of ``_FONTS`` present in this matplotlib installation."""
    font_dir = _font_dir()
    found = []
    for name, fname in _FONTS:
        path = os.path.join(font_dir, fname)
        if os.path.isfile(path):
            found.append((name, path))
    return tuple(found)


@functools.cache
def _has_glyph(path, char):
    """Whether the font draws ``char``: it has a glyph for it, and the glyph has an
    outline (a blank one, such as U+2800, has no ink to crop to, and matplotlib's
    TextPath fails on it with "'list' object has no attribute 'flags'")."""
    from matplotlib.ft2font import FT2Font

    font = FT2Font(path)
    if font.get_char_index(ord(char)) == 0:
        return False
    font.load_char(ord(char))
    vertices, _ = font.get_path()
    return len(vertices) > 0


@functools.cache
def _render_glyph(path, char):
    """Coverage in [0, 1] of ``char`` in the font file ``path``, cropped to its ink.

    Rendered once per (font, character) with matplotlib's TextPath and Agg at
    ``_RENDER_SIZE`` pixels per em; rows go downwards. Returns a read-only float32 array
    and the (row, col) centres of its pixels with at least half coverage.
    """
    from matplotlib.backends.backend_agg import RendererAgg
    from matplotlib.font_manager import FontProperties
    from matplotlib.textpath import TextPath
    from matplotlib.transforms import Affine2D

    text_path = TextPath((0, 0), char, size=_RENDER_SIZE, prop=FontProperties(fname=path))
    ext = text_path.get_extents()
    pad = 2
    width = int(np.ceil(ext.width)) + 2 * pad
    height = int(np.ceil(ext.height)) + 2 * pad
    renderer = RendererAgg(width, height, 72)
    gc = renderer.new_gc()
    gc.set_linewidth(0.0)
    transform = Affine2D().translate(pad - ext.x0, pad - ext.y0)
    renderer.draw_path(gc, text_path, transform, (0.0, 0.0, 0.0))
    gc.restore()
    rgba = np.asarray(renderer.buffer_rgba())
    coverage = 1.0 - rgba[..., 0].astype(np.float32) / 255.0  # black ink on white
    rows, cols = np.nonzero(coverage > 0.0)
    coverage = np.ascontiguousarray(
        coverage[rows.min() : rows.max() + 1, cols.min() : cols.max() + 1]
    )
    ink = np.argwhere(coverage >= 0.5).astype(np.float64) + 0.5
    coverage.setflags(write=False)
    ink.setflags(write=False)
    return coverage, ink


def _jittered_image(path, char, rng):
    """One 8x8 image (values 0..16) of ``char``: rotate, normalise, scale, shift, count."""
    coverage, ink = _render_glyph(path, char)
    angle = np.deg2rad(rng.uniform(-_MAX_ROTATION_DEG, _MAX_ROTATION_DEG))
    scale = rng.uniform(*_SCALE_RANGE)
    shift = rng.uniform(-_MAX_SHIFT, _MAX_SHIFT, size=2)

    n_out = _GRID * _SUPERSAMPLE
    centre = np.array(coverage.shape, dtype=np.float64) / 2.0
    cos, sin = np.cos(angle), np.sin(angle)
    rot = np.array([[cos, -sin], [sin, cos]])
    # Bounding box of the rotated ink, padded by half a pixel diagonal of the render.
    rotated = (ink - centre) @ rot.T
    lo, hi = rotated.min(axis=0) - 0.75, rotated.max(axis=0) + 0.75
    extent = hi - lo
    side = extent.max()  # pad to a square: the longer side fills the box
    zoom = scale * n_out / side  # render pixels -> output sub-pixels
    # Keep the whole glyph on the grid: clip the shift to the free margin.
    margin = (n_out - zoom * extent) / 2.0
    offset_out = np.clip(shift * _SUPERSAMPLE, -margin, margin)
    # Output position o (continuous) = n_out / 2 + offset_out + zoom * (R (x - c) - mid).
    # affine_transform maps output indices to input indices: x = M o + b.
    mid = (lo + hi) / 2.0
    matrix = rot.T / zoom
    out_centre = n_out / 2.0 + offset_out
    # Pixel i has its centre at continuous coordinate i + 0.5, in and out.
    b = centre - 0.5 + matrix @ (0.5 - out_centre) + rot.T @ mid
    fine = affine_transform(
        coverage, matrix, offset=b, output_shape=(n_out, n_out), order=1, cval=0.0
    )
    bitmap = fine.reshape(_GRID, _SUPERSAMPLE, _GRID, _SUPERSAMPLE).mean(axis=(1, 3)) >= 0.5
    return bitmap.reshape(8, 4, 8, 4).sum(axis=(1, 3)).astype(np.float64)


def _load_glyphs(chars, n_per_class, random_state, caller):
    """Render ``n_per_class`` jittered images per character; fonts lacking one are skipped."""
    fonts = [
        (name, path) for name, path in _available_fonts() if all(_has_glyph(path, c) for c in chars)
    ]
    if not fonts:
        raise ValueError(
            f"{caller}: none of matplotlib's bundled fonts draws every one of {chars!r} "
            "(a glyph with ink for each)."
        )
    rng = check_random_state(random_state)
    images = np.empty((len(chars) * n_per_class, 8, 8), dtype=np.float64)
    font_names = []
    for k, char in enumerate(chars):
        for j in range(n_per_class):
            name, path = fonts[j % len(fonts)]
            images[k * n_per_class + j] = _jittered_image(path, char, rng)
            font_names.append(name)
    used = [name for name, _ in fonts[: min(n_per_class, len(fonts))]]
    return images, np.array(font_names), used


def _check_n_per_class(n_per_class, caller):
    if isinstance(n_per_class, bool) or not isinstance(n_per_class, (int, np.integer)):
        raise TypeError(f"{caller}: n_per_class must be an int, got {n_per_class!r}.")
    if n_per_class < 1:
        raise ValueError(f"{caller}: n_per_class must be >= 1, got {n_per_class}.")
    return int(n_per_class)


def _describe(title, chars, n_per_class, used_fonts):
    fonts = "\n".join(f"    - {name}" for name in used_fonts)
    return (
        f"{title}\n{'-' * len(title)}\n\n"
        f"{len(chars)} classes x {n_per_class} images of 8x8 pixels with integer values "
        "0..16 (ink high), in the format of sklearn.datasets.load_digits.\n\n"
        "Each glyph is rendered once per (font, character) at high resolution from a "
        "TrueType font bundled with matplotlib (TextPath + Agg; nothing is downloaded). "
        f"Each sample is rotated by up to {_MAX_ROTATION_DEG:g} degrees, cropped to its "
        "bounding box, padded to a square, scaled by a factor in "
        f"[{_SCALE_RANGE[0]:g}, {_SCALE_RANGE[1]:g}], shifted by up to {_MAX_SHIFT:g} pixel "
        "of a 32x32 grid (seeded by random_state), thresholded at half coverage on that grid "
        "and counted in 4x4 blocks.\n\n"
        "Sample j of every class uses font j modulo the number of fonts, in this order:\n"
        f"{fonts}\n"
    )


def frame_bunch(data, target, feature_names, return_X_y, as_frame, caller, **fields):
    """A loader's return value: ``(data, target)`` or a Bunch, as scikit-learn's loaders
    give them; with ``as_frame`` the data as a DataFrame whose columns are
    ``feature_names``, the target as a Series named ``"target"``, and the Bunch's
    ``frame`` holding both (as :func:`sklearn.datasets.load_digits` does)."""
    frame = None
    if as_frame:
        try:
            import pandas as pd
        except ImportError as exc:
            raise ImportError(
                f"{caller}(as_frame=True) returns pandas objects, and pandas is not "
                "installed; install it with `pip install pandas`, or pass as_frame=False."
            ) from exc
        data = pd.DataFrame(data, columns=list(feature_names))
        target = pd.Series(target, name="target")
        frame = pd.concat([data, target], axis=1)
    if return_X_y:
        return data, target
    return Bunch(data=data, target=target, frame=frame, feature_names=list(feature_names),
                 **fields)


def _bunch(images, target, target_names, fonts, descr, return_X_y, as_frame, caller):
    return frame_bunch(
        images.reshape(len(images), -1), target,
        [f"pixel_{i}_{j}" for i in range(8) for j in range(8)], return_X_y, as_frame, caller,
        target_names=target_names, images=images, font=fonts, DESCR=descr,
    )


def load_printed_digits(
    *, n_per_class=10, digits=tuple(range(10)), return_X_y=False, as_frame=False,
    random_state=0,
):
    """Printed digits rendered from matplotlib's fonts, 8x8 like ``load_digits``.

    Every image is a digit in one of up to 20 fonts bundled with matplotlib (DejaVu Sans,
    Serif and Sans Mono, STIX General and Computer Modern, in several weights and slants),
    with a small seeded rotation (up to 8 degrees), scale (0.85-1) and shift (up to one
    pixel of the 32x32 grid). The pixel format is that of
    :func:`sklearn.datasets.load_digits`: integers 0..16 as float64, ink high on a 0
    background, so estimators fitted on one apply to the other. Samples are ordered by
    class, in the order of ``digits``; sample ``j`` of every class uses font
    ``j % n_fonts`` (see ``DESCR``).

    Each (font, digit) is rendered once per process at high resolution and cached;
    repeated calls only redo the cheap per-sample jitter. Requires matplotlib
    (``pip install skpathkernel[plot]``); nothing is downloaded.

    Parameters
    ----------
    n_per_class : int, default=10
        Number of images of each digit.
    digits : sequence of int, default=(0, 1, ..., 9)
        The digits to render, each in 0..9, without repetition.
    return_X_y : bool, default=False
        If True, return ``(data, target)`` instead of a Bunch.
    as_frame : bool, default=False
        If True, ``data`` is a pandas DataFrame (columns ``feature_names``), ``target`` a
        Series named ``"target"``, and the Bunch's ``frame`` a DataFrame of both, as
        :func:`sklearn.datasets.load_digits` gives them. Requires pandas.
    random_state : int, RandomState instance or None, default=0
        Seeds the jitter; the same value gives the same images.

    Returns
    -------
    data : :class:`~sklearn.utils.Bunch`
        With ``data`` (n_samples, 64) float64, ``images`` (n_samples, 8, 8), ``target``
        (n_samples,) int64: the digit, ``target_names`` (the digits, as an int array),
        ``font`` (n_samples,): the font name of each sample, ``feature_names``,
        ``DESCR`` (naming the fonts used) and ``frame`` (None unless ``as_frame``).
    (data, target) : tuple if ``return_X_y`` is True

    Raises
    ------
    ImportError
        If matplotlib is not installed.

    Examples
    --------
    >>> from skpathkernel.datasets import load_printed_digits
    >>> digits = load_printed_digits(n_per_class=3, digits=(0, 7))
    >>> digits.images.shape, digits.target.tolist()
    ((6, 8, 8), [0, 0, 0, 7, 7, 7])
    >>> X, y = load_printed_digits(n_per_class=2, return_X_y=True)
    >>> X.shape, float(X.min()), float(X.max())
    ((20, 64), 0.0, 16.0)
    """
    caller = "load_printed_digits"
    _require_matplotlib(caller)
    n_per_class = _check_n_per_class(n_per_class, caller)
    digits = list(digits) if isinstance(digits, (list, tuple, range, np.ndarray)) else None
    if (
        not digits
        or any(isinstance(d, bool) or not isinstance(d, (int, np.integer)) for d in digits)
        or any(not 0 <= d <= 9 for d in digits)
    ):
        raise ValueError(f"{caller}: digits must be a non-empty sequence of ints in 0..9.")
    digits = [int(d) for d in digits]
    if len(set(digits)) != len(digits):
        raise ValueError(f"{caller}: digits must not repeat, got {digits}.")
    chars = tuple(str(d) for d in digits)
    images, fonts, used = _load_glyphs(chars, n_per_class, random_state, caller)
    target = np.repeat(np.array(digits, dtype=np.int64), n_per_class)
    descr = _describe("Printed digits rendered from matplotlib's fonts", chars, n_per_class, used)
    return _bunch(images, target, np.array(digits, dtype=np.int64), fonts, descr, return_X_y,
                  as_frame, caller)


def load_printed_letters(
    *, letters=("M", "N", "U", "V", "A"), n_per_class=10, return_X_y=False, as_frame=False,
    random_state=0,
):
    """Printed letters rendered from matplotlib's fonts, 8x8 like ``load_digits``.

    The letter sibling of :func:`load_printed_digits`, with the same fonts, jitter and pixel
    format (integers 0..16 as float64, ink high). The default letters M, N, U, V and A are
    pairwise similar shapes, a harder task than their number suggests. Fonts that lack a
    glyph for any requested letter are left out. Samples are ordered by class, in the
    order of ``letters``.

    Parameters
    ----------
    letters : sequence of str, default=("M", "N", "U", "V", "A")
        The characters to render, each a single non-space character, without repetition;
        a string such as ``"MNUVA"`` is read as its characters.
    n_per_class : int, default=10
        Number of images of each letter.
    return_X_y : bool, default=False
        If True, return ``(data, target)`` instead of a Bunch.
    as_frame : bool, default=False
        If True, ``data`` is a pandas DataFrame (columns ``feature_names``), ``target`` a
        Series named ``"target"``, and the Bunch's ``frame`` a DataFrame of both, as
        :func:`sklearn.datasets.load_digits` gives them. Requires pandas.
    random_state : int, RandomState instance or None, default=0
        Seeds the jitter; the same value gives the same images.

    Returns
    -------
    data : :class:`~sklearn.utils.Bunch`
        With ``data`` (n_samples, 64) float64, ``images`` (n_samples, 8, 8), ``target``
        (n_samples,) int64: the index into ``letters``, ``target_names`` (the letters, as a
        str array), ``font`` (n_samples,): the font name of each sample, ``feature_names``
        ``DESCR`` (naming the fonts used) and ``frame`` (None unless ``as_frame``).
    (data, target) : tuple if ``return_X_y`` is True

    Raises
    ------
    ImportError
        If matplotlib is not installed.

    Examples
    --------
    >>> from skpathkernel.datasets import load_printed_letters
    >>> letters = load_printed_letters(n_per_class=2)
    >>> letters.data.shape, letters.target.tolist()
    ((10, 64), [0, 0, 1, 1, 2, 2, 3, 3, 4, 4])
    >>> letters.target_names.tolist()
    ['M', 'N', 'U', 'V', 'A']
    """
    caller = "load_printed_letters"
    _require_matplotlib(caller)
    n_per_class = _check_n_per_class(n_per_class, caller)
    given = letters  # the message echoes the argument, not the () a non-sequence became
    if isinstance(letters, str):
        letters = tuple(letters)
    try:
        letters = tuple(letters)
    except TypeError:
        letters = ()
    if not letters or any(
        not isinstance(c, str) or len(c) != 1 or c.isspace() or not c.isprintable() for c in letters
    ):
        raise ValueError(
            f"{caller}: letters must be a non-empty sequence of single non-space characters, "
            f"got {given!r}."
        )
    if len(set(letters)) != len(letters):
        raise ValueError(f"{caller}: letters must not repeat, got {letters!r}.")
    images, fonts, used = _load_glyphs(letters, n_per_class, random_state, caller)
    target = np.repeat(np.arange(len(letters), dtype=np.int64), n_per_class)
    descr = _describe(
        "Printed letters rendered from matplotlib's fonts", letters, n_per_class, used
    )
    return _bunch(images, target, np.array(letters), fonts, descr, return_X_y, as_frame, caller)
