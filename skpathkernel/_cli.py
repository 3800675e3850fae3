"""The command line: ``skpathkernel info`` and ``skpathkernel reproduce``."""

from __future__ import annotations

import argparse
import os
import platform
import sys

import numpy
import scipy
import sklearn
import torch

from . import __version__
from ._reproduce import run_sections

__all__ = ["main"]


def _info(args) -> int:
    cuda = torch.cuda.is_available()
    lines = [
        f"skpathkernel {__version__}",
        f"python       {platform.python_version()} ({platform.machine()})",
        f"numpy        {numpy.__version__}",
        f"scipy        {scipy.__version__}",
        f"scikit-learn {sklearn.__version__}",
        f"torch        {torch.__version__} (CUDA build: {torch.version.cuda or 'no'})",
        f"device       {'cuda: ' + torch.cuda.get_device_name(0) if cuda else 'cpu'}"
        f" (device='auto' trains on {'cuda' if cuda else 'cpu'})",
        f"threads      torch {torch.get_num_threads()}, cpu cores {os.cpu_count()}",
    ]
    print("\n".join(lines))
    return 0


def _reproduce(args) -> int:
    figures = None
    # --figures "" selects nothing (an error), not every section.
    if args.figures is not None:
        figures = [f.strip() for f in args.figures.split(",") if f.strip()]
    report, counts = run_sections(out=args.out, quick=args.quick, device=args.device,
                                  figures=figures, data_home=args.data_home,
                                  n_jobs=args.n_jobs)
    print(f"Wrote {report} and {os.path.splitext(report)[0]}.html: {counts['pass']} claims "
          f"pass, {counts['FAIL']} fail, {counts['-']} rows report a number only.")
    # A claim that does not reproduce is a result, reported as FAIL in the table; the exit
    # status says whether the command itself ran.
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="skpathkernel",
        description="A trained neural network as a kernel machine.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="print versions, device and threads")
    info.set_defaults(func=_info)
    rep = sub.add_parser(
        "reproduce", help="reproduce the experiments of Guo, He & Morel (2026) on embedded data"
    )
    rep.add_argument("--out", default="reproduce_out", help="output folder (default: %(default)s)")
    rep.add_argument("--quick", action="store_true",
                     help="small settings (about a minute on two CPU cores)")
    rep.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                     help="where the networks train and the kernels are computed: auto = "
                          "CUDA when available (default: %(default)s)")
    rep.add_argument("--figures", default=None,
                     help="comma-separated subset of sections: training, 1, 2, 3, 4, 5, 6, 7 "
                          "(= 8), 9, 10, stochastic, flatness, generative (e.g. --figures "
                          "1,3,10)")
    rep.add_argument("--data-home", default=None,
                     help="folder holding optional data sets: CIFAR-10's python batches "
                          "(cifar-10-batches-py/, as torchvision downloads them) enable figure "
                          "2 g-h (default: scikit-learn's data home, $SCIKIT_LEARN_DATA or "
                          "~/scikit_learn_data)")
    rep.add_argument("--n-jobs", type=int, default=2,
                     help="processes for the independent cells of the full run's sweeps and "
                          "fits, one torch thread each; -1: every core (default: %(default)s)")
    rep.set_defaults(func=_reproduce)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    # OSError: an --out that is a file or cannot be written (checked before any work) and
    # a disk that fills during the run: one line that names the path, not a traceback.
    except (ValueError, ImportError, OSError) as exc:
        print(f"skpathkernel: error: {exc}", file=sys.stderr)
        return 2
    # Ctrl-C: one line, and the shell's status for an interrupt (128 + SIGINT), not a
    # traceback through torch; the report is written at the end, so the folder holds only
    # the figures of the sections that finished.
    except KeyboardInterrupt:
        where = f" ({args.out!r} holds no report)" if args.command == "reproduce" else ""
        print(f"skpathkernel: interrupted{where}", file=sys.stderr)
        return 130
