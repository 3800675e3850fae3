import sys
import warnings

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parents[3] / "tests"))
import torch
from _reference import jacobian_loop
from torch import nn
from torch.nn.utils.rnn import PackedSequence, pack_padded_sequence, pad_packed_sequence

from skpathkernel._tangent import tangent_gram
from skpathkernel.rules import check_rule, layer_routes

torch.set_num_threads(1)
E, H, S = 3, 4, 6
CELLS = {
    "lstm": nn.LSTM,
    "gru": nn.GRU,
    "rnn_tanh": nn.RNN,
    "rnn_relu": lambda *a, **k: nn.RNN(*a, nonlinearity="relu", **k),
}


def padded(lengths, seed=0, dtype=torch.float64, T=S):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(len(lengths), T, E + 1, generator=g, dtype=torch.float64)
    valid = (torch.arange(T) < torch.tensor(lengths).unsqueeze(1)).double()
    x[:, :, :E] *= valid.unsqueeze(-1)
    x[:, :, -1] = valid
    return x.to(dtype)


class M(nn.Module):
    def __init__(
        self,
        cell="lstm",
        variant="plain",
        enforce_sorted=False,
        batch_first=True,
        state=False,
        **kw,
    ):
        super().__init__()
        self.cell, self.variant, self.es, self.bf, self.state = (
            cell,
            variant,
            enforce_sorted,
            batch_first,
            state,
        )
        self.rnn = CELLS[cell](E, H, batch_first=batch_first, **kw)
        self.nd = 2 if self.rnn.bidirectional else 1
        self.L = self.rnn.num_layers * self.nd
        width = H * self.nd
        if variant == "repack":
            self.rnn2 = CELLS[cell](width, H, batch_first=batch_first)
        if variant == "embed":
            self.emb = nn.Linear(E, E)
        self.init = nn.Linear(E, self.L * H) if state else None
        self.out = nn.Linear(width * S + self.L * H, 2)
        self.out2 = nn.Linear(H + self.L * H, 2)

    def hx(self, x):
        if self.init is None:
            return None
        # h0 from each sample's own features, in the samples' order
        h0 = (
            torch.tanh(self.init(x[:, 0, :E] + x[:, 1, :E] * 3))
            .unflatten(1, (self.L, H))
            .transpose(0, 1)
            .contiguous()
        )
        return (h0, torch.sin(2 * h0)) if self.cell == "lstm" else h0

    def forward(self, x):
        lengths = x[:, :, -1].sum(1).long().cpu()
        feats = x[:, :, :E]
        if self.variant == "embed":
            feats = torch.tanh(self.emb(feats))
        inp = feats if self.bf else feats.transpose(0, 1)
        seq = pack_padded_sequence(inp, lengths, batch_first=self.bf, enforce_sorted=self.es)
        out, st = self.rnn(seq, self.hx(x)) if self.init is not None else self.rnn(seq)
        h = st[0] if isinstance(st, tuple) else st
        # h_n read per sample, in sample order
        hflat = h.transpose(0, 1).flatten(1)
        if self.variant == "hn_only":
            return self.out2(torch.cat([hflat, hflat[:, :H]], 1))
        pad, _ = pad_packed_sequence(out, batch_first=self.bf, total_length=S, padding_value=0.7)
        pad = pad if self.bf else pad.transpose(0, 1)
        if self.variant == "repack":
            seq2 = pack_padded_sequence(
                pad if self.bf else pad.transpose(0, 1),
                lengths,
                batch_first=self.bf,
                enforce_sorted=False,
            )
            o2, s2 = self.rnn2(seq2)
            h2 = s2[0] if isinstance(s2, tuple) else s2
            return self.out2(torch.cat([h2[-1], hflat], 1))
        if self.variant == "twice":
            # same layer, second packed input: time-reversed within length, other lengths
            l2 = torch.clamp(lengths - 1, min=1)
            seq2 = pack_padded_sequence(inp * 2 - 1, l2, batch_first=self.bf, enforce_sorted=False)
            o2, s2 = self.rnn(seq2)
            h2 = s2[0] if isinstance(s2, tuple) else s2
            return self.out(torch.cat([pad.flatten(1), h2.transpose(0, 1).flatten(1) * hflat], 1))
        # padded positions read (padding value 0.7): zero gradient there
        return self.out(torch.cat([pad.flatten(1), hflat], 1))


class Hand(nn.Module):
    """PackedSequence built by hand (batch_sizes), samples sorted by the model."""

    def __init__(self, cell="lstm", give_indices=True, **kw):
        super().__init__()
        self.rnn = CELLS[cell](E, H, **kw)
        self.gi = give_indices
        self.out = nn.Linear(H, 2)

    def forward(self, x):
        lengths = x[:, :, -1].sum(1).long()
        order = torch.sort(lengths, descending=True, stable=True).indices
        xs, ls = x[order, :, :E], lengths[order]
        T = int(ls[0])
        batch_sizes = torch.tensor([int((ls > t).sum()) for t in range(T)])
        data = torch.cat([xs[:b, t] for t, b in enumerate(batch_sizes.tolist())])
        if self.gi:
            unsorted = torch.empty_like(order)
            unsorted[order] = torch.arange(len(order))
            seq = PackedSequence(data, batch_sizes, order, unsorted)
            out, st = self.rnn(seq)
            h = st[0] if isinstance(st, tuple) else st
            return self.out(h[-1])  # torch unsorts h_n
        seq = PackedSequence(data, batch_sizes)
        out, st = self.rnn(seq)
        h = st[0] if isinstance(st, tuple) else st
        back = torch.empty_like(order)
        back[order] = torch.arange(len(order))
        return self.out(h[-1][back])


