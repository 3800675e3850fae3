"""One-process A/B of nn.Embedding's rule: one-hot factors (ref) vs index factors (tree).

The ref's rule built a one-hot factor ``(n, S, vocab)`` (``F.one_hot(ids, vocab)``), so its
Gram cost scaled with ``n S vocab``; the tree's rule hands the engine the ids (an index
term, ``Term.rows``), contracted by index equality or scattered into the table's rows.
The ref's ``_layers.py`` (``git show REF:...``) is loaded beside the tree's and its
embedding rule swapped in and out of the registry (the rest of the engine is the tree's,
which contracts a one-hot term as the ref did), the two sides alternating. Each case is
``tangent_gram`` (the trace Gram, ``K(X, X)``) of ``n = 64`` sequences of ``S = 16`` token
ids, timed by ``time.thread_time`` on one torch thread, on an embedding + mean + MLP
network and on a small token transformer (one encoder layer), vocabularies 100, 1,000
and 30,000, and the preconditioned Gram ``J D J^T`` (a positive ``D`` as Adam's). A dense
reference (``tangent_features`` then one GEMM) is timed once per case. Last, the path
kernel ``PathKernel(clf)(X)`` of a classifier trained by SGD and by Adam (vocab 30,000).

Usage: ``THREADS=1 python -m benchmarks.bench_embedding_ab [REF] [RESULTS]``
(REF ``main``; RESULTS ``embedding_ab``). Writes ``benchmarks/results/RESULTS.md`` and
``.json``.
"""

import os
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch
from torch import nn

from benchmarks._ab import ab_provenance, ab_row, reference_module, write_ab
from skpathkernel import PathKernelClassifier
from skpathkernel._tangent import RULES, tangent_features, tangent_gram
from skpathkernel.kernels import PathKernel

ROOT = Path(__file__).resolve().parent.parent
REPS = 5
N, S, D, C = 64, 16, 32, 10


class _MeanNet(nn.Module):
    def __init__(self, vocab, n_out=C):
        super().__init__()
        self.emb = nn.Embedding(vocab, D)
        self.hidden = nn.Linear(D, 64)
        self.out = nn.Linear(64, n_out)

    def forward(self, x):
        return self.out(torch.tanh(self.hidden(self.emb(x).mean(1))))


class _TokenNet(nn.Module):
    def __init__(self, vocab):
        super().__init__()
        self.emb = nn.Embedding(vocab, D)
        self.enc = nn.TransformerEncoderLayer(D, 2, 2 * D, dropout=0.0, batch_first=True)
        self.out = nn.Linear(D, C)

    def forward(self, x):
        return self.out(self.enc(self.emb(x)).mean(1))


def _cases():
    for vocab in (100, 1000, 30000):
        for name, cls in (("embedding+mean+MLP", _MeanNet), ("token transformer", _TokenNet)):
            torch.manual_seed(0)
            yield (f"{name}, vocab {vocab}, n={N}, S={S}, C={C}", cls(vocab).eval(),
                   torch.randint(0, vocab, (N, S)), False)
    for vocab in (1000, 30000):
        torch.manual_seed(0)
        yield (f"embedding+mean+MLP, vocab {vocab}, n={N}, S={S}, C={C}, diag_weight (Adam)",
               _MeanNet(vocab).eval(), torch.randint(0, vocab, (N, S)), True)


def _path_kernel_rows(sides):
    """``PathKernel(clf)(X)`` of a token classifier (vocab 30,000, 4 recorded steps; its
    step Grams go through the same engine, preconditioned for Adam)."""
    rng = np.random.default_rng(0)
    X, y = rng.integers(0, 30000, (N, S)), rng.integers(0, 2, N)
    rows = []
    for solver in ("sgd", "adam"):
        clf = PathKernelClassifier(module=lambda n_in, n_out: _MeanNet(30000, n_out), solver=solver,
                                   max_iter=2, batch_size=32, random_state=0).fit(X, y)
        times, grams = {"ref": [], "tree": []}, {}
        for _ in range(REPS):
            for side, rule in sides.items():
                RULES[nn.Embedding] = rule
                start = time.thread_time()
                grams[side] = PathKernel(clf)(X)
                times[side].append(time.thread_time() - start)
        RULES[nn.Embedding] = sides["tree"]
        diff = float(np.abs(grams["ref"] - grams["tree"]).max() / np.abs(grams["ref"]).max())
        case = f"PathKernel(clf)(X), {solver}, vocab 30000, n={N}, S={S}, 4 steps"
        rows.append(ab_row(case, times, os.getloadavg()[0], max_rel_diff=diff))
        print(case, f"{rows[-1]['ref_least']:.3f} {rows[-1]['tree_least']:.3f} "
              f"{rows[-1]['ratio_least']:.2f}", flush=True)
    return rows


def main(ref="main", results="embedding_ab"):
    torch.set_num_threads(int(os.environ.get("THREADS", "1")))
    warnings.simplefilter("ignore")
    saved = dict(RULES)
    old = reference_module(ROOT, ref, "skpathkernel/_tangent/_layers.py").EMBEDDING
    RULES.clear()
    RULES.update(saved)  # importing the ref's module re-registered its rules
    sides = {"ref": old, "tree": saved[nn.Embedding]}
    rows = []
    for case, net, X, weighted in _cases():
        params = {k: v.detach() for k, v in net.named_parameters()}
        n_params = sum(p.numel() for p in params.values())
        gen = torch.Generator().manual_seed(0)
        D = torch.rand(n_params, generator=gen) + 0.1 if weighted else None
        times, grams = {"ref": [], "tree": []}, {}
        for _ in range(REPS):
            for side, rule in sides.items():
                RULES[nn.Embedding] = rule
                start = time.thread_time()
                grams[side] = tangent_gram(net, params, X, diag_weight=D)
                times[side].append(time.thread_time() - start)
        RULES[nn.Embedding] = sides["tree"]
        start = time.thread_time()
        phi = tangent_features(net, params, X)
        dense = (phi if D is None else phi * D.repeat(C)) @ phi.T
        dense_time = time.thread_time() - start
        diff = ((grams["ref"] - grams["tree"]).abs().max() / grams["ref"].abs().max()).item()
        diff_dense = ((dense - grams["tree"]).abs().max() / dense.abs().max()).item()
        rows.append(ab_row(case, times, os.getloadavg()[0], max_rel_diff=diff,
                           dense=f"{dense_time:.3f}", dense_diff=f"{diff_dense:.1e}"))
        print(case, f"{rows[-1]['ref_least']:.3f} {rows[-1]['tree_least']:.3f} "
              f"{rows[-1]['ratio_least']:.2f} dense {dense_time:.3f}", flush=True)
    rows.extend(_path_kernel_rows(sides))
    prov = ab_provenance(ROOT, "bench_embedding_ab",
                         ["skpathkernel/_tangent", "benchmarks/bench_embedding_ab.py"], ref,
                         REPS, float32=True)
    write_ab(ROOT / "benchmarks" / "results" / results,
             "nn.Embedding's rule: one-hot factors (ref) vs index factors (tree)",
             "time.thread_time", prov, rows, 3,
             columns=(("dense features + GEMM (s)", "dense"),
                      ("dense vs tree rel. diff", "dense_diff")))


if __name__ == "__main__":
    main(*sys.argv[1:])
