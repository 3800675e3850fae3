import warnings

import numpy as np
import torch
from sklearn.base import clone
from torch import nn

from skpathkernel import PathRecorder, RecordedNetwork
from skpathkernel.rules import FallbackWarning

torch.set_num_threads(1)


class Scale(nn.Module):
    def __init__(self):
        super().__init__()
        self.s = nn.Parameter(torch.ones(8))

    def forward(self, x):
        return torch.sin(x) * self.s.exp()


torch.manual_seed(0)
module = nn.Sequential(nn.Linear(3, 8), Scale(), nn.Linear(8, 1))
X, y = torch.randn(16, 3), torch.randn(16)
opt = torch.optim.SGD(module.parameters(), lr=0.1)
with PathRecorder(module, opt, n_samples=16) as rec:
    for _ in range(3):
        rec.set_batch(np.arange(16))
        opt.zero_grad()
        (0.5 * (module(X)[:, 0] - y) ** 2).mean().backward()
        opt.step()


def show(tag, fn):
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        out = fn()
    fw = [x for x in w if issubclass(x.category, FallbackWarning)]
    print(
        tag,
        "n_fallback=",
        len(fw),
        [(x.filename.split("/")[-1], x.lineno) for x in fw],
        "others=",
        [x.category.__name__ for x in w if x not in fw],
    )
    return out


net = show("as_network", lambda: rec.as_network(X, y))
est = show("as_estimator", lambda: rec.as_estimator(X, y))
show("as_estimator no X", lambda: rec.as_estimator())
show("kernel on est", lambda: est.network_)
c = show("clone", lambda: clone(est))
show("clone.network_", lambda: c.network_)
show("set_params same", lambda: est.set_params(loss="squared_error").network_)
show("RecordedNetwork()", lambda: RecordedNetwork(module, rec.trajectory, X_train=X, y_train=y))
from sklearn.model_selection import cross_val_score  # noqa: E402

show("cross_val_score", lambda: cross_val_score(est, X.numpy(), y.numpy(), cv=2))
