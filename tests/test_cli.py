"""The command line: ``skpathkernel info`` and ``skpathkernel reproduce``."""

import os
import re
import subprocess
import sys

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
