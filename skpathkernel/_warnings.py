"""Where the package's warnings point: the user's line."""

from __future__ import annotations

import os
import sys

__all__ = ["caller_stacklevel"]

# The package's folder: frames whose code lies under it are skpathkernel's own.
_PACKAGE = os.path.dirname(os.path.abspath(__file__)) + os.sep


def caller_stacklevel() -> int:
    """``stacklevel`` of the first frame outside skpathkernel, for a warning issued by the
    caller of this function: the user's line, whichever public method they called."""
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE):
        frame, level = frame.f_back, level + 1
    return level
