import sys

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
sys.argv = ["x", "zzzz"]
from adv import E, H, check, nn, pack_padded_sequence, padded, torch  # noqa: E402


class SortLin(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(E + 1, 4)
        self.b = nn.Linear(4, 2)

    def forward(self, x):
        x = x[:, 0]
        order = torch.sort(x[:, -1], descending=True, stable=True).indices
        back = torch.empty_like(order)
        back[order] = torch.arange(len(order))
        return self.b(torch.tanh(self.a(x[order])[back]))


class SortPack2(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.LSTM(E, H, batch_first=True)
        self.out = nn.Linear(H, 2)

    def forward(self, x):
        lengths = x[:, :, -1].sum(1).long()
        ls, order = torch.sort(lengths, descending=True, stable=True)
        seq = pack_padded_sequence(
            x[order, :, :E], ls.cpu(), batch_first=True, enforce_sorted=False
        )
        h = self.rnn(seq)[1][0]
        back = torch.empty_like(order)
        back[order] = torch.arange(len(order))
        return self.out(h[-1][back])


X = padded([6, 5, 1, 3, 2, 6, 4])
X[:, 0, -1] = torch.tensor([6.0, 5, 1, 3, 2, 6, 4])
torch.manual_seed(1)
check("linear sort", SortLin(), X, want_rule=False)
torch.manual_seed(1)
check("sortpack enforce_sorted=False", SortPack2(), padded([6, 5, 1, 3, 2, 6, 4]), want_rule=False)
