"""Peak of torch's CPU allocations of ``tangent_gram`` (and its diagonal and tangent
features) on a network whose forward graph dwarfs its factors: ``Linear(8, 64)``,
``.repeat(1, 8192)``, ``exp(sin(tanh(.)))``, summed (or a ``Linear`` head), float32,
N = 64 (``benchmarks/results/memory_repeat-s54.md``).

Run: ``PYTHONPATH=. python -m benchmarks.audit_memory_repeat [--head] [--n 64]``.
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from benchmarks.bench_gpu_choices import cpu_peak_bytes
from skpathkernel._tangent._gram import tangent_features, tangent_gram, tangent_gram_diag


class Repeated(nn.Module):
    def __init__(self, head: bool):
        super().__init__()
        self.lin = nn.Linear(8, 64)
        self.head = nn.Linear(64 * 8192, 1) if head else None

    def forward(self, x):
        h = torch.exp(torch.sin(torch.tanh(self.lin(x).repeat(1, 8192))))
        return self.head(h) if self.head is not None else h.sum(1, keepdim=True)


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--head", action="store_true")
    parser.add_argument("--n", type=int, default=64)
    args = parser.parse_args(argv)
    torch.manual_seed(0)
    torch.set_num_threads(1)
    net = Repeated(args.head)
    params = {k: v.detach() for k, v in net.named_parameters()}
    X = torch.randn(args.n, 8)
    for name, fn in [("tangent_gram", tangent_gram), ("tangent_gram_diag", tangent_gram_diag),
                     ("tangent_features", tangent_features)]:
        for mib in (8, 16, 32, 64, 128):
            try:
                _, peak = cpu_peak_bytes(
                    lambda fn=fn, mib=mib: fn(net, params, X, memory_budget=mib * 2**20))
            except ValueError as e:
                print(f"{name} budget {mib} MiB: refused: {e}")
                continue
            print(f"{name} budget {mib} MiB: peak {peak / 2**20:.1f} MiB "
                  f"({peak / (mib * 2**20):.2f}x)", flush=True)


if __name__ == "__main__":
    main()
