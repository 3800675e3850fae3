# ruff: noqa
"""Run decompose(method="exact") on each case, save contributions, n_nodes, error and
the module's own forward at the last point. argv: out.npz [budget]."""
import sys
import warnings

import numpy as np
import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from nets import make  # noqa: E402

out = {}
budget = int(float(sys.argv[2])) if len(sys.argv) > 2 else 2**30
for name in ["mlp", "cnn", "attn"]:
    for opt in ["sgd", "adam"]:
        for dt in [torch.float32, torch.float64]:
            key = f"{name}-{opt}-{str(dt)[6:]}"
            rec, m, X, y = make(name, opt, dt)
            est = rec.as_estimator(X, y, memory_budget=budget)
            with warnings.catch_warnings(record=True) as w:
                warnings.simplefilter("always")
                r = est.decompose(X.numpy(), method="exact")
            with torch.no_grad():
                f = m(X).double().numpy()
            out[key + ":c"] = r.contributions
            out[key + ":n"] = r.n_nodes
            out[key + ":err"] = np.array(r.error)
            out[key + ":reg"] = np.asarray(r.regularization if r.regularization is not None else 0.0)
            out[key + ":init"] = r.initial
            out[key + ":pred"] = r.prediction
            out[key + ":f"] = f
            out[key + ":w"] = np.array(" | ".join(str(x.message)[:200] for x in w))
np.savez(sys.argv[1], **out)
