"""``skpathkernel reproduce``: the seed paper's experiments, one module per section.

Each section is a function ``(context) -> list[Row]`` registered in :data:`SECTIONS`; it
uses only the public API, writes its figures into ``context.out`` and returns the claims
it measured. :func:`run` runs the sections and writes ``report.md``.
"""

from __future__ import annotations

import os
import platform
import time

from .._device import torch_threads
from ._flatness import flatness_section
from ._generative import generative_section
from ._report import Context, write_report
from ._training import training_section

__all__ = ["SECTIONS", "run"]

# Name -> section. Sections land here as the capability each figure shows exists.
SECTIONS = {
    "training": training_section,
    "flatness": flatness_section,
    "generative": generative_section,
}


def run(*, out, quick=False, device="auto", figures=None) -> str:
    """Run the selected sections and write ``out/report.md``; return its path."""
    from .._device import resolve_device

    resolve_device(device)  # a clear error for device="cuda" without CUDA, before any work
    names = list(SECTIONS) if figures is None else figures
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        raise ValueError(f"Unknown section(s) {unknown}; available: {sorted(SECTIONS)}.")
    os.makedirs(out, exist_ok=True)
    ctx = Context(out=out, quick=quick, device=device)
    sections = []
    # Quick mode trains small networks, too small for intra-op parallelism to pay; on
    # shared cores torch's second thread spins (measured: the flatness section took 4.8 s
    # with one thread and 13-58 s with two on 2 loaded cores).
    with torch_threads(1 if quick else None):
        for name in names:
            start = time.perf_counter()
            rows = SECTIONS[name](ctx)
            sections.append((name, rows, time.perf_counter() - start))
    header = {
        "mode": "quick" if quick else "full",
        "device": device,
        "python": platform.python_version(),
    }
    return write_report(os.path.join(out, "report.md"), header, sections)
