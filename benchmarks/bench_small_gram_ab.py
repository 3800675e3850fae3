"""Small tangent-kernel calls: the public ``TangentKernel(est)(X)`` of a base commit
against the working tree's, and torch.func's ``vmap(jacrev)`` J J^T (session s55).

Both packages are imported in one process (the base's from ``git archive REF
skpathkernel`` into a temporary folder, renamed in ``sys.modules`` before the tree's is
imported), each fits its own estimator from the same network and one SGD step, and the
three calls alternate (the order reversed every round), ``time.process_time`` per call,
medians. K is compared between the two sides (max ``|dK|`` / max ``|K|``) and with a
float64 torch.func reference of the same network (``functional_call`` + ``vmap`` +
``jacrev``, one product per parameter's Jacobian, summed, the trace over outputs / C, as
torch.func's NTK tutorial writes the empirical NTK), beside the float32 torch.func
result's own difference from it.

Networks: ``mlp`` 64-256-256-10 tanh, ``cnn`` Conv2d(1, 8, 3)-ReLU-Conv2d(8, 8, 3)-ReLU-
Flatten-Linear(512, 10) on 1 x 8 x 8, ``unet`` the user trial's DDPM U-Net (c = 16 on
8 x 8 images: C = 64 outputs, :class:`benchmarks.trial_generative.UNet`).

``--kernel PathKernel --steps T``: the path kernel of T recorded SGD steps, base against
tree only (no peer).

Usage: ``OMP_NUM_THREADS=1 taskset -c 0 python -m benchmarks.bench_small_gram_ab
[--ref main] [--reps 9] [--cases mlp@1 cnn@8 ...] [--out PATH] [--kernel K --steps T]``. Results:
``benchmarks/results/small_gram-s55.md``.
"""

import argparse
import copy
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, jacrev, vmap

from benchmarks.trial_generative import T_STEPS, UNet

ROOT = Path(__file__).resolve().parent.parent
PKG = "skpathkernel"


def _package_modules():
    return {k: sys.modules.pop(k) for k in list(sys.modules)
            if k == PKG or k.startswith(PKG + ".")}


