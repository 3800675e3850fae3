"""The cost of running checkpointed regions as plain calls (``skpathkernel._checkpoint``):
``functional_call`` with the switch against torch.func's, alternated in one process, CPU
time (``time.process_time``), medians; and ``tangent_gram`` of a network whose raw
parameter takes the generic fallback (one ``functional_call`` per sample in the loop,
the switch's worst case), the switch on against the switch a no-op (``plain_names``
returning nothing: exactly torch.func's call plus the empty context)."""

import statistics
import sys
import time

import torch
from torch import nn
from torch.func import functional_call as torch_call

import skpathkernel._checkpoint as switch
from benchmarks.audit_checkpointing import Odd
from skpathkernel._tangent import tangent_gram


def _cpu(fn, n):
    t = time.process_time()
    for _ in range(n):
        fn()
    return (time.process_time() - t) / n


def main(rounds=7):
    torch.set_num_threads(1)
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 2))
    params = dict(mlp.named_parameters())
    x = torch.randn(1, 16)
    calls = {"torch.func": lambda: torch_call(mlp, params, (x,)),
             "switch": lambda: switch.functional_call(mlp, params, (x,))}
    net = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), Odd(32), nn.Linear(32, 2)).double()
    p64 = {k: v.detach() for k, v in net.named_parameters()}
    X = torch.randn(64, 16, dtype=torch.float64)
    names = switch.plain_names
    off = {"switch off": lambda: (setattr(switch, "plain_names", lambda: ()),
                                  tangent_gram(net, p64, X), setattr(switch, "plain_names", names)),
           "switch on": lambda: tangent_gram(net, p64, X)}
    out = {k: [] for k in (*calls, *off)}
    for r in range(rounds):
        for group, n in ((calls, 2000), (off, 1)):
            order = list(group) if r % 2 == 0 else list(group)[::-1]
            for k in order:
                out[k].append(_cpu(group[k], n))
    for k, v in out.items():
        print(f"{k:12s} median {statistics.median(v) * 1e6:10.1f} us  "
              f"({', '.join(f'{t * 1e6:.1f}' for t in v)})")
    med = {k: statistics.median(v) for k, v in out.items()}
    print(f"per call: switch / torch.func {med['switch'] / med['torch.func']:.3f}; "
          f"fallback gram: on / off {med['switch on'] / med['switch off']:.3f}")


if __name__ == "__main__":
    main(*map(int, sys.argv[1:]))
