"""The report writer shared by the reproduce sections."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Context:
    out: str
    quick: bool
    device: str
    # Fitted estimators shared between sections (figures 1, 9, 10 and the training section
    # train the same circle networks; figures 2, 5, 6 the same digits network).
    cache: dict = field(default_factory=dict)


@dataclass
class Row:
    """One measured claim: ``passed`` is None when the row only reports a number."""

    figure: str
    claim: str
    measured: str
    passed: bool | None = None
    details: list[dict] = field(default_factory=list)


def _verdict(passed):
    return "-" if passed is None else ("pass" if passed else "FAIL")


def write_report(path, header, sections) -> str:
    import torch

    from .. import __version__

    lines = [
        "# skpathkernel reproduce",
        "",
        f"skpathkernel {__version__}, torch {torch.__version__}, python {header['python']}; "
        f"mode: {header['mode']}; device: {header['device']}.",
        "",
        "| figure | claim | measured | verdict |",
        "|---|---|---|---|",
    ]
    for _, rows, _ in sections:
        for r in rows:
            lines.append(f"| {r.figure} | {r.claim} | {r.measured} | {_verdict(r.passed)} |")
    for name, rows, seconds in sections:
        lines += ["", f"## {name} ({seconds:.1f} s)", ""]
        for r in rows:
            if r.details:
                keys = list(r.details[0])
                lines.append("| " + " | ".join(keys) + " |")
                lines.append("|" + "---|" * len(keys))
                lines += ["| " + " | ".join(str(d[k]) for k in keys) + " |" for d in r.details]
                lines.append("")
    with open(path, "w", encoding="utf-8") as fh:
        fh.write("\n".join(lines) + "\n")
    return path
