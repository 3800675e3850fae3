"""One process A/B of the tangent-kernel Gram on the CPU against a git ref's (issue 31):
the working tree's ``tangent_gram`` ("tree") against the whole package as it is at
``--ref`` ("ref", default ``main``), imported beside it as ``skpathkernel_ref``.

Made for the CPU's wide capture chunks (``_gram._wide_chunks``) on the ten-output
ResNet at N = 1024 (``benchmarks/results/wide_chunks.md``).
Each case runs once per side on 8 rows (warm-up), then ``tangent_gram(net, params, X)``
at the default memory budget, the sides alternating (the order reversed every round),
``--reps`` rounds, timed by ``time.process_time`` on one torch thread.

Usage: ``OMP_NUM_THREADS=1 taskset -c 1 python -m benchmarks.bench_wide_chunks_ab
[--cases resnet@1024,vit@512] [--reps 5] [--out PATH]``. Writes ``PATH.md`` and ``.json``
(default ``benchmarks/results/wide_chunks_ab``).
"""

import argparse
import importlib
import importlib.util
import io
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import _nets
from benchmarks._ab import ab_provenance, outputs_row, write_ab
from skpathkernel._tangent import tangent_gram

ROOT = Path(__file__).resolve().parents[1]


def reference_package(ref: str):
    """``skpathkernel._tangent._gram`` of the package as it is at git ``ref``."""
    tar = subprocess.run(["git", "archive", ref, "skpathkernel"], cwd=ROOT, check=True,
                         capture_output=True).stdout
    where = Path(tempfile.mkdtemp())
    with tarfile.open(fileobj=io.BytesIO(tar)) as archive:
        archive.extractall(where, filter="data")
    init = where / "skpathkernel" / "__init__.py"
    spec = importlib.util.spec_from_file_location(
        "skpathkernel_ref", init, submodule_search_locations=[str(init.parent)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["skpathkernel_ref"] = module
    spec.loader.exec_module(module)
    return importlib.import_module("skpathkernel_ref._tangent._gram")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default="resnet@1024")
    parser.add_argument("--ref", default="main")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "wide_chunks_ab"))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    sides = {"ref": reference_package(args.ref).tangent_gram, "tree": tangent_gram}
    rows = []
    for case in args.cases.split(","):
        arch, n = case.split("@")
        torch.manual_seed(0)
        net, X = _nets.build(arch), _nets.inputs(arch, int(n))
        params = {k: v.detach() for k, v in net.named_parameters()}
        for fn in sides.values():
            fn(net, params, X[:8])
        times, out = {"ref": [], "tree": []}, {}
        for r in range(args.reps):
            for side in (("ref", "tree") if r % 2 == 0 else ("tree", "ref")):
                start = time.process_time()
                out[side] = sides[side](net, params, X)
                times[side].append(time.process_time() - start)
        rows.append(outputs_row(f"{arch}, N = {n}", times,
                                {k: v.double().numpy() for k, v in out.items()}))
    prov = ab_provenance(ROOT, "bench_wide_chunks_ab", ["skpathkernel", "benchmarks"],
                         args.ref, args.reps)
    write_ab(Path(args.out), f"The CPU's wide capture chunks against {args.ref}",
             "time.process_time", prov, rows, 2, machine=True)


if __name__ == "__main__":
    main()
