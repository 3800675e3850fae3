"""CPU time of decompose at the default budget, for the A/B of the node limit:
``python ab.py`` prints ``mlp cnn`` CPU seconds (median of 3 calls after one warm-up)
for the skpathkernel on PYTHONPATH; alternate two checkouts' runs pinned to one core."""

# ruff: noqa: E402
import time
import warnings

import numpy as np
import torch
from torch import nn

torch.set_num_threads(1)
warnings.simplefilter("ignore")
from skpathkernel import PathKernelMachine, PathRecorder


def median_cpu(fn, k=3):
    fn()
    times = []
    for _ in range(k):
        t = time.process_time()
        fn()
        times.append(time.process_time() - t)
    return float(np.median(times))


rng = np.random.RandomState(0)
X = rng.uniform(-1, 1, size=(200, 8))
Y = np.c_[np.sin(3 * X[:, 0]) + X[:, 1], X[:, 0]]
mlp = PathKernelMachine(
    hidden_layer_sizes=(64,),
    solver="sgd",
    learning_rate_init=0.1,
    max_iter=3,
    batch_size=50,
    tol=None,
    activation="tanh",
    random_state=0,
).fit(X, Y)
Xq = X[:50]

torch.manual_seed(0)
cnn = nn.Sequential(
    nn.Conv2d(3, 8, 3, padding=1),
    nn.Tanh(),
    nn.Conv2d(8, 16, 3, stride=2, padding=1),
    nn.Tanh(),
    nn.Flatten(),
    nn.Linear(16 * 8 * 8, 3),
).double()
Xc = torch.randn(32, 3, 16, 16, dtype=torch.float64)
yc = torch.randn(32, 3, dtype=torch.float64)
opt = torch.optim.SGD(cnn.parameters(), lr=0.5)
with PathRecorder(cnn, opt, n_samples=32) as rec:
    for _ in range(3):
        opt.zero_grad()
        (0.5 * (cnn(Xc) - yc).pow(2).mean(1)).mean().backward()
        rec.set_batch(np.arange(32))
        opt.step()
net = rec.as_estimator(Xc, yc)
a = median_cpu(lambda: mlp.decompose(Xq))
b = median_cpu(lambda: net.decompose(Xc[:16]))
print(f"{a:.4f} {b:.4f} {list(mlp.decompose(Xq).n_nodes)} {list(net.decompose(Xc[:16]).n_nodes)}")
