"""``skpathkernel reproduce``: the experiments of Guo, He & Morel (2026), one module per section.

Each section is a function ``(context) -> list[Row]`` registered in :data:`SECTIONS`; it
uses only the public API, writes its figures into ``context.out`` and returns the claims
it measured. :func:`run` runs the sections and writes ``report.md`` and ``report.html``.

A claim that does not reproduce is a FAIL row of the report, not an error: the command
exits 0 whatever the verdicts (CI runs ``--quick`` as a smoke test of every section and
reads the report), and prints how many claims passed and failed.
"""

from __future__ import annotations

import os
import platform
import tempfile
import time

from sklearn.utils._optional_dependencies import check_matplotlib_support

from .._device import resolve_device, torch_threads
from ._common import worker_cpu
from ._fig1 import figure1_section
from ._fig2 import figure2_section
from ._fig3 import figure3_section
from ._fig4 import figure4_section
from ._fig5 import figure5_section
from ._fig6 import figure6_section
from ._fig7 import figure7_section
from ._fig9 import figure9_section
from ._fig10 import figure10_section
from ._flatness import flatness_section
from ._generative import generative_section
from ._report import Context, SectionTime, summary, write_html, write_report
from ._stochastic import stochastic_section
from ._training import training_section

__all__ = ["SECTIONS", "run"]

# Name -> section. Sections land here as the capability each figure shows exists.
# Figures 7 and 8 share one section ("7"; "8" names it too).
SECTIONS = {
    "training": training_section,
    "1": figure1_section,
    "2": figure2_section,
    "3": figure3_section,
    "4": figure4_section,
    "5": figure5_section,
    "6": figure6_section,
    "7": figure7_section,
    "9": figure9_section,
    "10": figure10_section,
    "stochastic": stochastic_section,
    "flatness": flatness_section,
    "generative": generative_section,
}


def _section_name(name):
    # "fig3" / "figure3" / "3" all name figure 3.
    name = str(name).strip().lower()
    for prefix in ("figure", "fig"):
        if name.startswith(prefix) and name[len(prefix):].strip().isdigit():
            name = name[len(prefix):].strip()
            break
    return "7" if name == "8" else name


def run(*, out, quick=False, device="auto", figures=None, data_home=None, n_jobs=2) -> str:
    """Run the selected sections and write ``out/report.md`` and ``out/report.html``;
    return the path of ``report.md``. ``n_jobs``: processes for independent cells (joblib's
    convention: -1 every core)."""
    return run_sections(out=out, quick=quick, device=device, figures=figures,
                        data_home=data_home, n_jobs=n_jobs)[0]


def _prepare_out(out):
    """Create ``out`` and check that a file can be written into it, before any section
    runs: a folder that cannot take the report would otherwise fail at the first figure,
    after minutes of work."""
    out = os.fspath(out)
    if os.path.exists(out) and not os.path.isdir(out):
        raise NotADirectoryError(
            f"out={out!r} is an existing file, not a folder: pass a folder for the report "
            "and its figures (it is created when missing).")
    try:
        os.makedirs(out, exist_ok=True)
        # os.access says yes to root on a read-only or pseudo file system: write a file,
        # as the figures will.
        with tempfile.NamedTemporaryFile(dir=out, prefix=".skpathkernel-"):
            pass
    except OSError as exc:
        # OSError(errno, ...) is the errno's subclass (PermissionError, ...).
        raise OSError(exc.errno, f"cannot write the report and its figures into out={out!r} "
                      f"({exc.strerror}); pass a folder you can write to") from exc


def _load():
    return "/".join(f"{v:.1f}" for v in os.getloadavg()) if hasattr(os, "getloadavg") else "-"


def run_sections(*, out, quick=False, device="auto", figures=None, data_home=None, n_jobs=2):
    """:func:`run`, also returning the verdict counts ``{"pass", "FAIL", "-"}``."""
    if isinstance(n_jobs, bool) or not isinstance(n_jobs, int) or n_jobs == 0 or n_jobs < -1:
        raise ValueError(f"n_jobs must be a positive int or -1 (every core); got {n_jobs!r}.")
    n_jobs = (os.cpu_count() or 1) if n_jobs == -1 else n_jobs
    # A clear error for device="cuda" without CUDA, before any work.
    resolved = resolve_device(device).type
    # Each section once, in the order asked ("7,8" name one section: it ran twice, its
    # rows twice in the report).
    names = list(SECTIONS) if figures is None else list(
        dict.fromkeys(_section_name(f) for f in figures))
    if not names:
        raise ValueError(f"No section selected; available: {sorted(SECTIONS)}.")
    unknown = [n for n in names if n not in SECTIONS]
    if unknown:
        raise ValueError(f"Unknown section(s) {unknown}; available: {sorted(SECTIONS)}.")
    # Every section draws: without matplotlib, say so before creating ``out`` (the bare
    # "No module named 'matplotlib'" came after, leaving an empty folder).
    check_matplotlib_support("skpathkernel reproduce")
    _prepare_out(out)
    import matplotlib

    # Figures go to files only; a headless machine has no display to open.
    matplotlib.use("Agg")
    ctx = Context(out=out, quick=quick, device=device, data_home=data_home, n_jobs=n_jobs)
    sections = []
    load = _load()
    # The papers' networks are a few thousand parameters: intra-op threads cost more in
    # synchronisation than they save (measured on 2 cores: a small fit 10-40x slower with
    # two threads than with one, the flatness section 4.8 s vs 13-58 s). Restored after.
    with torch_threads(1):
        for name in names:
            start = (time.perf_counter(), time.process_time(), worker_cpu())
            rows = SECTIONS[name](ctx)
            sections.append((name, rows, SectionTime(
                time.perf_counter() - start[0], time.process_time() - start[1],
                worker_cpu() - start[2])))
    header = {
        "mode": "quick" if quick else "full",
        # "auto" alone does not say where the numbers were measured.
        "device": device if device == resolved else f"{device} ({resolved})",
        "python": platform.python_version(),
        "n_jobs": n_jobs,
        "load": load,
        "load_end": _load(),
    }
    write_html(os.path.join(out, "report.html"), header, sections)
    return write_report(os.path.join(out, "report.md"), header, sections), summary(sections)
