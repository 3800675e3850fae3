"""Cost of the capture's saved-tensor watch (s47): ``tangent_gram`` with the watch
(``_saved.SavedWatch``: a hook per saved tensor recording its version; on the probe
also a dispatch mode recording the ops' outputs) against the code before it (the
probe's graph-bytes hooks alone), alternating in one process, CPU time per
call, medians. The watch is what finds an in-place op rewriting a saved tensor
(``nn.ReLU(inplace=True)`` after ``nn.Tanh()``); networks without one pay only it.
Usage: ``OMP_NUM_THREADS=1 taskset -c 0 python -m benchmarks.bench_saved_watch_ab``
(writes ``benchmarks/results/saved_watch_ab-s47.md``).
"""

import contextlib
import functools
import os
import statistics
import time
from pathlib import Path

import torch

from benchmarks import _worker
from skpathkernel._tangent import _capture, tangent_gram

ROOT = Path(__file__).resolve().parent.parent
ROUNDS = 7


class _Bare:
    """The code before the watch: the probe's graph-bytes hooks alone (no version record,
    no dispatch mode), nothing on the other captures."""

    def __init__(self, graph=None, guard=False):
        self.graph = graph
        self._hooks = (torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
                       if graph is not None else contextlib.nullcontext())

    def _pack(self, t):
        self.graph.add(t)
        return t

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)

    rewritten = False

    def alive(self):
        return []


def _cpu(call):
    start = time.process_time()
    call()
    return time.process_time() - start


def main():
    torch.set_num_threads(1)
    lines = ["# Cost of the capture's saved-tensor watch (s47)", "",
             f"CPU time per `tangent_gram` call, median of {ROUNDS} alternating rounds, one "
             f"thread, torch {torch.__version__}, load {os.getloadavg()[0]:.1f} at the start.",
             "", "| case | bare (s) | watched (s) | watched / bare |", "|---|---|---|---|"]
    real = _capture.SavedWatch
    for arch, n in (("cnn8", 64), ("resnet", 32), ("vit", 32)):
        module, params, X = _worker.gram_problem({"arch": arch, "n": n, "dtype": "float32"})
        call = functools.partial(tangent_gram, module, params, X)
        call()
        times = {"bare": [], "watched": []}
        for _ in range(ROUNDS):
            for name, cls in (("bare", _Bare), ("watched", real)):
                _capture.SavedWatch = cls
                try:
                    times[name].append(_cpu(call))
                finally:
                    _capture.SavedWatch = real
        b, w = (statistics.median(times[k]) for k in ("bare", "watched"))
        lines.append(f"| {arch}, N = {n} | {b:.3f} | {w:.3f} | {w / b:.3f} |")
        print(lines[-1], flush=True)
    lines += ["", f"load {os.getloadavg()[0]:.1f} at the end.", ""]
    (ROOT / "benchmarks" / "results" / "saved_watch_ab-s47.md").write_text("\n".join(lines))


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()
