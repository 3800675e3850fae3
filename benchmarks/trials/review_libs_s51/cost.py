"""Review s51 (6cb6334): as_network CPU time with and without the random-draw probe,
alternated in one process, medians of 5, on a 36M-parameter MLP and a small CNN."""

import statistics
import time

import torch
from _common import recorded
from torch import nn

import skpathkernel._path._recorder as R

torch.set_num_threads(1)
real = R.warn_random_forward


cases = {
    "mlp-3072x2048x8 (31M params)": (
        lambda: nn.Sequential(
            nn.Linear(3072, 2048),
            *[nn.Sequential(nn.Tanh(), nn.Linear(2048, 2048)) for _ in range(7)],
            nn.Linear(2048, 10),
        ),
        (20000, 3072),
    ),
    "cnn-64ch 32x32 (0.6M params)": (
        lambda: nn.Sequential(
            nn.Conv2d(3, 64, 3, padding=1),
            nn.ReLU(),
            *[nn.Sequential(nn.Conv2d(64, 64, 3, padding=1), nn.ReLU()) for _ in range(8)],
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(64, 10),
        ),
        (20000, 3, 32, 32),
    ),
}
for name, (make, shape) in cases.items():
    torch.manual_seed(0)
    m = make()
    X = torch.randn(*shape)
    y = torch.randn(shape[0], 10)
    rec = recorded(m, X, y, 1, 32, lr=1e-3)
    t = {"with": [], "without": []}
    for _rep in range(5):
        for kind in ("without", "with"):
            R.warn_random_forward = real if kind == "with" else (lambda *a, **k: None)
            c0 = time.process_time()
            rec.as_network(X, y)
            t[kind].append(time.process_time() - c0)
    R.warn_random_forward = real
    est = rec.as_estimator(X, y)
    c0 = time.process_time()
    est.predict(X[:64].numpy())
    tp = time.process_time() - c0
    n_params = sum(p.numel() for p in m.parameters())
    n_bytes = sum(p.numel() * p.element_size() for p in m.parameters())
    print(
        f"{name}: as_network CPU s median with probe {statistics.median(t['with']):.3f}, "
        f"without {statistics.median(t['without']):.3f}; predict(64 rows) {tp:.3f}; N={shape[0]}, "
        f"params {n_params / 1e6:.1f}M ({n_bytes / 2**20:.0f} MiB copied)"
    )
