"""Stochastic depth in the user's loop, HF position_ids, HF gradient checkpointing, timm
LayerNorm registered against the fallback.

Needs the s51 trial venv (torch 2.14.1, torchvision 0.29.1, timm 1.0.31, transformers 5.25.0; see
benchmarks/results/user_trial_libraries-s51.md), run from this folder with PYTHONPATH at the
repository root; no test runs it.
"""

# ruff: noqa: E402, F403, F405, E501
import time
import warnings

import numpy as np
import torch

torch.set_num_threads(1)
from models import *
from ref import full, jacobian, rel, reported
from run import train

from skpathkernel.kernels import TangentKernel
from skpathkernel.rules import get_rule, layer_routes, register_rule

caught_run = reported

# (b) stochastic depth in the user's own loop, torchvision ConvNeXt in train mode
torch.manual_seed(0)
m, _ = build("tv_convnext_small")
m.train()
X = data("img", 6)
y = torch.randn(6, 3, dtype=torch.float64)


def own_sd():
    rec = train(m, X, y)
    net = rec.as_estimator(X, y)
    res = net.decompose(X)
    return f"decompose error {res.error:.3g}, max|f| {np.abs(res.prediction).max():.3g}"


caught_run("own loop, tv ConvNeXt train mode (StochasticDepth p=0.1)", own_sd)


# (c) HF with position_ids from the ids
for name in ("hf_bert", "hf_gpt2"):
    mm, _ = build(name)
    pm = LogitsPos(mm.model)
    Xi = data("ids", 6)
    r = layer_routes(pm, Xi)
    print(
        name, "with position_ids:", [(x.name, x.type, x.reason) for x in r if x.route == "fallback"]
    )
    with torch.no_grad():
        print("   same outputs as without:", float((pm(Xi) - mm(Xi)).abs().max()))
# distilbert has no position_ids argument in forward?
import inspect

from transformers import DistilBertForSequenceClassification

print(
    "distilbert forward takes position_ids:",
    "position_ids" in inspect.signature(DistilBertForSequenceClassification.forward).parameters,
)

# (d) HF gradient checkpointing
mm, _ = build("hf_bert")
Xi = data("ids", 6)
yi = torch.randn(6, 3, dtype=torch.float64)
mm.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
mm.train()  # HF checkpoints only in training mode (dropout is 0 in this config)
print("checkpointing on:", mm.model.bert.encoder.gradient_checkpointing, "training:", mm.training)


def ck():
    rec = train(mm, Xi, yi)
    net = rec.as_estimator(Xi, yi)
    traj = rec.trajectory
    K = TangentKernel(net, output="full")(Xi)
    ref_m, _ = build("hf_bert")  # no checkpointing
    Jr = jacobian(ref_m, traj.state_dict(len(traj) - 1), Xi)
    res = net.decompose(Xi)
    with torch.no_grad():
        f = mm(Xi).numpy()
    return f"TK vs ref {rel(K, full(Jr)):.2g}; decompose error {res.error:.2g}, gap {np.abs(res.initial + res.contributions.sum(1) + res.regularization - f).max():.2g}"


caught_run("HF BERT gradient_checkpointing_enable(use_reentrant=False), train mode", ck)

# (e) timm LayerNorm: fallback vs registered nn.LayerNorm rule, TK trace float32 N=64
mv, _ = build("timm_vit", dtype=torch.float32)
Xv = data("img", 64).float()
yv = torch.zeros(64, 3)
warnings.simplefilter("ignore")
rec = train(mv, Xv, yv, steps=1)
net = rec.as_estimator(Xv, yv)


def t(fn, k=3):
    ts = []
    for _ in range(k):
        s = time.process_time()
        fn()
        ts.append(time.process_time() - s)
    return float(np.median(ts))


K0 = TangentKernel(net)(Xv)
a = [t(lambda: TangentKernel(net)(Xv))]
from timm.layers import LayerNorm as TLN

register_rule(TLN, get_rule(torch.nn.LayerNorm))
print("timm vit routes after register:", {r.route for r in layer_routes(mv, Xv)})
K1 = TangentKernel(net)(Xv)
b = [t(lambda: TangentKernel(net)(Xv))]
print(
    f"timm vit TK N=64 float32: fallback LN {a[0]:.3f} s, registered {b[0]:.3f} s, rel diff {rel(K1, K0):.2g}"
)
