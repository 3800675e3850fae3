"""What the review s51 scripts share: a short SGD loop recorded by PathRecorder."""

import numpy as np
import torch

from skpathkernel import PathRecorder


def recorded(m, X, y, steps, bs, lr):
    """``steps`` SGD steps on cyclic batches of ``bs`` rows, recorded."""
    opt = torch.optim.SGD(m.parameters(), lr=lr)
    with PathRecorder(m, opt, n_samples=len(X)) as rec:
        for s in range(steps):
            idx = np.arange(s * bs, (s + 1) * bs) % len(X)
            opt.zero_grad()
            ((m(X[idx]) - y[idx]) ** 2).mean().backward()
            rec.set_batch(idx)
            opt.step()
    return rec
