"""Every Python block of the README and of the user guide runs as written, page by page.

sybil parses the blocks; each page is one test that evaluates its blocks in page order in
one namespace, as a reader pasting them into one interpreter would. One test per page (not
one per block) keeps a page's blocks on one pytest-xdist worker.
"""

import builtins
import importlib
import inspect
import io
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import docutils.core
import matplotlib

matplotlib.use("Agg")

import pytest
from sklearn.exceptions import ConvergenceWarning
from sybil import Document
from sybil.parsers import markdown, rest

from benchmarks.__main__ import GROUPS

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
GUIDE = ROOT / "docs" / "user_guide"

# Pages over about 20 s on a 2-core machine; CI still runs them (it selects no marker).
SLOW = {"attribution.rst", "inputs.rst", "choosing.rst", "training.rst", "README.md"}
# Pages that start a dask.distributed cluster, deselected with the dask tests.
DASK = {"scaling.rst"}
# Pages of formulas and derivations only, with nothing a user calls.
NO_CODE = {"theory.rst"}

PAGES = [README, *sorted(p for p in GUIDE.glob("*.rst") if p.name != "index.rst")]


def _parse(path):
    """The page as a sybil Document: its Python blocks and its ``skip`` directives."""
    lang = markdown if path.suffix == ".md" else rest
    return Document.parse(str(path), lang.PythonCodeBlockParser(), lang.SkipParser())


def _marks(path):
    marks = [pytest.mark.slow] if path.name in SLOW else []
    return marks + ([pytest.mark.dask] if path.name in DASK else [])


