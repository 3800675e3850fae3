"""Figure 10: the normalized kernel between fixed pairs over training, four optimizers.

Measured with each optimizer's weighted step kernel ``K_t = J_t D_t J_t^T`` (THEORY.md),
normalized; for Adam and RMSprop the plain tangent kernel ``J_t J_t^T`` is drawn (dashed)
and reported next to it (for SGD and SGD with momentum ``D_t`` is the identity: one kernel).
"""

from __future__ import annotations

import numpy as np

from ..plotting import KernelEvolutionDisplay
from ._common import circle_fit, progress, save, subplots
from ._fig9 import OPTIMIZERS
from ._report import Row

X0 = np.array([0.0, 0.0])  # label -1
YS = np.array([[0.0, 0.0], [0.5, 0.0], [1.0, 0.0], [1.2, 0.0]])  # -1, -1, +1, +1
LABELS = ["y=(0,0) same", "y=(0.5,0) same", "y=(1,0) opposite", "y=(1.2,0) opposite"]
# The caption: same-label pairs stay "near 1", opposite-label pairs "decay toward 0 and may
# become negative". Read at the end of training as K_hat >= NEAR_ONE and <= NEAR_ZERO.
NEAR_ONE, NEAR_ZERO = 0.9, 0.1


def same_high_opposite_low(K_end) -> bool:
    """The claim on the last row of kernel values ``[(0,0), (0.5,0), (1,0), (1.2,0)]``."""
    K_end = np.asarray(K_end, dtype=float)
    return bool(K_end[1] >= NEAR_ONE and np.all(K_end[2:] <= NEAR_ZERO))


def figure10_section(ctx):
    """K_hat_t(x, y) for x = (0, 0) and four y, four optimizers, at ~200 recorded points
    (60 in quick mode)."""
    details, ok, ends = [], [], []
    with progress("figure 10", len(OPTIMIZERS)) as tick:
        fig, axes = subplots(1, 4, figsize=(20, 4.6), sharey=True)
        for ax, name, letter in zip(axes, OPTIMIZERS, "abcd"):
            est = circle_fit(ctx, name)
            n_points = len(est.trajectory_)
            # Evenly spread recorded points draw the curves; every one costs a Gram.
            n_show = 60 if ctx.quick else 200
            steps = np.unique(np.linspace(0, n_points - 1, min(n_points, n_show)).astype(int))
            weighted = est.trajectory_.solver_spec.name != "sgd"
            K = KernelEvolutionDisplay.from_estimator(
                est, X0, YS, steps=steps, labels=LABELS, ax=ax,
                preconditioned=True).kernel_values
            kernels = {"J D J^T" if weighted else "J J^T (D = I)": K}
            if weighted:
                ax.set_prop_cycle(None)
                kernels["J J^T"] = KernelEvolutionDisplay.from_estimator(
                    est, X0, YS, steps=steps, labels=[f"{lab}, J J^T" for lab in LABELS],
                    ax=ax, linestyle="--", linewidth=0.8, legend=False).kernel_values
            ax.axhline(0, color="grey", linewidth=0.6)
            ax.set_title(f"({letter}) {name}" + (": K_t = J D_t J^T (solid), J J^T (dashed)"
                                                 if weighted else ""), fontsize="small")
            ok.append(same_high_opposite_low(K[-1]))
            ends.append(f"{name} {K[-1, 1]:.2f} / {K[-1, 2]:.2f}, {K[-1, 3]:.2f}")
            for kname, Kk in kernels.items():
                details.append({
                    "optimizer": name, "kernel": kname,
                    "(0.5,0) init -> end": f"{Kk[0, 1]:.3f} -> {Kk[-1, 1]:.3f}",
                    "(1,0) init -> end (min)": f"{Kk[0, 2]:.3f} -> {Kk[-1, 2]:.3f} "
                                               f"({Kk[:, 2].min():.3f})",
                    "(1.2,0) init -> end (min)": f"{Kk[0, 3]:.3f} -> {Kk[-1, 3]:.3f} "
                                                 f"({Kk[:, 3].min():.3f})",
                })
            tick(name)
        png = save(ctx, fig, "fig10_kernel_evolution.png")
    return [Row(
        "10", "with each optimizer's normalized kernel K_t = J D_t J^T, the same-label pair "
        f"stays near 1 (K_hat(x,(0.5,0)) >= {NEAR_ONE} at the end) while both opposite-label "
        f"pairs decay toward 0 or below (<= {NEAR_ZERO} at the end), every optimizer",
        f"{sum(ok)}/{len(ok)} optimizers; end K_hat same / opposite: {'; '.join(ends)} "
        f"[{png}]",
        all(ok), details=details,
    )]