def load_base(ref):
    """The package as it is at git ``ref``, imported apart from the tree's (which is
    imported afterwards as usual): its modules by name."""
    folder = tempfile.mkdtemp()
    archive = subprocess.run(["git", "archive", ref, PKG], cwd=ROOT, check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", folder], input=archive, check=True)
    tree = _package_modules()
    sys.path.insert(0, folder)
    try:
        __import__(PKG + ".kernels")
        base = _package_modules()
    finally:
        sys.path.remove(folder)
        sys.modules.update(tree)
    return base


def network(arch, n):
    """``(module, X, C)`` of a case, seeded."""
    torch.manual_seed(0)
    if arch == "mlp":
        m = nn.Sequential(nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(),
                          nn.Linear(256, 10))
        return m, torch.randn(n, 64), 10
    if arch == "cnn":
        m = nn.Sequential(nn.Conv2d(1, 8, 3, padding=1), nn.ReLU(),
                          nn.Conv2d(8, 8, 3, padding=1), nn.ReLU(), nn.Flatten(),
                          nn.Linear(512, 10))
        return m, torch.randn(n, 1, 8, 8), 10
    m = UNet()
    X = torch.cat([torch.randn(n, 1, 8, 8),
                   torch.randint(T_STEPS, (n, 1, 1, 1)).float().expand(n, 1, 8, 8)], 1)
    return m, X, 64


def estimator(pkg, m, X, C, steps=1):
    """A fitted estimator of ``pkg`` (a dict of modules) recording ``steps`` SGD steps of
    ``m`` (a copy) on ``X``."""
    recorder = pkg[PKG].PathRecorder
    m = copy.deepcopy(m)
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    Y = torch.randn(X.shape[0], C, generator=torch.Generator().manual_seed(1))
    with recorder(m, opt, n_samples=X.shape[0]) as rec:
        for _ in range(steps):
            opt.zero_grad()
            (0.5 * (m(X) - Y).pow(2).mean()).backward()
            rec.set_batch(np.arange(X.shape[0]))
            opt.step()
    return rec.as_estimator(X.numpy(), Y.numpy())


def peer(m, X, C):
    """torch.func's empirical NTK, trace over the outputs / C, as its tutorial
    (``empirical_ntk_jacobian_contraction``) writes it: one product per parameter's
    Jacobian, summed. (Concatenating the Jacobians first, as this script did until the
    review of session s55, copies all of J: the MLP's peer 1.3-1.8x slower from N = 8.)"""
    params = {k: v.detach() for k, v in m.named_parameters()}

    def f(p, x):
        # Flat outputs (the U-Net's are an image), as the tutorial's network gives them.
        return functional_call(m, p, (x.unsqueeze(0),)).reshape(-1)

    jac = [j.flatten(2) for j in vmap(jacrev(f), (None, 0))(params, X).values()]
    return (torch.stack([torch.einsum("Naf,Maf->NM", j, j) for j in jac]).sum(0) / C).numpy()


def _rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


def case(pkgs, name, reps, kernel="TangentKernel", steps=1):
    arch, n = name.split("@")
    n = int(n)
    m, Xall, C = network(arch, max(n, 64))
    torch.manual_seed(0)
    # Both sides' estimators of the same module (SGD steps on 64 rows).
    nets = {side: estimator(pkg, m, Xall[:64], C, steps) for side, pkg in pkgs.items()}
    trained = nets["tree"].network_.module
    X = Xall[:n]
    calls = {side: (lambda side=side: getattr(pkgs[side]["skpathkernel.kernels"], kernel)(
        nets[side])(X.numpy())) for side in pkgs}
    if kernel == "TangentKernel":
        calls["torch.func"] = lambda: peer(trained, X, C)
    out = {side: call() for side, call in calls.items()}
    ref64 = out.get("torch.func")
    if ref64 is not None:
        ref64 = peer(trained.double(), X.double(), C)
        trained.float()
    times = {side: [] for side in calls}
    order = list(calls)
    for r in range(reps):
        for side in (order if r % 2 == 0 else order[::-1]):
            start = time.process_time()
            calls[side]()
            times[side].append(time.process_time() - start)
    med = {side: float(np.median(t)) for side, t in times.items()}
    row = dict(case=name, load=os.getloadavg()[0],
               **{f"{side}_ms": 1e3 * med[side] for side in calls},
               base_over_tree=med["base"] / med["tree"],
               tree_vs_base=_rel(out["tree"], out["base"]))
    if ref64 is not None:
        row.update(func_over_tree=med["torch.func"] / med["tree"],
                   tree_vs_f64=_rel(out["tree"], ref64), base_vs_f64=_rel(out["base"], ref64),
                   func_vs_f64=_rel(out["torch.func"], ref64))
    print(" ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}"
                   for k, v in row.items()), flush=True)
    return row


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--ref", default="main")
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument("--cases", nargs="*", default=[f"{a}@{n}" for a in ("mlp", "cnn", "unet")
                                                       for n in (1, 8, 32, 64)])
    parser.add_argument("--out", default=None)
    parser.add_argument("--kernel", default="TangentKernel",
                        choices=["TangentKernel", "PathKernel"])
    parser.add_argument("--steps", type=int, default=1, help="SGD steps recorded")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    pkgs = {"base": load_base(args.ref)}
    __import__(PKG + ".kernels")
    pkgs["tree"] = {k: v for k, v in sys.modules.items() if k == PKG or k.startswith(PKG + ".")}
    assert pkgs["base"][PKG] is not pkgs["tree"][PKG]
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()
    base = subprocess.run(["git", "rev-parse", "--short", args.ref], cwd=ROOT,
                          capture_output=True, text=True).stdout.strip()
    print(f"# base {args.ref} ({base}), tree {commit}, cores {sorted(os.sched_getaffinity(0))},"
          f" torch {torch.__version__}, reps {args.reps}, load {os.getloadavg()}", flush=True)
    rows = [case(pkgs, name, args.reps, args.kernel, args.steps) for name in args.cases]
    if args.out and args.kernel == "TangentKernel":
        lines = ["| case | base (ms) | tree (ms) | torch.func (ms) | base / tree | "
                 "torch.func / tree | tree vs base | tree vs f64 | base vs f64 | "
                 "torch.func vs f64 | load |", "|---" * 11 + "|"]
        lines += [f"| {r['case']} | {r['base_ms']:.2f} | {r['tree_ms']:.2f} | "
                  f"{r['torch.func_ms']:.2f} | {r['base_over_tree']:.2f} | "
                  f"{r['func_over_tree']:.2f} | {r['tree_vs_base']:.1e} | "
                  f"{r['tree_vs_f64']:.1e} | {r['base_vs_f64']:.1e} | "
                  f"{r['func_vs_f64']:.1e} | {r['load']:.1f} |" for r in rows]
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
