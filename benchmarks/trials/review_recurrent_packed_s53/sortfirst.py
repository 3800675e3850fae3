import sys

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
sys.argv = ["x", "zzzz"]
from adv import CELLS, E, H, Hand, check, nn, pack_padded_sequence, padded, torch  # noqa: E402


class SortPack(nn.Module):
    """The pre-enforce_sorted idiom: sort the batch by length, pack sorted, unsort."""

    def __init__(self, cell="lstm", **kw):
        super().__init__()
        self.rnn = CELLS[cell](E, H, batch_first=True, **kw)
        self.out = nn.Linear(H, 2)

    def forward(self, x):
        lengths = x[:, :, -1].sum(1).long()
        ls, order = torch.sort(lengths, descending=True, stable=True)
        seq = pack_padded_sequence(x[order, :, :E], ls.cpu(), batch_first=True, enforce_sorted=True)
        out, st = self.rnn(seq)
        h = st[0] if isinstance(st, tuple) else st
        back = torch.empty_like(order)
        back[order] = torch.arange(len(order))
        return self.out(h[-1][back])


for lengths in ([2, 6, 1, 5, 5, 3, 1], [6, 5, 1, 3, 2, 6, 4], [6, 5, 4, 3, 2, 1, 1]):
    for cell in ("lstm", "gru"):
        torch.manual_seed(1)
        check(f"sortpack {cell} {lengths}", SortPack(cell), padded(lengths), want_rule=False)
        torch.manual_seed(1)
        check(
            f"hand-no-indices {cell} {lengths}", Hand(cell, False), padded(lengths), want_rule=False
        )
