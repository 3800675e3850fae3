# ruff: noqa
"""CPU time of decompose(method="exact") at the default budget on the MLP and the CNN of
nets.py (float64, SGD): python speed.py -> 'mlp t' and 'cnn t' lines (best of 3 calls
in this process). Run alternately under the old and the new package (PYTHONPATH)."""
import sys
import time
import warnings

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from nets import make  # noqa: E402

torch.set_num_threads(1)
warnings.simplefilter("ignore")
for name in ["mlp", "cnn"]:
    rec, m, X, y = make(name, "sgd", torch.float64, steps=6, lr=0.5)
    est = rec.as_estimator(X, y)
    Xn = X.numpy()
    est.decompose(Xn)
    ts = []
    for _ in range(3):
        t0 = time.process_time()
        est.decompose(Xn)
        ts.append(time.process_time() - t0)
    print(name, min(ts))