@pytest.mark.parametrize("path", [pytest.param(p, marks=_marks(p), id=p.name) for p in PAGES])
def test_page_blocks_run(path, tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    # Blocks write files (a saved path, a saved model): into a temporary folder.
    monkeypatch.chdir(tmp_path)
    document = _parse(path)
    # As in a script the reader runs, so that `if __name__ == "__main__":` blocks run.
    document.namespace["__name__"] = "__main__"
    examples = list(document)
    try:
        with warnings.catch_warnings():
            # A block that leaves a reader with a ConvergenceWarning is a wrong example.
            warnings.simplefilter("error", ConvergenceWarning)
            for example in examples:
                example.evaluate()
    finally:
        plt.close("all")
    # A page whose blocks were all dropped by the parser (a wrong language tag, a stray
    # skip) would pass without running anything.
    ran = any(e.region.evaluator is not None for e in examples)
    assert ran != (path.name in NO_CODE), f"{path.name}: blocks run: {ran}"
    if path == README:
        # What the README says its blocks leave behind: a saved path and an exact split.
        assert (tmp_path / "path.pt").exists()
        assert document.namespace["res"].error < 1e-4


@pytest.mark.parametrize("path", PAGES[1:], ids=lambda p: p.name)
def test_no_untested_literal_blocks(path):
    """Code on a page sits in ``code-block`` directives with a language, which sybil reads.

    A bare ``::`` literal block would be shown as code but never run.
    """
    bare = [
        i + 1
        for i, line in enumerate(path.read_text().splitlines())
        if line.rstrip().endswith("::") and not line.lstrip().startswith("..")
    ]
    assert not bare, f"{path.name}: literal blocks at lines {bare}; use `.. code-block:: python`"


def test_readme_blocks_have_a_language():
    fences = re.findall(r"^```(\S*)$", README.read_text(), flags=re.M)
    # Opening fences carry a language; closing ones are bare: they alternate.
    assert all(fences[0::2]) and not any(fences[1::2])


def test_install_page_states_the_package_requirements():
    """docs/install.rst and the README quote pyproject.toml's version bounds.

    A floor raised in pyproject.toml (torch's, after the oldest release failed the suite)
    must be raised where a reader looks before installing.
    """
    pyproject = (ROOT / "pyproject.toml").read_text()
    page = " ".join((ROOT / "docs" / "install.rst").read_text().split())
    python = re.search(r'requires-python = ">=([\d.]+)"', pyproject)[1]
    sklearn = re.search(r'"scikit-learn>=([\d.]+)"', pyproject)[1]
    torch_low, torch_high = re.search(r'"torch>=([\d.]+),<([\d.]+)"', pyproject).groups()
    assert f"Python {python}+" in page
    assert f"scikit-learn ({sklearn} or newer)" in page
    assert f"PyTorch ({torch_low} or newer, before {torch_high}," in page
    assert f"`torch>={torch_low},<{torch_high}`" in README.read_text()


def _backticked(text):
    return set(re.findall(r"``?(\w+)``?", text))


def test_benchmark_group_lists_name_every_group():
    """The README's and the Benchmarks page's lists of ``python -m benchmarks`` groups name
    every group the runner has (``--only distributed`` was missing from both)."""
    readme = " ".join(README.read_text().split())
    listed = re.search(r"runs every benchmark \(groups: ([\w, ]+)\)", readme)[1]
    assert listed.split(", ") == GROUPS
    page = " ".join((ROOT / "docs" / "benchmarks.rst").read_text().split())
    groups_paragraph = re.search(r"Groups: (.*?) the default runs them all", page)[1]
    assert set(GROUPS) <= _backticked(groups_paragraph)


# Cross-references to other projects' objects: no intersphinx offline, not ours to check.
FOREIGN = ("sklearn.", "numpy.", "torch.", "joblib.", "dask.", "scipy.", "collections.",
           "os.", "matplotlib.")
ROLE = re.compile(r":(?:class|func|meth|attr|mod|obj|exc|data):`(?:[^`<]*<)?~?\.?([\w.]+)>?`")


def _api_targets():
    """What docs/api.rst documents: the modules it declares (``.. module::``), its
    autosummary entries, and the members of the classes among them."""
    modules, entries, current = set(), set(), None
    for line in (ROOT / "docs" / "api.rst").read_text().splitlines():
        if match := re.match(r"\.\. (current)?module:: (\S+)", line):
            current = match[2]
            if not match[1]:
                modules.add(current)
        elif re.fullmatch(r"   [A-Za-z_][\w.]*", line):
            entries.add(f"{current}.{line.strip()}")
    return modules, entries


def _documented(path, modules, entries):
    if path in modules or path in entries:
        return True
    owner, _, member = path.rpartition(".")
    if owner not in entries:
        return False
    module, _, name = owner.rpartition(".")
    obj = getattr(importlib.import_module(module), name)
    return inspect.isclass(obj) and hasattr(obj, member)


def _broken_references(text, current=None):
    """The cross-references of ``text`` that no page of the API reference documents,
    resolved as Sphinx's Python domain does: in the current module, then as written."""
    modules, entries = _api_targets()
    broken = []
    for line in text.splitlines():
        if match := re.match(r"\s*\.\. currentmodule:: (\S+)", line):
            current = match[1]
        for target in ROLE.findall(line):
            # Other projects', Python's (``ValueError``), and private objects, which have
            # no page to link to.
            if (target.startswith(FOREIGN) or target in vars(builtins)
                    or any(part.startswith("_") for part in target.split("."))):
                continue
            candidates = ([f"{current}.{target}"] if current else []) + [target]
            if not any(_documented(c, modules, entries) for c in candidates):
                broken.append(target)
    return broken


@pytest.mark.parametrize("path", PAGES[1:], ids=lambda p: p.name)
def test_guide_cross_references_resolve(path):
    """Every ``:class:`` / ``:meth:`` / ``:mod:`` ... of a user guide page links to a page
    of the API reference (an unresolved one renders as plain text, without a warning)."""
    broken = _broken_references(path.read_text())
    assert not broken, f"{path.name}: unresolved references {sorted(set(broken))}"


def test_docstring_cross_references_resolve():
    """The docstrings' fully qualified references (``skpathkernel.X``) name the path the
    API reference documents the object under (``skpathkernel.kernels.TangentKernel``,
    not its re-export ``skpathkernel.TangentKernel``)."""
    broken = {}
    for source in sorted((ROOT / "skpathkernel").rglob("*.py")):
        refs = [t for t in _broken_references(source.read_text())
                if t.startswith("skpathkernel.")]
        if refs:
            broken[str(source.relative_to(ROOT))] = sorted(set(refs))
    assert not broken, f"unresolved references: {broken}"


@pytest.mark.slow
def test_ddp_script_prints_what_the_guide_shows(tmp_path):
    """``torchrun --nproc_per_node 2 train_ddp.py`` prints the output the "Training on
    several processes" page shows: the same path, and a reconstruction error of the same
    order (its last digits are the machine's round-off; the page showed 9.99e-16 where the
    script printed 3.99e-14). And no rank reaches the interpreter's exit with gloo's
    threads alive: one that frees a collective's tensors while Python shuts down takes the
    GIL and aborts the rank ("terminate called without an active exception"; rank 1 of
    three CI runs of 2026-12-04/05, one run in 10-40 on a loaded two-core machine). And no
    rank hangs in its teardown when a gloo thread still has a collective's tensors to drop
    as the process group is freed: the probe makes that happen on rank 1 every run (one
    all-reduce in flight, whose tensor Python has dropped, matched by rank 0 two seconds
    after rank 1 starts tearing down). Freed with the GIL held (by DDP's reducer, in a
    collection), the group joins a thread that waits for the GIL: the script hung there
    one run in 11 on a loaded two-core machine (a CI timeout, 2026-12-07), and every run
    with the probe's collective; ``faulthandler`` ends such a rank after 60 s with its
    stack in the log."""
    page = (GUIDE / "distributed.rst").read_text()
    shown = re.search(r"\.\. code-block:: text\n\n((?:    .*\n)+)", page)[1]
    shown = [line.strip() for line in shown.splitlines()]
    script = GUIDE / "scripts" / "train_ddp.py"
    # The script runs as __main__ under a probe that, at exit (atexit runs before the
    # interpreter's shutdown), writes the names of the threads still alive to stderr;
    # and that, as the script destroys its process group, leaves rank 1's gloo thread a
    # collective to finish (and its tensor to drop) once rank 0 joins in, two seconds
    # after rank 1 has gone on to free the group.
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import atexit, faulthandler, os, runpy, sys, time\n"
        "import torch, torch.distributed as dist\n"
        "def report():\n"
        "    faulthandler.cancel_dump_traceback_later()\n"
        "    names = []\n"
        "    for t in os.listdir('/proc/self/task'):\n"
        "        try:  # a thread ending between the listing and the read is gone\n"
        "            names.append(open(f'/proc/self/task/{t}/comm').read().strip())\n"
        "        except FileNotFoundError:\n"
        "            pass\n"
        "    print('threads at exit:', sorted(names), file=sys.stderr, flush=True)\n"
        "atexit.register(report)\n"
        "destroy = dist.destroy_process_group\n"
        "def destroy_with_a_collective_in_flight(*args, **kwargs):\n"
        "    if dist.get_rank() == 1:\n"
        "        dist.all_reduce(torch.zeros(1), async_op=True)\n"
        "        open('rank1_tears_down', 'w').close()\n"
        "    else:\n"
        "        while not os.path.exists('rank1_tears_down'):\n"
        "            time.sleep(0.01)\n"
        "        time.sleep(2)\n"
        "        dist.all_reduce(torch.zeros(1))\n"
        "    faulthandler.dump_traceback_later(60, exit=True)\n"
        "    destroy(*args, **kwargs)\n"
        "dist.destroy_process_group = destroy_with_a_collective_in_flight\n"
        f"runpy.run_path({str(script)!r}, run_name='__main__')\n")
    # A user's shell: the environment the test process has gathered (libraries' own
    # variables set by earlier tests) is not handed on. Each rank's stderr goes to its
    # own log, shown if the run fails.
    env = {k: os.environ[k] for k in ("PATH", "HOME", "TMPDIR", "LANG", "PYTHONPATH")
           if k in os.environ}
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
         "2", "--redirects", "2", "--log-dir", str(tmp_path / "logs"), str(probe)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
        env={**env, "OMP_NUM_THREADS": "1"})
    stderrs = sorted((tmp_path / "logs").rglob("stderr.log"))
    logs = "\n".join(f"{path}:\n{path.read_text()[-2000:]}" for path in stderrs)
    assert run.returncode == 0, run.stderr[-2000:] + "\n" + logs
    at_exit = [re.search(r"threads at exit: (.*)", path.read_text()) for path in stderrs]
    assert len(at_exit) == 2 and all(at_exit), logs
    assert not [m[1] for m in at_exit if "gloo" in m[1]], logs
    printed = [line for line in run.stdout.splitlines() if line.strip()]
    assert printed[0] == shown[0]
    number = r"reconstruction error (\S+) \(largest \|f\| (\S+)\)"
    (error, largest), (shown_error, shown_largest) = (
        re.fullmatch(number, printed[1]).groups(), re.fullmatch(number, shown[1]).groups())
    assert largest == shown_largest
    assert 0.1 < float(error) / float(shown_error) < 10, (printed[1], shown[1])


# The reST errors docutils alone can judge in a guide (Sphinx's roles and directives are
# unknown to it, left to the docs build): a bare ``|f|`` is a substitution, a word ending
# in ``_`` a link. Either fails CI's ``sphinx-build -W`` after the tests have passed.
GUIDE_RST_ERRORS = ("Undefined substitution referenced", "Unknown target name")


@pytest.mark.parametrize("page", sorted(
    str(p.relative_to(ROOT)) for p in (ROOT / "docs").rglob("*.rst")
    if not {"_build", "generated", "auto_examples"} & set(p.parts)))
def test_guide_page_has_no_rest_reference_errors(page):
    stream = io.StringIO()
    docutils.core.publish_doctree((ROOT / page).read_text(), settings_overrides={
        "warning_stream": stream, "report_level": 3, "halt_level": 5,
        "file_insertion_enabled": False, "raw_enabled": False})
    errors = [line for line in stream.getvalue().splitlines()
              if any(kind in line for kind in GUIDE_RST_ERRORS)]
    assert not errors, f"{page}:\n" + "\n".join(errors)

