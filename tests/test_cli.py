"""The command line: ``skpathkernel info`` and ``skpathkernel reproduce``."""

import os
import re
import subprocess
import sys

import pytest
import sklearn
import torch

from skpathkernel import __version__
from skpathkernel._cli import main


def test_info_prints_versions_device_threads(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert f"skpathkernel {__version__}" in out
    assert torch.__version__ in out and sklearn.__version__ in out
    assert re.search(r"threads\s+torch \d+, cpu cores \d+", out)


def test_python_dash_m_entry_point():
    proc = subprocess.run([sys.executable, "-m", "skpathkernel", "info"], capture_output=True,
                          text=True, check=False)
    assert proc.returncode == 0 and "scikit-learn" in proc.stdout


def test_reproduce_writes_report_and_figures(tmp_path, capsys):
    out = tmp_path / "rep"
    assert main(["reproduce", "--quick", "--out", str(out), "--figures", "fig8,3"]) == 0
    report = (out / "report.md").read_text()
    claims = report.split("\n## ")[0]  # the claims table, before the sections' details
    rows = [line for line in claims.splitlines() if line.startswith("| 7-8 ")
            or line.startswith("| 3")]
    # Two claims each for figures 7-8 and 3, plus the detector's own decision, whose
    # verdict is the detector's (the claim itself is tested in test_reproduce_claims).
    assert len(rows) == 5
    decision = [line for line in rows if "default predict" in line]
    assert len(decision) == 1
    assert all(line.rstrip().endswith("| pass |") for line in rows if line not in decision), \
        report
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert {"fig7_rank_gap.png", "fig8_relu_regimes.png", "fig3_tangent_svm.png"} <= set(pngs)
    # Every PNG the report names exists, and report.html embeds each one next to its row.
    named = set(re.findall(r"\[([\w.-]+\.png)", report))
    for name in named:
        assert os.path.exists(out / name)
    page = (out / "report.html").read_text()
    assert page.count("data:image/png;base64,") == len(named) == 3
    assert "Wrote" in capsys.readouterr().out


def test_reproduce_rejects_unknown_sections(tmp_path, capsys):
    assert main(["reproduce", "--out", str(tmp_path), "--figures", "11"]) == 2
    err = capsys.readouterr().err
    assert "Unknown section(s) ['11']" in err and "available" in err
    assert not (tmp_path / "report.md").exists()


def test_reproduce_cuda_without_cuda_fails_before_any_work(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["reproduce", "--device", "cuda", "--out", str(tmp_path / "x")]) == 2
    assert "no CUDA device" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def _unwritable_folder(tmp_path):
    """A folder no file can be created in: read-only for a user, /proc for root (which
    os.access and chmod do not stop)."""
    folder = tmp_path / "read_only"
    folder.mkdir()
    folder.chmod(0o555)
    if not os.access(folder, os.W_OK):
        return folder
    if os.path.isdir("/proc"):
        return "/proc"
    pytest.skip("no folder this user cannot write into")


@pytest.mark.parametrize("where", ["file", "under_file", "read_only"])
def test_reproduce_refuses_an_out_it_cannot_write_before_any_work(where, tmp_path, capsys,
                                                                   monkeypatch):
    from skpathkernel._reproduce import SECTIONS

    ran = []
    monkeypatch.setitem(SECTIONS, "fake", lambda ctx: ran.append(ctx) or [])
    (tmp_path / "a_file").write_text("not a folder")
    out = {"file": tmp_path / "a_file", "under_file": tmp_path / "a_file" / "sub",
           "read_only": _unwritable_folder(tmp_path)}[where]
    try:
        status = main(["reproduce", "--out", str(out), "--figures", "fake"])
    finally:
        (tmp_path / "read_only").chmod(0o755)
    err = capsys.readouterr().err
    # A one-line error naming the path and exit status 2, not a traceback, and no section
    # ran (an unwritable folder failed only when the first figure was saved).
    assert status == 2 and ran == []
    assert err.startswith("skpathkernel: error:") and repr(str(out)) in err
    assert "existing file, not a folder" in err if where == "file" else "cannot write" in err
    assert (tmp_path / "a_file").read_text() == "not a folder"


def test_reproduce_runs_each_selected_section_once_and_refuses_an_empty_selection(
        tmp_path, capsys, monkeypatch):
    from skpathkernel import _reproduce
    from skpathkernel._reproduce._report import Row

    ran = []

    def fake(ctx):
        ran.append("7")
        return [Row("7-8", "claim", "measured", True)]

    # Only the fake section exists: a selection read as "everything" runs just it.
    monkeypatch.setattr(_reproduce, "SECTIONS", {"7": fake})
    # "7" and "8" name one section: it runs once and its row appears once.
    assert main(["reproduce", "--out", str(tmp_path / "a"), "--figures", "7,8,fig7"]) == 0
    assert ran == ["7"]
    assert (tmp_path / "a" / "report.md").read_text().count("| 7-8 | claim |") == 1
    capsys.readouterr()
    for empty in ("", ","):
        assert main(["reproduce", "--out", str(tmp_path / "b"), "--figures", empty]) == 2
        assert "No section selected" in capsys.readouterr().err
    assert ran == ["7"] and not (tmp_path / "b").exists()


def test_report_names_the_device_auto_resolved_to(tmp_path, monkeypatch, capsys):
    from skpathkernel._reproduce import SECTIONS

    monkeypatch.setitem(SECTIONS, "fake", lambda ctx: [])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["reproduce", "--out", str(tmp_path), "--figures", "fake"]) == 0
    # "device: auto." did not say whether the numbers were measured on a GPU.
    assert "; device: auto (cpu)." in (tmp_path / "report.md").read_text()
    assert main(["reproduce", "--out", str(tmp_path), "--figures", "fake",
                 "--device", "cpu"]) == 0
    assert "; device: cpu." in (tmp_path / "report.md").read_text()


def test_reproduce_without_matplotlib_says_so_before_any_work(tmp_path, monkeypatch,
                                                             capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib fails
    assert main(["reproduce", "--out", str(tmp_path / "x"), "--figures", "3"]) == 2
    err = capsys.readouterr().err
    assert "skpathkernel reproduce requires matplotlib" in err and "pip install" in err
    assert not (tmp_path / "x").exists()
    assert main(["info"]) == 0  # info needs no matplotlib


def test_reproduce_interrupted_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    from skpathkernel._reproduce import SECTIONS

    def interrupted(ctx):
        raise KeyboardInterrupt

    monkeypatch.setitem(SECTIONS, "fake", interrupted)
    assert main(["reproduce", "--out", str(tmp_path), "--figures", "fake"]) == 130
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [f"skpathkernel: interrupted ({str(tmp_path)!r} holds "
                                        "no report)"]
    assert not (tmp_path / "report.md").exists()
