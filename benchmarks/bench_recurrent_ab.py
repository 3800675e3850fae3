"""One-process A/B of the recurrent rules (nn.LSTM, nn.GRU) against the fallback and torch.func.

nn.LSTM and nn.GRU had no rule: their weights went to the generic fallback, whose
``vmap(jacrev)`` cannot batch torch's fused recurrent call (``aten::mkldnn_rnn_layer``:
functorch loops over the samples) and, for nn.GRU, cannot run it at all (a batched
hidden state broadcast into an unbatched one), so the fallback differentiated a GRU one
sample and output at a time. The rules (``skpathkernel/_tangent/_recurrent.py``) run the
recurrence over the whole batch and contract the weights' gradients as sums over time.

Three sides alternate in one process, each timed by ``time.thread_time`` on one torch
thread: ``fallback`` (the rule taken out of the registry, ``RULES``), ``rule`` (put back),
and ``torch.func``, what a user writes without the package: ``vmap(jacrev(f))`` over the
samples, the Jacobian flattened, ``J J^T`` (trace over the outputs / C, or every block for
``full``). Where ``vmap`` fails (nn.GRU) the peer is a per-sample loop of ``jacrev``.
Each case is ``tangent_gram`` (what ``TangentKernel`` computes) in float32 on a text
classifier: Embedding(200, 32), a 1-layer batch-first LSTM or GRU of 64 hidden units
over S = 32 tokens, its last hidden state into Linear(64, C), C = 2.

Usage: ``taskset -c 0 python -m benchmarks.bench_recurrent_ab [RESULTS]`` (RESULTS
``recurrent_ab``). Writes ``benchmarks/results/RESULTS.md`` and ``.json``.
"""

import functools
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import nn
from torch.func import functional_call, jacrev, vmap

from benchmarks._ab import ab_provenance
from skpathkernel._tangent import RULES, layer_routes, tangent_gram

ROOT = Path(__file__).resolve().parent.parent
REPS = int(os.environ.get("REPS", 5))
V, E, H, S, C = 200, 32, 64, 32, 2


class _Classifier(nn.Module):
    def __init__(self, cell):
        super().__init__()
        self.emb = nn.Embedding(V, E)
        self.rnn = cell(E, H, batch_first=True)
        self.out = nn.Linear(H, C)

    def forward(self, x):
        return self.out(self.rnn(self.emb(x))[0][:, -1])


def _peer(net, params, X, output, vmapped):
    """``J J^T`` from torch.func's per-sample Jacobian (a loop of ``jacrev`` where
    ``vmap`` fails)."""
    def f(p, x):
        return functional_call(net, p, (x.unsqueeze(0),))[0]

    if vmapped:
        jac = vmap(jacrev(f), in_dims=(None, 0))(params, X)
        J = torch.cat([j.reshape(X.shape[0], C, -1) for j in jac.values()], dim=2)
    else:
        J = torch.stack([torch.cat([j.reshape(C, -1) for j in jacrev(f)(params, x).values()],
                                   dim=1) for x in X])
    if output == "trace":
        return torch.einsum("ncp,mcp->nm", J, J) / C
    return torch.einsum("ncp,mdp->ncmd", J, J)


def _vmaps(net, params, X) -> bool:
    try:
        _peer(net, params, X[:2], "trace", True)
    except RuntimeError:
        return False
    return True


def three_sides(net, params, X, cell, output, peer, reps):
    """Each side's CPU times and last Gram: the fallback (``cell``'s rule out of the
    registry), the rule, and torch.func (``peer(net, params, X, output)``), alternating
    ``reps`` times."""
    rule = RULES[cell]
    times = {k: [] for k in ("fallback", "rule", "torch.func")}
    out = {}
    try:
        for _ in range(reps):
            for side in times:
                if side == "fallback":
                    RULES.pop(cell)
                else:
                    RULES[cell] = rule
                if side != "torch.func":
                    route = {r.route for r in layer_routes(net, X[:4])
                             if r.type == cell.__name__}
                    assert route == {"fallback" if side == "fallback" else "rule"}
                start = time.thread_time()
                out[side] = (peer(net, params, X, output) if side == "torch.func"
                             else tangent_gram(net, params, X, output=output))
                times[side].append(time.thread_time() - start)
    finally:
        RULES[cell] = rule
    return times, out


def main():
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", "There is a performance drop", UserWarning)
    name = sys.argv[1] if len(sys.argv) > 1 else "recurrent_ab"
    rows = []
    for cell in (nn.LSTM, nn.GRU):
        torch.manual_seed(0)
        net = _Classifier(cell).eval()
        params = {k: v.detach() for k, v in net.named_parameters()}
        vmapped = _vmaps(net, params, torch.randint(0, V, (2, S)))
        for n, output in ((256, "trace"), (256, "full"), (1024, "trace")):
            X = torch.randint(0, V, (n, S))
            times, out = three_sides(net, params, X, cell, output,
                                     functools.partial(_peer, vmapped=vmapped), REPS)
            ref = out["torch.func"]
            med = {k: statistics.median(v) for k, v in times.items()}
            row = dict(case=f"{cell.__name__}, N={n}, {output}", load=os.getloadavg()[0],
                       times=times, median=med, peer="vmap(jacrev)" if vmapped else
                       "loop of jacrev (vmap fails)",
                       diff={k: ((out[k].reshape(ref.shape) - ref).abs().max()
                                 / ref.abs().max()).item() for k in out})
            rows.append(row)
            print(row["case"], {k: round(v, 3) for k, v in med.items()}, flush=True)
    prov = ab_provenance(ROOT, "bench_recurrent_ab",
                         ["skpathkernel", "benchmarks/bench_recurrent_ab.py"], "-", REPS)
    out_path = ROOT / "benchmarks" / "results" / name
    out_path.with_suffix(".json").write_text(json.dumps(dict(provenance=prov, rows=rows),
                                                        indent=1))
    lines = [f"# {name}: recurrent rules vs fallback vs torch.func", "",
             *(f"- {k}: {v}" for k, v in prov.items()), "",
             "CPU time (`time.thread_time`, one torch thread) per call, median of the "
             "repeats, the three sides alternating; ratios are torch.func / side (above 1: "
             "the side is faster than torch.func). max rel. diff against torch.func's "
             "Gram.", "",
             "| case | peer | torch.func (s) | fallback (s) | rule (s) | fallback ratio | "
             "rule ratio | rule diff | load |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m = r["median"]
        lines.append(f"| {r['case']} | {r['peer']} | {m['torch.func']:.3f} | "
                     f"{m['fallback']:.3f} | {m['rule']:.3f} | "
                     f"{m['torch.func'] / m['fallback']:.2f} | {m['torch.func'] / m['rule']:.2f} "
                     f"| {r['diff']['rule']:.1e} | {r['load']:.2f} |")
    out_path.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
