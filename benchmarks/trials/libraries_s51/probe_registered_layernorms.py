"""timm and torchvision LayerNorm subclasses on nn.LayerNorm's rule: check_rule.

Needs the s51 trial venv (torch 2.14.1, torchvision 0.29.1, timm 1.0.31, transformers 5.25.0; see
benchmarks/results/user_trial_libraries-s51.md), run from this folder with PYTHONPATH at the
repository root; no test runs it.
"""

# ruff: noqa: E402, F403, F405
import warnings

import torch

torch.set_num_threads(1)
warnings.simplefilter("ignore")
import timm.layers
import torchvision.models.convnext as tvc
from models import *

from skpathkernel.rules import check_rule, get_rule, layer_routes, register_rule

for t in (timm.layers.LayerNorm, timm.layers.LayerNorm2d, tvc.LayerNorm2d):
    register_rule(t, get_rule(torch.nn.LayerNorm))
for name in ("tv_convnext_small", "timm_convnext_atto", "timm_vit", "timm_deit"):
    m, kind = build(name)
    X = data(kind, 4)
    r = layer_routes(m, X)
    print(
        name,
        "fallback after registering:",
        [(x.name, x.reason) for x in r if x.route == "fallback"],
        "check_rule:",
        check_rule(m, X, rtol=1e-10),
    )
