"""The report writers shared by the reproduce sections: ``report.md`` and ``report.html``.

``report.md`` is the table of claims (figure, claim, measured, verdict) and each section's
details; ``report.html`` is the same in one self-contained page, every figure embedded
(base64 PNG) under the first row that names it.
"""

from __future__ import annotations

import base64
import html
import os
import re
from dataclasses import dataclass, field

import torch

from .. import __version__

# A row names its figures as "[name.png]" or "[a.png, b.png]" in its measured text.
_PNG = re.compile(r"[\w.-]+\.png")
_BRACKETS = re.compile(r"\[([^\]]*\.png[^\]]*)\]")


@dataclass
class Context:
    out: str
    quick: bool
    device: str
    # Where optional data sets lie (CIFAR-10); None: scikit-learn's data home.
    data_home: str | None = None
    # Processes that independent cells (sweep cells, fits, seed blocks) are spread over.
    n_jobs: int = 2
    # Fitted estimators shared between sections (figures 1, 9, 10 and the training section
    # train the same circle networks; figures 2, 5, 6 the same digits network).
    cache: dict = field(default_factory=dict)


@dataclass
class SectionTime:
    """A section's wall time and CPU time, in seconds: the main process's and the sum of
    its worker processes' (the cells spread over ``n_jobs``)."""

    wall: float
    cpu: float = 0.0
    workers: float = 0.0

    def __str__(self):
        return (f"wall {self.wall:.1f} s, CPU {self.cpu + self.workers:.1f} s = main "
                f"{self.cpu:.1f} + workers {self.workers:.1f}")


@dataclass
class Row:
    """One measured claim: ``passed`` is None when the row only reports a number."""

    figure: str
    claim: str
    measured: str
    passed: bool | None = None
    details: list[dict] = field(default_factory=list)
    # Titled tables under the section (the paper's settings against ours, a sweep) and,
    # for a row that fails, the most likely reason the sweep points to.
    tables: list[tuple[str, list[dict]]] = field(default_factory=list)
    reason: str | None = None


def _verdict(passed):
    return "-" if passed is None else ("pass" if passed else "FAIL")


def _reason(row):
    """Why ``row`` fails: its own reason, or for a failure whose section seeks none, that
    it was not sought (a FAIL always says one or the other)."""
    if row.reason or row.passed is not False:
        return row.reason
    return ("not sought: no sweep of this row reads the cause; the numbers behind the "
            "verdict are in its measured column.")


def summary(sections) -> dict:
    """Counts of rows that pass, fail and only report."""
    verdicts = [_verdict(r.passed) for _, rows, _ in sections for r in rows]
    return {v: verdicts.count(v) for v in ("pass", "FAIL", "-")}


def _summary_line(counts):
    return (f"{counts['pass']} claims pass, {counts['FAIL']} fail, {counts['-']} rows "
            "report a number only.")


def _figures(measured):
    names = []
    for group in _BRACKETS.findall(measured):
        names += _PNG.findall(group)
    return names


def _header_line(header):
    return (f"skpathkernel {__version__}, torch {torch.__version__}, python "
            f"{header['python']}; mode: {header['mode']}; device: {header['device']}.")


def _time_rows(sections):
    """One row per section and the total: where the run's time went."""
    rows = [{"section": name, "wall s": f"{t.wall:.1f}", "CPU s, main": f"{t.cpu:.1f}",
             "CPU s, workers": f"{t.workers:.1f}"} for name, _, t in sections]
    total = [sum(getattr(t, k) for _, _, t in sections) for k in ("wall", "cpu", "workers")]
    rows.append({"section": "total", "wall s": f"{total[0]:.1f}",
                 "CPU s, main": f"{total[1]:.1f}", "CPU s, workers": f"{total[2]:.1f}"})
    return rows


def _time_note(header):
    return (f"Time per section (n_jobs {header.get('n_jobs', 1)}: the processes the full "
            "run's independent cells are spread over; load average "
            f"{header.get('load', '-')} at the start, {header.get('load_end', '-')} at the end: "
            "on a loaded machine wall time grows, CPU time much less)")


def _md_cell(value):
    """A table cell's text: a "|" of the text (``|x|^2``, ``max |reconstruction - G(z)|``)
    would end the cell and shift the verdict out of its column; a newline would end the
    row."""
    return str(value).replace("|", "\\|").replace("\n", " ")


