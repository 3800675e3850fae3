"""One-process A/B of the recurrent rules on packed sequences against the fallback and torch.func.

A packed sequence (``nn.utils.rnn.pack_padded_sequence``) reaches the fused recurrent call
as rows in length order without the samples' order; the rules declined it, and the
generic fallback, which ``vmap`` cannot run on it (the lengths leave the batch for the
CPU), differentiated it one sample and output at a time. The rules now run it as the
padded batch in the samples' order (``skpathkernel/_tangent/_recurrent.py``).

Three sides alternate in one process, each timed by ``time.thread_time`` on one torch
thread: ``fallback`` (the rule taken out of the registry, ``RULES``), ``rule`` (put back),
and the peer, what a user writes without the package: torch.func's ``vmap(jacrev(f))``
over the samples, or where ``vmap`` fails a per-sample loop of ``jacrev``, or where that
fails too (functorch cannot run torch's packed fused call: "Cannot access data pointer
of Tensor that doesn't have storage") the plain per-sample autograd loop; the Jacobian
flattened, ``J J^T`` (trace over the outputs / C, or every block for ``full``). Each case
is ``tangent_gram`` in float32 on a text classifier: Embedding(200, 32) with padding id 0,
the lengths (4 to 32, ties) read from the ids, packed with ``enforce_sorted=False``, a
1-layer LSTM or GRU of 64 hidden units, ``h_n`` into Linear(64, C), C = 2.

Usage: ``taskset -c 0 python -m benchmarks.bench_recurrent_packed_ab [RESULTS]`` (RESULTS
``recurrent_packed_ab``). Writes ``benchmarks/results/RESULTS.md`` and ``.json``.
"""

import functools
import json
import os
import statistics
import sys
import warnings
from pathlib import Path

import torch
from torch import nn
from torch.func import functional_call
from torch.nn.utils.rnn import pack_padded_sequence

from benchmarks._ab import ab_provenance
from benchmarks.bench_recurrent_ab import C, E, H, S, V, _peer, _vmaps, three_sides

ROOT = Path(__file__).resolve().parent.parent
REPS = int(os.environ.get("REPS", 3))


class _Packed(nn.Module):
    def __init__(self, cell):
        super().__init__()
        self.emb = nn.Embedding(V, E, padding_idx=0)
        self.rnn = cell(E, H, batch_first=True)
        self.out = nn.Linear(H, C)

    def forward(self, ids):
        lengths = (ids != 0).sum(1).clamp_min(1).cpu()
        seq = pack_padded_sequence(self.emb(ids), lengths, batch_first=True,
                                   enforce_sorted=False)
        state = self.rnn(seq)[1]
        return self.out((state[0] if isinstance(state, tuple) else state)[-1])


def _ids(n, gen):
    ids = torch.randint(1, V, (n, S), generator=gen)
    lengths = torch.randint(4, S + 1, (n,), generator=gen)
    ids[torch.arange(S) >= lengths.unsqueeze(1)] = 0
    return ids


def _loop(net, params, X, output):
    """``J J^T`` from the plain per-sample autograd loop (one ``autograd.grad`` per sample
    and output): what a user is left with where torch.func cannot run the packing."""
    ps = list(params.values())
    live = [p.detach().requires_grad_(True) for p in ps]
    rows = []
    for x in X:
        out = functional_call(net, dict(zip(params, live)), (x.unsqueeze(0),))[0]
        rows.append(torch.stack([torch.cat([g.reshape(-1) for g in torch.autograd.grad(
            out[c], live, retain_graph=c < C - 1)]) for c in range(C)]))
    J = torch.stack(rows)
    if output == "trace":
        return torch.einsum("ncp,mcp->nm", J, J) / C
    return torch.einsum("ncp,mdp->ncmd", J, J)


def _jacrevs(net, params, X) -> bool:
    try:
        _peer(net, params, X[:2], "trace", False)
    except RuntimeError:
        return False
    return True


def main():
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", "There is a performance drop", UserWarning)
    name = sys.argv[1] if len(sys.argv) > 1 else "recurrent_packed_ab"
    rows = []
    gen = torch.Generator().manual_seed(0)
    for cell in (nn.LSTM, nn.GRU):
        torch.manual_seed(0)
        net = _Packed(cell).eval()
        params = {k: v.detach() for k, v in net.named_parameters()}
        vmapped = _vmaps(net, params, _ids(2, gen))
        # torch.func's vmap, else its jacrev per sample, else the plain autograd loop.
        kind = ("vmap(jacrev)" if vmapped else "loop of jacrev (vmap fails)"
                if _jacrevs(net, params, _ids(2, gen))
                else "autograd loop (vmap and jacrev fail)")
        for n, output in ((128, "trace"), (256, "trace"), (256, "full")):
            X = _ids(n, gen)
            peer = (_loop if kind.startswith("autograd")
                    else functools.partial(_peer, vmapped=vmapped))
            times, out = three_sides(net, params, X, cell, output, peer, REPS)
            ref = out["torch.func"]
            med = {k: statistics.median(v) for k, v in times.items()}
            row = dict(case=f"{cell.__name__} packed, N={n}, {output}",
                       load=os.getloadavg()[0], times=times, median=med,
                       peer=kind,
                       diff={k: ((out[k].reshape(ref.shape) - ref).abs().max()
                                 / ref.abs().max()).item() for k in out})
            rows.append(row)
            print(row["case"], {k: round(v, 3) for k, v in med.items()}, row["diff"],
                  flush=True)
    prov = ab_provenance(ROOT, "bench_recurrent_packed_ab",
                         ["skpathkernel", "benchmarks/bench_recurrent_packed_ab.py"], "-", REPS)
    out_path = ROOT / "benchmarks" / "results" / name
    out_path.with_suffix(".json").write_text(json.dumps(dict(provenance=prov, rows=rows),
                                                        indent=1))
    lines = [f"# {name}: recurrent rules on packed sequences vs fallback vs torch.func", "",
             *(f"- {k}: {v}" for k, v in prov.items()), "",
             "CPU time (`time.thread_time`, one torch thread) per call, median of the "
             "repeats, the three sides alternating; ratios are torch.func / side and "
             "fallback / rule (above 1: the side, or the rule, is faster). max rel. diff: "
             "max |dK| / max |K| against torch.func's Gram.", "",
             "| case | peer | torch.func (s) | fallback (s) | rule (s) | fallback / rule | "
             "torch.func / rule | rule diff | fallback diff | load |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m = r["median"]
        lines.append(f"| {r['case']} | {r['peer']} | {m['torch.func']:.3f} | "
                     f"{m['fallback']:.3f} | {m['rule']:.3f} | "
                     f"{m['fallback'] / m['rule']:.2f} | {m['torch.func'] / m['rule']:.2f} "
                     f"| {r['diff']['rule']:.1e} | {r['diff']['fallback']:.1e} | "
                     f"{r['load']:.2f} |")
    out_path.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
