"""timm's and torchvision's LayerNorm subclasses on nn.LayerNorm's rule without registering
them (s53: a rule that reads its call alone, ``Rule.parameter_args``, reaches subclasses
that override ``forward``), in the libraries' ConvNeXts.

``python trial.py exact`` checks, in float64 (N = 6), the routes (no fallback, nothing
registered), ``check_rule`` and the full tangent Gram against the per-sample autograd loop
of ``../libraries_s51/ref.py`` (no skpathkernel code). ``python trial.py time N ROUNDS``
times the trace Gram in float32 on one thread (CPU time), in rounds alternating the rule
("rule"), the fallback ("fallback": nn.LayerNorm's rule without ``parameter_args``, as
before s53, so the subclasses fall back) and torch.func's ``vmap(jacrev)`` J J^T / C; it
prints the medians.

Needs the s51 trial venv (torch 2.14.1, torchvision 0.29.1, timm 1.0.31), run from this
folder with PYTHONPATH at the repository root, pinned (``taskset -c 0``); no test runs it.
"""

# ruff: noqa: E402
import dataclasses
import json
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch

torch.set_num_threads(1)
warnings.simplefilter("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "libraries_s51"))
from models import build, data
from ref import jacobian
from timing import torch_func_gram
from torch import nn

from skpathkernel._tangent import RULES, tangent_gram
from skpathkernel.rules import check_rule, layer_routes

NAMES = ("tv_convnext_small", "timm_convnext_atto")
RULE = RULES[nn.LayerNorm]
BEFORE = dataclasses.replace(RULE, parameter_args=None)


def inherited(on: bool) -> None:
    RULES[nn.LayerNorm] = RULE if on else BEFORE


def routes(module, X):
    got = layer_routes(module, X)
    fb = [r for r in got if r.route == "fallback"]
    return (f"{len(got) - len(fb)} rule / {len(fb)} fallback "
            f"({sum(r.n_params for r in fb):,} of {sum(r.n_params for r in got):,} params)",
            sorted({f"{r.type}: {r.reason}"[:120] for r in fb}))


def exact():
    for name in NAMES:
        module, kind = build(name)
        X = data(kind, 6)
        params = {k: v.detach() for k, v in module.named_parameters()}
        J = jacobian(module, params, X)
        full = torch.einsum("ncp,mdp->ncmd", J, J)
        out = {"model": name, "N": 6, "params": sum(p.numel() for p in params.values()),
               "types": sorted({type(m).__module__ + "." + type(m).__qualname__
                                for m in module.modules() if isinstance(m, nn.LayerNorm)})}
        for on in (False, True):
            inherited(on)
            tag = "rule" if on else "before"
            out[f"routes_{tag}"], out[f"fallback_{tag}"] = routes(module, X)
            G = tangent_gram(module, params, X, output="full")
            out[f"full_gram_rel_{tag}"] = float((G - full).abs().max() / full.abs().max())
        out["check_rule"] = check_rule(module, X, rtol=1e-10)
        print(json.dumps(out), flush=True)


def timed(n, rounds):
    for name in NAMES:
        module, kind = build(name, dtype=torch.float32)
        X = data(kind, n).float()
        params = {k: v.detach() for k, v in module.named_parameters()}

        def rule(module=module, params=params, X=X):
            inherited(True)
            return tangent_gram(module, params, X)

        def fallback(module=module, params=params, X=X):
            inherited(False)
            return tangent_gram(module, params, X)

        def peer(module=module, params=params, X=X):
            return torch_func_gram(module, params, X)

        fns = {"rule": rule, "fallback": fallback, "torch.func": peer}
        res = {key: fn() for key, fn in fns.items()}  # once untimed (caches)
        inherited(True)
        assert all(r.route == "rule" for r in layer_routes(module, X[:4]))
        times = {key: [] for key in fns}
        for _ in range(rounds):
            for key, fn in fns.items():
                t = time.process_time()
                fn()
                times[key].append(time.process_time() - t)
        inherited(True)
        out = {"model": name, "N": n, "rounds": rounds}
        out.update({f"{k}_s": float(np.median(v)) for k, v in times.items()})
        out["fallback_over_rule"] = out["fallback_s"] / out["rule_s"]
        out["rule_over_torch.func"] = out["rule_s"] / out["torch.func_s"]
        ref = res["torch.func"].double()
        for key in ("rule", "fallback"):
            out[f"rel_diff_{key}"] = float((res[key].double() - ref).abs().max()
                                           / ref.abs().max())
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    if sys.argv[1] == "exact":
        exact()
    else:
        timed(int(sys.argv[2]), int(sys.argv[3]))
