"""One-process A/B of nn.RMSNorm's rule: the generic fallback (ref) vs the rule (tree).

``nn.RMSNorm`` had no rule: its weight went to the exact but slower ``torch.func``
fallback. The rule is taken out of the registry (``RULES``) for the ref side and put back
for the tree side, the two alternating in one process; each case is ``tangent_gram`` (the
trace Gram) timed by ``time.thread_time`` on one torch thread (the CPU time
of the calling thread: a shared machine's load does not count).

Cases: the benchmarks' transformer (``_nets``: 16 tokens of a 16-word vocabulary, d = 64,
two layers of 4 heads and feed-forward 128, ReLU, mean pooling) with its LayerNorms
swapped for RMSNorms, post-norm as ``nn.TransformerEncoderLayer`` computes it (torch's own
layer cannot hold an RMSNorm in eval mode: its fast path reads ``norm1.bias``); the same
pre-norm (Llama-style, a final RMSNorm), with one output or ten; a Linear-RMSNorm-Linear
network on vectors.

Usage: ``OMP_NUM_THREADS=1 python -m benchmarks.bench_rms_norm_ab [RESULTS]`` (RESULTS
``rms_norm_ab``). Writes ``benchmarks/results/RESULTS.md`` and ``.json``.
"""

import os
import sys
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from benchmarks import _nets
from benchmarks._ab import ab_provenance, rules_ab, write_ab

ROOT = Path(__file__).resolve().parent.parent
REPS = 7


class _Layer(nn.Module):
    """nn.TransformerEncoderLayer's computation (batch first, dropout 0, ReLU), with
    RMSNorms: post-norm, or pre-norm."""

    def __init__(self, d, heads, ff, norm_first):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(d, heads, batch_first=True)
        self.linear1, self.linear2 = nn.Linear(d, ff), nn.Linear(ff, d)
        self.norm1, self.norm2 = nn.RMSNorm(d, eps=1e-5), nn.RMSNorm(d, eps=1e-5)
        self.norm_first = norm_first

    def _sa(self, x):
        return self.self_attn(x, x, x, need_weights=False)[0]

    def _ff(self, x):
        return self.linear2(F.relu(self.linear1(x)))

    def forward(self, x):
        if self.norm_first:
            x = x + self._sa(self.norm1(x))
            return x + self._ff(self.norm2(x))
        x = self.norm1(x + self._sa(x))
        return self.norm2(x + self._ff(x))


class _Tokens(nn.Module):
    """``_nets.Tokens`` with ``_Layer`` blocks (and a final RMSNorm when pre-norm)."""

    def __init__(self, vocab, S, d, heads, ff, layers, n_out, norm_first):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(S, d)
        self.layers = nn.Sequential(*(_Layer(d, heads, ff, norm_first) for _ in range(layers)))
        self.norm = nn.RMSNorm(d) if norm_first else nn.Identity()
        self.head = nn.Linear(d, n_out)

    def forward(self, ids):
        positions = torch.arange(ids.shape[1], device=ids.device).expand_as(ids)
        return self.head(self.norm(self.layers(self.tok(ids) + self.pos(positions))).mean(1))


def _cases(n):
    a = _nets.ARCHS["transformer"]
    torch.manual_seed(0)
    ids = _nets.inputs("transformer", n)
    cases = {}
    for norm_first, label in ((False, "post-norm"), (True, "pre-norm")):
        net = _Tokens(a["vocab"], a["shape"][0], a["d"], a["heads"], a["ff"], a["layers"],
                      a["outputs"], norm_first).eval()
        cases[f"transformer, RMSNorm {label}, N={n}, C=1"] = (net, ids)
    net = _Tokens(a["vocab"], a["shape"][0], a["d"], a["heads"], a["ff"], a["layers"], 10,
                  True).eval()
    cases[f"transformer, RMSNorm pre-norm, N={n}, C=10"] = (net, ids)
    net = nn.Sequential(nn.Linear(64, 256), nn.RMSNorm(256), nn.Tanh(), nn.Linear(256, 1))
    cases["Linear-RMSNorm-Linear, N=1024, C=1"] = (net, torch.randn(1024, 64))
    return cases


def main(results="rms_norm_ab", n=256):
    torch.set_num_threads(int(os.environ.get("THREADS", "1")))
    warnings.simplefilter("ignore")
    rows = rules_ab(_cases(int(n)), (nn.RMSNorm,), REPS)
    prov = ab_provenance(ROOT, "bench_rms_norm_ab",
                         ["skpathkernel/_tangent/_layers.py", "benchmarks/bench_rms_norm_ab.py"],
                         "the tree without nn.RMSNorm's rule (RULES entry removed)", REPS)
    out = ROOT / "benchmarks" / "results" / results
    write_ab(out, "nn.RMSNorm: generic fallback (ref) vs its rule (tree)", "time.thread_time",
             prov, rows, 3, machine=True)


if __name__ == "__main__":
    main(*sys.argv[1:])
