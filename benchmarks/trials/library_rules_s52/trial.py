"""Library layers on rules: GPT-2's Conv1D (``transposed_linear_rule``) and timm's and
torchvision's LayerNorm subclasses (``nn.LayerNorm``'s rule), in the libraries' models.

``python trial.py path`` runs s51's ``run.py`` (the user's recorded SGD loop, the tangent
and path kernels against the loop, the exact decomposition's error and gap) with the
rules registered. ``python trial.py exact`` checks, in float64, the routes (no fallback
once registered), ``check_rule`` and the full tangent Gram against the per-sample autograd loop of
``../libraries_s51/ref.py`` (no skpathkernel code). ``python trial.py time N ROUNDS``
times the trace Gram in float32 on one thread (CPU time), in rounds alternating the
rules registered ("after"), not registered ("before", the fallback) and torch.func's
``vmap(jacrev)`` J J^T / C (or, where torch.func cannot run the model, the per-sample
loop); it prints the medians.

Needs the s51 trial venv (torch 2.14.1, torchvision 0.29.1, timm 1.0.31, transformers
5.25.0; see benchmarks/results/library_rules-s52.md), run from this folder with PYTHONPATH
at the repository root, pinned (``taskset -c 0``); no test runs it.
"""

# ruff: noqa: E402
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
import timm.layers
import torchvision.models.convnext as tvc
from models import SEQ, VOCAB, LogitsPos, build, data
from ref import jacobian
from timing import torch_func_gram
from torch import nn
from transformers import GPT2Config, GPT2ForSequenceClassification
from transformers.pytorch_utils import Conv1D

from skpathkernel._tangent import RULES, tangent_gram
from skpathkernel.rules import (
    check_rule,
    get_rule,
    layer_routes,
    register_rule,
    transposed_linear_rule,
)

LIBRARY_RULES = {
    Conv1D: transposed_linear_rule(),
    timm.layers.LayerNorm: get_rule(nn.LayerNorm),
    timm.layers.LayerNorm2d: get_rule(nn.LayerNorm),
    tvc.LayerNorm2d: get_rule(nn.LayerNorm),
}


def registered(on: bool) -> None:
    """The library rules registered (the user's four lines), or not."""
    for kind, rule in LIBRARY_RULES.items():
        if on:
            register_rule(kind, rule)
        else:
            RULES.pop(kind, None)


def gpt2(dtype=torch.float64):
    """GPT-2 with two layers of width 32, per-sample position ids (the inputs guide)."""
    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=VOCAB,
        n_embd=32,
        n_layer=2,
        n_head=2,
        n_positions=16,
        num_labels=3,
        pad_token_id=0,
        attn_implementation="sdpa",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return LogitsPos(GPT2ForSequenceClassification(cfg)).to(dtype).eval(), "ids"


def model(name, dtype=torch.float64):
    return gpt2(dtype) if name == "hf_gpt2_32" else build(name, dtype=dtype)


NAMES = ("hf_gpt2_32", "tv_convnext_small", "timm_convnext_atto")


def routes(module, X):
    got = layer_routes(module, X)
    fb = [r for r in got if r.route == "fallback"]
    return (
        f"{len(got) - len(fb)} rule / {len(fb)} fallback "
        f"({sum(r.n_params for r in fb):,} of {sum(r.n_params for r in got):,} params)",
        sorted({f"{r.type}: {r.reason}"[:160] for r in fb}),
    )


def exact():
    for name in NAMES:
        module, kind = model(name)
        X = data(kind, 6)
        params = {k: v.detach() for k, v in module.named_parameters()}
        J = jacobian(module, params, X)
        full = torch.einsum("ncp,mdp->ncmd", J, J)
        out = {"model": name, "N": 6, "params": sum(p.numel() for p in params.values())}
        grams = {}
        for on in (False, True):
            registered(on)
            tag = "after" if on else "before"
            out[f"routes_{tag}"], out[f"fallback_{tag}"] = routes(module, X)
            G = grams[tag] = tangent_gram(module, params, X, output="full")
            out[f"full_gram_rel_{tag}"] = float((G - full).abs().max() / full.abs().max())
            if on:
                out["check_rule"] = check_rule(module, X, rtol=1e-10)
        # The two engines' Grams are not the same numbers (the rounding differs).
        out["after_vs_before"] = float(
            (grams["after"] - grams["before"]).abs().max() / full.abs().max()
        )
        print(json.dumps(out), flush=True)


def timed(n, rounds):
    for name in NAMES:
        module, kind = model(name, torch.float32)
        X = data(kind, n)
        X = X.float() if X.is_floating_point() else X
        params = {k: v.detach() for k, v in module.named_parameters()}

        def after(module=module, params=params, X=X):
            registered(True)
            return tangent_gram(module, params, X)

        def before(module=module, params=params, X=X):
            registered(False)
            return tangent_gram(module, params, X)

        def peer(module=module, params=params, X=X):
            return torch_func_gram(module, params, X)

        def loop(module=module, params=params, X=X):
            J = jacobian(module, params, X)
            return torch.einsum("ncp,mcp->nm", J, J) / J.shape[1]

        fns = {"after": after, "before": before, "torch.func": peer}
        res = {}
        for key in list(fns):
            try:
                res[key] = fns[key]()  # once untimed (first calls build caches)
            except Exception as e:
                res[key] = repr(e)[:160]
                fns.pop(key)
        if "torch.func" not in fns:
            fns["loop"], res["loop"] = loop, loop()
        times = {key: [] for key in fns}
        for _ in range(rounds):
            for key, fn in fns.items():
                t = time.process_time()
                fn()
                times[key].append(time.process_time() - t)
        out = {"model": name, "N": n, "rounds": rounds}
        out.update({f"{k}_s": float(np.median(v)) for k, v in times.items()})
        out["before_over_after"] = out["before_s"] / out["after_s"]
        peer_key = "torch.func" if "torch.func" in fns else "loop"
        out[f"after_over_{peer_key}"] = out["after_s"] / out[f"{peer_key}_s"]
        if "torch.func" not in fns:
            out["torch.func"] = res["torch.func"]
        ref = res[peer_key].double()
        for key in ("after", "before"):
            out[f"rel_diff_{key}"] = float((res[key].double() - ref).abs().max() / ref.abs().max())
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    assert SEQ == 8
    if sys.argv[1] == "exact":
        exact()
    elif sys.argv[1] == "path":
        import models
        import run

        models.MODELS["hf_gpt2_32"] = gpt2
        registered(True)
        for name in NAMES:
            run.main(name, 6)
    else:
        timed(int(sys.argv[2]), int(sys.argv[3]))
