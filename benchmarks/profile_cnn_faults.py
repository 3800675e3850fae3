"""CPU time, system time and page faults of the CIFAR CNN's Gram by phase (issue 31, s48).

``tangent_gram`` (trace, float32, one torch thread) with the plain-CNN route's functions
wrapped: per call, each phase's CPU time (``time.process_time``), system time and minor
page faults (``getrusage``), summed over its calls; nested phases are also counted in the
enclosing one (``capture`` holds ``forward``, ``backward``, ``first_formed`` and
``rule_terms``). ``forming`` is ``_gram._formed`` (the formed block's first touch
included), ``syrk`` ``_gram._syrk_block``.

Usage: ``OMP_NUM_THREADS=1 taskset -c 1 python -m benchmarks.profile_cnn_faults [NET@N]
[--calls M]``. Results: ``benchmarks/results/cifar_faults_ab-s48.md``.
"""

import argparse
import collections
import functools
import resource
import time

import torch

from benchmarks import _worker
from skpathkernel._tangent import _capture, _cnn, _gram
from skpathkernel._tangent._gram import tangent_gram

_PHASES = [(_gram, "plain_cnn_capture", "capture"), (_cnn, "_forward", "forward"),
           (_cnn, "_backward", "backward"), (_capture, "first_formed", "first_formed"),
           (_capture, "_rule_terms", "rule_terms"), (_gram, "_formed", "forming"),
           (_gram, "_syrk_block", "syrk")]


def _wrapped(acc, real, label):
    @functools.wraps(real)
    def call(*args, **kwargs):
        before, t = resource.getrusage(resource.RUSAGE_SELF), time.process_time()
        try:
            return real(*args, **kwargs)
        finally:
            after, e = resource.getrusage(resource.RUSAGE_SELF), acc[label]
            e[0] += time.process_time() - t
            e[1] += after.ru_stime - before.ru_stime
            e[2] += after.ru_minflt - before.ru_minflt
    return call


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("case", nargs="?", default="cifar@1024")
    parser.add_argument("--calls", type=int, default=2)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    arch, n = args.case.split("@")
    net, params, X = _worker.gram_problem({"arch": arch, "n": int(n), "dtype": "float32"})
    acc = collections.defaultdict(lambda: [0.0, 0.0, 0])
    for module, name, label in _PHASES:
        setattr(module, name, _wrapped(acc, getattr(module, name), label))
    tangent_gram(net, params, X)  # warm-up
    for _ in range(args.calls):
        acc.clear()
        before, t = resource.getrusage(resource.RUSAGE_SELF), time.process_time()
        tangent_gram(net, params, X)
        dt, after = time.process_time() - t, resource.getrusage(resource.RUSAGE_SELF)
        print(f"call {dt:.3f} s CPU, {after.ru_stime - before.ru_stime:.3f} s system, "
              f"{after.ru_minflt - before.ru_minflt} page faults")
        for label in [label for *_, label in _PHASES if label in acc]:
            cpu, sys_time, faults = acc[label]
            print(f"  {label:13s} {cpu:.3f} s CPU, {sys_time:.3f} s system, {faults} faults")


if __name__ == "__main__":
    main()
