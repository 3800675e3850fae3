"""A/B of the review's copy of transposed_linear_rule's output (s52): GPT-2 (2 layers,
width 32) trace Gram with Conv1D on the rule as committed in a864b1c (its output handed on
as a view of the site's output) and as fixed (handed on as a copy), alternating in one
process; CPU seconds, medians; and the float64 Gram of both against the loop.

Needs the s51 trial venv (transformers), run from ``../library_rules_s52`` with PYTHONPATH
at the repository root, pinned: ``python ../review_rules_s52/clone_ab.py N ROUNDS``.
"""

# ruff: noqa: E402
import json
import sys
import time
import warnings

import numpy as np
import torch

torch.set_num_threads(1)
warnings.simplefilter("ignore")
sys.path.insert(0, ".")
import trial
from transformers.pytorch_utils import Conv1D
from trial import gpt2

from skpathkernel._tangent import _layers, tangent_gram
from skpathkernel.rules import Rule, register_rule, transposed_linear_rule


def committed_expand(layer, func, args, kwargs):
    """a864b1c's _in_out_expand: the result a view of the site's output."""
    out = _layers._in_out_expand(layer, func, args, kwargs)
    if out is None:
        return None
    result, sites = out
    return sites[0][1].reshape(result.shape), sites


FIXED = transposed_linear_rule()
COMMITTED = Rule(ops=FIXED.ops, factors=FIXED.factors, expand=committed_expand)


def main(n, rounds):
    trial.registered(True)
    module, _ = gpt2(torch.float64)
    X = trial.data("ids", 6)
    params = {k: v.detach() for k, v in module.named_parameters()}
    J = trial.jacobian(module, params, X)
    ref = torch.einsum("ncp,mdp->ncmd", J, J)
    out = {"N": n, "rounds": rounds}
    for key, rule in (("committed", COMMITTED), ("fixed", FIXED)):
        register_rule(Conv1D, rule)
        G = tangent_gram(module, params, X, output="full")
        out[f"full_gram_rel_{key}"] = float((G - ref).abs().max() / ref.abs().max())
    module, _ = gpt2(torch.float32)
    X = trial.data("ids", n)
    params = {k: v.detach() for k, v in module.named_parameters()}
    times = {"committed": [], "fixed": []}
    for rule in (COMMITTED, FIXED):
        register_rule(Conv1D, rule)
        tangent_gram(module, params, X)  # untimed
    for _ in range(rounds):
        for key, rule in (("committed", COMMITTED), ("fixed", FIXED)):
            register_rule(Conv1D, rule)
            t = time.process_time()
            tangent_gram(module, params, X)
            times[key].append(time.process_time() - t)
    out.update({f"{k}_s": float(np.median(v)) for k, v in times.items()})
    out["fixed_over_committed"] = out["fixed_s"] / out["committed_s"]
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))
