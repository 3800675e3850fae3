"""Figure 10: the normalized tangent kernel between fixed pairs over training."""

from __future__ import annotations

import numpy as np

from ._common import circle_fit, progress, save, subplots
from ._fig9 import OPTIMIZERS
from ._report import Row

X0 = np.array([0.0, 0.0])  # label -1
YS = np.array([[0.0, 0.0], [0.5, 0.0], [1.0, 0.0], [1.2, 0.0]])  # -1, -1, +1, +1
LABELS = ["y=(0,0) same", "y=(0.5,0) same", "y=(1,0) opposite", "y=(1.2,0) opposite"]


def figure10_section(ctx):
    """K_hat_t(x, y) for x = (0, 0) and four y, every recorded step, four optimizers."""
    from ..plotting import KernelEvolutionDisplay

    details, ok = [], []
    with progress("figure 10", len(OPTIMIZERS)) as tick:
        fig, axes = subplots(1, 4, figsize=(20, 4.6), sharey=True)
        for ax, name, letter in zip(axes, OPTIMIZERS, "abcd"):
            est = circle_fit(ctx, name)
            n_points = len(est.trajectory_)
            # ~200 evenly spread recorded points draw the curves; every one costs a Gram.
            steps = np.unique(np.linspace(0, n_points - 1, min(n_points, 200)).astype(int))
            disp = KernelEvolutionDisplay.from_estimator(est, X0, YS, steps=steps,
                                                         labels=LABELS, ax=ax)
            ax.axhline(0, color="grey", linewidth=0.6)
            ax.set_title(f"({letter}) {name}", fontsize="small")
            K = disp.kernel_values
            same, opp = K[-1, 1], K[-1, 2:]
            opp_init = K[0, 2:]
            ok.append(same > opp.max() and opp.mean() < opp_init.mean())
            details.append({
                "optimizer": name,
                "K_hat (0.5,0) init -> end": f"{K[0, 1]:.3f} -> {same:.3f}",
                "K_hat (1,0) init -> end": f"{K[0, 2]:.3f} -> {K[-1, 2]:.3f}",
                "K_hat (1.2,0) init -> end": f"{K[0, 3]:.3f} -> {K[-1, 3]:.3f}",
            })
            tick(name)
        png = save(ctx, fig, "fig10_kernel_evolution.png")
    return [Row(
        "10", "same-label pairs keep a high normalized kernel while opposite-label pairs decay "
        "(end: K_hat(x,(0.5,0)) above both opposite pairs, which fell from init), every "
        "optimizer",
        f"{sum(ok)}/{len(ok)} optimizers [{png}]", all(ok), details=details,
    )]
