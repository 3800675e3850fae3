"""pytorch-ood's detectors on exported features: run in the OOD peers venv.

``<.venv-ood>/bin/python -m benchmarks._ood_peers_worker IN.npz OUT.npz`` (the venv made by
``benchmarks/setup_ood_peers.sh``). The venv has its own torch (2.14.1, beside the
torchvision 0.29.1 that pytorch-ood imports), so the network is not rebuilt here: the main
process exports what pytorch-ood's detectors read from it, computed once by the trained
network itself, and this worker only fits and scores them.

IN.npz holds ``h_train`` (N, D) and ``h_query`` (M, D): the last hidden activations (the
input of the last ``nn.Linear``); ``y_train`` (N,): class labels 0..C-1 (all 0 for a
regression network); for a classifier, ``W`` (C, D) and ``b`` (C,): that last layer; and
``threads``. OUT.npz gets, per detector, its M scores, *higher = more normal*
(pytorch-ood's outlier scores negated), and ``"<name> seconds"``, the time to fit and
score it; and ``versions``. Only NumPy and pytorch-ood are imported: nothing of
skpathkernel.
"""

from __future__ import annotations

import sys
import time

import numpy as np

# Settings, from each detector's paper or pytorch-ood's defaults (see bench_ood's notes).
KNN_K = (1, 50)
VIM_D = 32
REACT_PERCENTILE = 0.9


def scores(data: dict) -> dict:
    import torch
    from pytorch_ood.detector import (
        KNN,
        EnergyBased,
        GradNorm,
        Mahalanobis,
        MaxLogit,
        ReAct,
        ViM,
    )

    torch.set_num_threads(int(data.get("threads", 1)))
    h_train = torch.as_tensor(data["h_train"], dtype=torch.float32)
    h_query = torch.as_tensor(data["h_query"], dtype=torch.float32)
    y_train = torch.as_tensor(data["y_train"], dtype=torch.long)
    out = {}

    def timed(name, fit_and_score):
        start = time.perf_counter()
        outlier = fit_and_score()
        out[f"{name} seconds"] = np.array(time.perf_counter() - start)
        out[name] = -np.asarray(outlier, dtype=np.float64)

    # Mahalanobis on features (no input perturbation: that needs the network's input
    # gradient); a regression network is one class.
    timed("Mahalanobis",
          lambda: Mahalanobis(None).fit_features(h_train, y_train).predict_features(h_query))
    for k in KNN_K:
        timed(f"KNN k={k}",
              lambda k=k: KNN(None, k=k).fit_features(h_train, y_train)
              .predict_features(h_query))
    if "W" not in data:
        return out
    W = torch.as_tensor(data["W"], dtype=torch.float32)
    b = torch.as_tensor(data["b"], dtype=torch.float32)
    head = torch.nn.Linear(W.shape[1], W.shape[0])
    with torch.no_grad():
        head.weight.copy_(W)
        head.bias.copy_(b)

    def logits():
        with torch.no_grad():
            return head(h_query)

    timed("Energy", lambda: EnergyBased.score(logits()))
    timed("MaxLogit", lambda: MaxLogit.score(logits()))
    d = min(VIM_D, h_train.shape[1] // 2)
    timed(f"ViM d={d}",
          lambda: ViM(None, d=d, w=W, b=b).fit_features(h_train, y_train)
          .predict_features(h_query))

    def react():
        detector = ReAct(backbone=None, head=head, percentile=REACT_PERCENTILE)
        return detector.fit_feature_maps(h_train, y_train).predict_feature_maps(h_query)

    timed("ReAct + Energy", react)
    # GradNorm as in its paper: the gradient of the last layer's weight only (the "model"
    # is that layer, fed the features).
    timed("GradNorm", lambda: GradNorm(head, param_filter=lambda name: name == "weight")
          .predict(h_query).detach())
    return out


def main(argv: list[str]) -> None:
    import pytorch_ood
    import torch

    src, dst = argv
    with np.load(src) as f:
        data = {k: f[k] for k in f.files}
    out = scores(data)
    out["versions"] = np.array(f"pytorch-ood {pytorch_ood.__version__} "
                               f"(torch {torch.__version__})")
    np.savez(dst, **out)


if __name__ == "__main__":
    main(sys.argv[1:])