def _md_row(cells):
    return "| " + " | ".join(_md_cell(c) for c in cells) + " |"


def _md_table(rows):
    keys = list(rows[0])
    return ([_md_row(keys), "|" + "---|" * len(keys)]
            + [_md_row(d.get(k, "") for k in keys) for d in rows] + [""])


def write_report(path, header, sections) -> str:
    lines = [
        "# skpathkernel reproduce",
        "",
        _header_line(header),
        "",
        _summary_line(summary(sections)),
        "",
        "| figure | claim | measured | verdict |",
        "|---|---|---|---|",
    ]
    for _, rows, _ in sections:
        for r in rows:
            lines.append(_md_row([r.figure, r.claim, r.measured, _verdict(r.passed)]))
    for name, rows, time in sections:
        lines += ["", f"## {name} ({time})", ""]
        for r in rows:
            if r.details:
                lines += _md_table(r.details)
            for title, table in r.tables:
                lines += [f"**{r.figure}: {title}**", ""] + _md_table(table)
            if _reason(r):
                lines += [f"**{r.figure}, why it fails:** {_reason(r)}", ""]
    if sections:
        lines += ["", "## time", "", _time_note(header) + ":", ""] + _md_table(
            _time_rows(sections))
    with open(path, "w", encoding="utf-8") as fh:
        fh.write("\n".join(lines) + "\n")
    return path


_STYLE = """
body { font-family: sans-serif; margin: 2em; max-width: 1400px; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; }
th, td { border: 1px solid #ccc; padding: 4px 8px; vertical-align: top; text-align: left; }
th { background: #f0f0f0; }
td.pass { background: #dff0d8; } td.FAIL { background: #f2dede; font-weight: bold; }
tr.figure td { border-top: none; text-align: center; }
tr.figure img { max-width: 100%; }
"""


def _html_table(keys, rows):
    out = ["<table>", "<tr>" + "".join(f"<th>{html.escape(str(k))}</th>" for k in keys)
           + "</tr>"]
    out += ["<tr>" + "".join(f"<td>{html.escape(str(d.get(k, '')))}</td>" for k in keys)
            + "</tr>" for d in rows]
    return out + ["</table>"]


def write_html(path, header, sections) -> str:
    """``report.html``: the claims table with each figure embedded under its first row."""
    out_dir = os.path.dirname(path)
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             "<title>skpathkernel reproduce</title>", f"<style>{_STYLE}</style></head><body>",
             "<h1>skpathkernel reproduce</h1>", f"<p>{html.escape(_header_line(header))}</p>",
             f"<p>{html.escape(_summary_line(summary(sections)))}</p>", "<table>",
             "<tr><th>figure</th><th>claim</th><th>measured</th><th>verdict</th></tr>"]
    shown = set()
    for _, rows, _ in sections:
        for r in rows:
            verdict = _verdict(r.passed)
            parts.append(
                f"<tr><td>{html.escape(r.figure)}</td><td>{html.escape(r.claim)}</td>"
                f"<td>{html.escape(r.measured)}</td>"
                f'<td class="{verdict}">{verdict}</td></tr>')
            for name in _figures(r.measured):
                file = os.path.join(out_dir, name)
                if name in shown or not os.path.exists(file):
                    continue
                shown.add(name)
                with open(file, "rb") as fh:
                    data = base64.b64encode(fh.read()).decode("ascii")
                parts.append(f'<tr class="figure"><td colspan="4"><img alt="{name}" '
                             f'src="data:image/png;base64,{data}"></td></tr>')
    parts.append("</table>")
    for name, rows, time in sections:
        parts.append(f"<h2>{html.escape(name)} ({html.escape(str(time))})</h2>")
        for r in rows:
            if r.details:
                parts += _html_table(list(r.details[0]), r.details)
            for title, table in r.tables:
                parts.append(f"<h3>{html.escape(r.figure)}: {html.escape(title)}</h3>")
                parts += _html_table(list(table[0]), table)
            if _reason(r):
                parts.append(f"<p><b>{html.escape(r.figure)}, why it fails:</b> "
                             f"{html.escape(_reason(r))}</p>")
    if sections:
        parts += ["<h2>time</h2>", f"<p>{html.escape(_time_note(header))}:</p>"]
        time_rows = _time_rows(sections)
        parts += _html_table(list(time_rows[0]), time_rows)
    parts.append("</body></html>")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write("\n".join(parts) + "\n")
    return path
