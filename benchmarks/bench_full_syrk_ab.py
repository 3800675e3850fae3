"""One-process A/B of the "full" Gram's SYRK of formed rows (session s53).

A symmetric ``output="full"`` block whose formed gradient blocks are dense rows takes one
BLAS SYRK per term on the ``(n C, n C)`` square of its rows of sample and output, and the
blocks off the diagonal one GEMM per term into their squares
(:data:`skpathkernel._tangent._gram.FULL_SYRK`); "ref" patches the switch off (each term's
``C x C`` blocks by a GEMM into a fresh tensor, added to the block, its diagonal squares
symmetrised by a permuted copy, as before), by
:func:`benchmarks.bench_vit_cuts_ab.alternated`: the two sides alternate (order reversed
every round), ``time.process_time`` of ``tangent_gram`` per call (float32, one torch
thread), K compared (max ``|dK|`` / max ``|K|``), and with ``--peak`` the peak of torch's
CPU allocations of one more call per side less K.

Cases: ``unet-OUTPUT@N`` (the user trial's DDPM U-Net, c = 16 channels, 8 x 8 images:
C = 64 outputs; ``unet16-OUTPUT@N`` on 16 x 16 images, C = 256) and ``ARCH-OUTPUT@N`` for
the benchmark's networks (:func:`benchmarks._worker.gram_problem`).

``--cut check``: the switch is :data:`skpathkernel._tangent._gram.BATCHED_CHECK` instead
(the one-sample autograd check by one batched backward pass over the outputs).

Usage: ``OMP_NUM_THREADS=1 taskset -c 1 python -m benchmarks.bench_full_syrk_ab
unet-full@32 unet-trace@64 cifar-full@128 [--reps R] [--peak]``. Results:
``benchmarks/results/gram_dense_route-s53.md``.
"""

import argparse
import functools
from unittest import mock

import torch

from benchmarks import _worker
from benchmarks.bench_vit_cuts_ab import alternated
from benchmarks.trial_generative import T_STEPS, UNet
from skpathkernel._tangent import _gram


def problem(case):
    """``(module, params, X, kwargs)`` of a case ``NAME-OUTPUT@N``."""
    name, n = case.split("@")
    arch, output = name.rsplit("-", 1)
    n = int(n)
    torch.manual_seed(0)
    if arch in ("unet", "unet16"):
        H = 8 if arch == "unet" else 16
        module = UNet()
        X = torch.cat(
            [
                torch.randn(n, 1, H, H),
                torch.randint(T_STEPS, (n, 1, 1, 1)).float().expand(n, 1, H, H),
            ],
            1,
        )
        params = {k: v.detach() for k, v in module.named_parameters()}
    else:
        module, params, X = _worker.gram_problem({"arch": arch, "n": n, "dtype": "float32"})
    return module, params, X, {"output": output}


def _side(name, cut="syrk"):
    switch = "FULL_SYRK" if cut == "syrk" else "BATCHED_CHECK"
    return mock.patch.object(_gram, switch, name == "new")


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("cases", nargs="*", default=["unet-full@32"])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--peak", action="store_true")
    parser.add_argument("--cut", default="syrk", choices=["syrk", "check"])
    args = parser.parse_args(argv)
    alternated(
        args.cases, args.reps, args.peak, functools.partial(_side, cut=args.cut), problem=problem
    )


if __name__ == "__main__":
    main()
