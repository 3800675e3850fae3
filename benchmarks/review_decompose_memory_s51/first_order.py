# ruff: noqa
"""decompose(method="exact") of one plain-SGD step at lr 1e-5 against the first-order
formula -lr J(x_q) J(x_i)^T dL/df_i (dense autograd Jacobians), float64 MLP and CNN."""
import sys

import numpy as np
import torch
from torch.func import functional_call, jacrev

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from nets import make  # noqa: E402

for name in ["mlp", "cnn", "attn"]:
    lr = 1e-5
    rec, m, X, y = make(name, "sgd", torch.float64, steps=0)
    theta = {k: v.detach().clone() for k, v in m.named_parameters()}
    f0 = m(X).detach()
    n, C = f0.shape
    g = (f0 - y) / (n * C)  # dL/df for 0.5 * mean over samples and outputs
    J = jacrev(lambda p: functional_call(m, p, (X,)))(theta)
    Jf = torch.cat([J[k].reshape(n, C, -1) for k in theta], -1)  # (n, C, P)
    K = torch.einsum("qcp,idp->qicd", Jf, Jf)
    ref = -lr * torch.einsum("qicd,id->qic", K, g).numpy()
    # the recorded step at that lr (plain SGD, no momentum or decay)
    rec, m, X, y = make(name, "sgd1", torch.float64, steps=1, lr=lr)
    r = rec.as_estimator(X, y).decompose(X.numpy())
    rel = np.abs(r.contributions - ref).max() / np.abs(ref).max()
    print(name, "max|c - first order| / max|ref| = %.2e" % rel, "n", r.n_nodes.tolist())
