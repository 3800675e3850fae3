"""One-process A/B of parameters used at several sites: the fallback (ref) vs summed uses.

A weight tied between two rule layers (a language model's ``head.weight = tok.weight``)
and a layer called twice per forward pass (an ALBERT-style shared encoder layer) went
whole to the ``torch.func`` fallback; the capture now takes each call as a use and sums
their terms per parameter (``skpathkernel/_tangent/_capture.py``). The ref side is that
module as it is at git ``REF`` (default ``HEAD``), imported beside the tree's and swapped
into ``_gram`` (its ``capture`` and ``_numerical_misfits``); the two sides alternate in
one process. Each case is ``tangent_gram`` on ``N`` token sequences, timed by
``time.thread_time`` on one torch thread.

Cases: the benchmarks' transformer (``_nets``: 16 tokens of a 16-word vocabulary,
d = 64, two post-norm nn.TransformerEncoderLayer of 4 heads and feed-forward 128, ReLU,
mean pooling) with its head a Linear to the vocabulary tied to the token embedding (16
outputs: the trace Gram, and one output); its one output at a vocabulary of 2,000 (the
tied table's per-sample gradients are formed, as the fallback formed them); the same with
one encoder layer applied twice and an untied Linear 1 head.

Usage: ``OMP_NUM_THREADS=1 python -m benchmarks.bench_tied_ab [RESULTS [N [REF]]]``
(RESULTS ``tied_ab``, N 256). Writes ``benchmarks/results/RESULTS.md`` and ``.json``.
"""

import os
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import nn

from benchmarks import _nets
from benchmarks._ab import ab_provenance, ab_row, reference_module, write_ab
from skpathkernel._tangent import _gram, tangent_gram
from skpathkernel.rules import layer_routes

ROOT = Path(__file__).resolve().parent.parent
MODULE = "skpathkernel/_tangent/_capture.py"
REPS = 5


class _Tied(nn.Module):
    """``_nets.Tokens`` whose head maps to the vocabulary through the token embedding's
    weight; or, ``shared``, one encoder layer applied ``layers`` times and a Linear 1 head."""

    def __init__(self, vocab, S, d, heads, ff, layers, shared=False):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(S, d)
        make = lambda: nn.TransformerEncoderLayer(d, heads, dim_feedforward=ff,  # noqa: E731
                                                   dropout=0.0, batch_first=True)
        one = make()
        self.layers = nn.ModuleList([one] * layers if shared else
                                    [make() for _ in range(layers)])
        self.head = nn.Linear(d, 1 if shared else vocab)
        if not shared:
            self.head.weight = self.tok.weight

    def forward(self, ids):
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        h = self.tok(ids) + self.pos(positions)
        for layer in self.layers:
            h = layer(h)
        return self.head(h.mean(1))


def _cases(n):
    a = _nets.ARCHS["transformer"]
    torch.manual_seed(0)
    ids = _nets.inputs("transformer", n)
    dims = (a["vocab"], a["shape"][0], a["d"], a["heads"], a["ff"], a["layers"])
    tied = _Tied(*dims).eval()
    shared = _Tied(*dims, shared=True).eval()
    # A larger vocabulary: the table the tied weight's summed term forms per sample.
    big = _Tied(2000, *dims[1:]).eval()
    big_ids = torch.randint(0, 2000, ids.shape)
    return {f"transformer, tied embedding/head, N={n}, C=16, trace": (tied, ids, "trace"),
            f"transformer, tied embedding/head, N={n}, one output": (tied, ids, 0),
            f"transformer, tied, vocabulary 2000, N={n}, one output": (big, big_ids, 0),
            f"transformer, one layer applied twice, N={n}, C=1": (shared, ids, "trace")}


def main(results="tied_ab", n=256, ref="HEAD"):
    torch.set_num_threads(int(os.environ.get("THREADS", "1")))
    warnings.simplefilter("ignore")
    old = reference_module(ROOT, ref, MODULE)
    new = (_gram.capture, _gram._numerical_misfits)
    rows = []
    for case, (net, X, output) in _cases(int(n)).items():
        params = {k: v.detach() for k, v in net.named_parameters()}
        routes = {r.route for r in layer_routes(net, X)}
        assert routes == {"rule"}, routes
        times, grams = {"ref": [], "tree": []}, {}
        for _ in range(REPS):
            for side in ("ref", "tree"):
                _gram.capture, _gram._numerical_misfits = (
                    (old.capture, old._numerical_misfits) if side == "ref" else new)
                try:
                    start = time.thread_time()
                    grams[side] = tangent_gram(net, params, X, output=output)
                    times[side].append(time.thread_time() - start)
                finally:
                    _gram.capture, _gram._numerical_misfits = new
        diff = ((grams["ref"] - grams["tree"]).abs().max() / grams["ref"].abs().max()).item()
        rows.append(ab_row(case, times, os.getloadavg()[0], max_rel_diff=diff))
        print(case, f"{rows[-1]['ratio_least']:.3f}", f"{diff:.1e}", flush=True)
    prov = ab_provenance(ROOT, "bench_tied_ab", [MODULE, "benchmarks/bench_tied_ab.py"],
                         f"{MODULE} at {ref} (tied and repeated layers on the fallback)", REPS)
    out = ROOT / "benchmarks" / "results" / results
    write_ab(out, "Parameters used at several sites: fallback (ref) vs summed uses (tree)",
             "time.thread_time", prov, rows, 3, machine=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