def check(name, net, X, dtype=torch.float64, rtol=1e-10, want_rule=True):
    net = net.to(dtype).eval()
    params = {k: v.detach() for k, v in net.named_parameters()}
    Xd = X.to(dtype)
    import copy

    n64 = copy.deepcopy(net).double()
    J = jacobian_loop(n64, X.double())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        routes = {r.name: (r.route, r.reason) for r in layer_routes(net, Xd)}
        G = tangent_gram(net, params, Xd, output="full").double()
    R = torch.einsum("ncp,mdp->ncmd", J, J)
    err = float((G - R).abs().max() / R.abs().max())
    rnn_routes = {k: v for k, v in routes.items() if k.startswith("rnn")}
    ok = err <= rtol and (not want_rule or all(v[0] == "rule" for v in rnn_routes.values()))
    cr = None
    if dtype == torch.float64:
        try:
            cr = check_rule(net, Xd, rtol=1e-10)
        except Exception as e:
            cr = repr(e)[:100]
    print(
        ("OK  " if ok else "BAD ") + f"{name}: err={err:.1e} routes={rnn_routes} check_rule={cr}",
        flush=True,
    )
    return ok


torch.manual_seed(0)
L7 = [2, 6, 1, 5, 5, 3, 1]
cases = []
for cell in CELLS:
    for bf in (True, False):
        cases.append((f"{cell} bf={bf} unsorted", lambda c=cell, b=bf: M(c, batch_first=b), L7))
cases += [
    ("lstm all equal", lambda: M("lstm"), [6, 6, 6, 6]),
    ("lstm all equal short", lambda: M("lstm"), [3, 3, 3]),
    ("gru len1 first", lambda: M("gru"), [1, 4, 6, 2]),
    ("gru len1 last", lambda: M("gru"), [4, 6, 2, 1]),
    ("lstm len1 middle", lambda: M("lstm", bidirectional=True), [4, 1, 6, 2]),
    ("lstm all len1", lambda: M("lstm", bidirectional=True, num_layers=2), [1, 1, 1]),
    ("lstm batch of 1", lambda: M("lstm", bidirectional=True, num_layers=2, state=True), [4]),
    ("lstm batch of 1 len1", lambda: M("lstm", bidirectional=True, num_layers=2), [1]),
    (
        "gru bi 2l bf=False h0",
        lambda: M("gru", batch_first=False, bidirectional=True, num_layers=2, state=True),
        L7,
    ),
    ("rnn_relu bi 2l h0", lambda: M("rnn_relu", bidirectional=True, num_layers=2, state=True), L7),
    (
        "lstm bi 2l h0 bf=False",
        lambda: M("lstm", batch_first=False, bidirectional=True, num_layers=2, state=True),
        L7,
    ),
    (
        "lstm h0 sorted",
        lambda: M("lstm", enforce_sorted=True, state=True, bidirectional=True),
        [6, 5, 5, 3, 1],
    ),
    (
        "lstm hn only h0",
        lambda: M("lstm", variant="hn_only", state=True, num_layers=2, bidirectional=True),
        L7,
    ),
    ("gru hn only", lambda: M("gru", variant="hn_only", bidirectional=True), L7),
    ("lstm repack", lambda: M("lstm", variant="repack", bidirectional=True), L7),
    (
        "gru repack bf=False",
        lambda: M("gru", variant="repack", batch_first=False, num_layers=2),
        L7,
    ),
    ("lstm twice", lambda: M("lstm", variant="twice", bidirectional=True, state=False), L7),
    ("rnn_tanh twice 2l", lambda: M("rnn_tanh", variant="twice", num_layers=2), L7),
    (
        "lstm embed (data requires grad)",
        lambda: M("lstm", variant="embed", bidirectional=True, num_layers=2),
        L7,
    ),
    (
        "lstm no bias",
        lambda: M("lstm", bias=False, bidirectional=True, num_layers=2, state=True),
        L7,
    ),
    ("hand lstm indices", lambda: Hand("lstm", True, bidirectional=True), L7),
    ("hand gru no indices", lambda: Hand("gru", False, num_layers=2), L7),
]
bad = 0
only = sys.argv[1] if len(sys.argv) > 1 else None
for name, mk, lengths in cases:
    if only and only not in name:
        continue
    torch.manual_seed(1)
    bad += not check(name, mk(), padded(lengths))
# float32
for name, mk, lengths in [
    ("lstm f32 bi 2l h0", lambda: M("lstm", bidirectional=True, num_layers=2, state=True), L7),
    ("gru f32 repack", lambda: M("gru", variant="repack"), L7),
]:
    if only and only not in name:
        continue
    torch.manual_seed(1)
    bad += not check(name, mk(), padded(lengths), dtype=torch.float32, rtol=1e-4)
print("BAD:", bad)
