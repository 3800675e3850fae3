"""
=============================================================
A GAN generator's path kernel follows the discriminator
=============================================================

Guo, He & Morel (2026) read GANs through the generator's path kernel: training induces
"distribution-guided corrections shaped by discriminator geometry". Here a tiny GAN is
trained on 2-D data by an ordinary alternating loop; the *generator*'s path is recorded
with :class:`~skpathkernel.PathRecorder`.

The generator's loss is not a sum of supervised per-sample terms: it depends on the
discriminator, which changes every step. Its gradient does factor through the
generator's output, ``J(z_i)^T r_i`` with ``r_i`` the derivative of the non-saturating
loss ``softplus(-D(x))`` at ``x = G(z_i)``. So we declare each step's latents ``z_i`` as
training inputs, ``r_i`` as their targets, and the linear per-sample loss
``l(f, r) = r . f``, whose gradient is exactly the one the optimizer used: the
decomposition is exact, and a contribution ``a_i(z)`` is how much the discriminator's
pull on generated sample ``z_i`` moved ``G(z)``.

Step ``t`` moves ``G(z)``, to first order, by
``u_t(z) = -sum_i K_t(z, z_i) r_i / B`` with ``K_t`` the generator's optimizer-weighted
step kernel (2 x 2 blocks): the discriminator's pulls on the batch, spread by the kernel.
We compare ``u_t`` with the discriminator's own pull at ``G_t(z)``.
"""

# %%
# Training, with the generator recorded
# -------------------------------------
import copy

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import torch
import torch.nn.functional as F

from skpathkernel import PathRecorder
from skpathkernel.kernels import step_kernel

torch.set_num_threads(1)
dtype = torch.float64
gen = torch.Generator().manual_seed(0)
torch.manual_seed(0)


def mlp(n_in, n_out, width=32):
    return torch.nn.Sequential(
        torch.nn.Linear(n_in, width), torch.nn.Tanh(), torch.nn.Linear(width, width),
        torch.nn.Tanh(), torch.nn.Linear(width, n_out)).to(dtype)


def real_data(n):
    centers = torch.tensor([[1.0, 1.0], [-1.0, -1.0], [1.0, -1.0]], dtype=dtype)
    pick = torch.randint(3, (n,), generator=gen)
    return centers[pick] + 0.15 * torch.randn(n, 2, generator=gen, dtype=dtype)


def pull(D, x):
    """Per-sample derivative of the generator loss softplus(-D(x)) with respect to x."""
    x = x.detach().requires_grad_(True)
    (r,) = torch.autograd.grad(F.softplus(-D(x)).sum(), x)
    return r


def linear_loss(output, target):
    return (output * target).sum(dim=1)


G, D = mlp(2, 2), mlp(2, 1)
opt_g = torch.optim.Adam(G.parameters(), lr=2e-3, betas=(0.5, 0.999))
opt_d = torch.optim.Adam(D.parameters(), lr=2e-3, betas=(0.5, 0.999))
n_steps, batch = 300, 64
Z = torch.empty(n_steps * batch, 2, dtype=dtype)
R = torch.empty(n_steps * batch, 2, dtype=dtype)
discriminators = {}
with PathRecorder(G, opt_g, n_samples=len(Z)) as recorder:
    for t in range(n_steps):
        with torch.no_grad():
            fake = G(torch.randn(batch, 2, generator=gen, dtype=dtype))
        opt_d.zero_grad()
        (F.softplus(-D(real_data(batch))) + F.softplus(D(fake))).mean().backward()
        opt_d.step()
        z = torch.randn(batch, 2, generator=gen, dtype=dtype)
        r = pull(D, G(z))
        if t % 10 == 0:
            discriminators[t] = copy.deepcopy(D)
        idx = torch.arange(t * batch, (t + 1) * batch)
        Z[idx], R[idx] = z, r
        opt_g.zero_grad()
        linear_loss(G(z), r).mean().backward()  # = grad of mean softplus(-D(G(z)))
        recorder.set_batch(idx)
        opt_g.step()
net = recorder.as_estimator(Z.numpy(), R.numpy(), loss=linear_loss)
print(net.trajectory_)

# %%
# The decomposition over the declared (z_i, r_i) pairs is exact
# --------------------------------------------------------------
z_query = torch.randn(64, 2, generator=torch.Generator().manual_seed(2), dtype=dtype).numpy()
res = net.decompose(z_query[:2])
top = np.argsort(-np.abs(res.contributions[0]).sum(axis=1))[:3]
print(f"decomposition error: {res.error:.1e}")
print(f"largest contributors to G(z_0): declared samples {top.tolist()}, "
      f"drawn at generator steps {(top // batch).tolist()}")

# %%
# Kernel-weighted updates against the discriminator's gradient field
# ------------------------------------------------------------------
# Centered over the queries (a kernel that ignores geometry moves every sample the same
# way and scores 0), the correlation of ``u_t`` with the discriminator's pull, while the
# generator's samples travel to the data.


def generator_at(k):
    Gk = copy.deepcopy(G)
    Gk.load_state_dict(net.trajectory_.state_dict(k))
    return Gk


def update_and_pull(t):
    b = net.trajectory_.batch(t)
    K = step_kernel(net, z_query, Z[b].numpy(), step=t, output="full", preconditioned=True)
    u = -np.einsum("qbcd,bd->qc", K, R[b].numpy()) / len(b)
    with torch.no_grad():
        x = generator_at(t)(torch.as_tensor(z_query))
    return u, -pull(discriminators[t], x).numpy(), x.numpy()


def centered_correlation(u, p):
    return np.corrcoef((u - u.mean(0)).ravel(), (p - p.mean(0)).ravel())[0, 1]


phase = [t for t in sorted(discriminators) if t < n_steps // 2]
corr = [centered_correlation(*update_and_pull(t)[:2]) for t in phase]
print("centered correlation per step:", dict(zip(phase, np.round(corr, 2).tolist())))
print(f"mean over the transport phase: {np.mean(corr):.2f}")

# %%
# A quiver plot at step 40: the discriminator's pull over the plane (grey), the generated
# samples (blue) and their kernel-weighted updates (red); right: the samples at the end.
t = 40
u, p, x = update_and_pull(t)
g1, g2 = np.meshgrid(np.linspace(-2, 2, 17), np.linspace(-2, 2, 17))
grid = torch.as_tensor(np.column_stack([g1.ravel(), g2.ravel()]))
field = -pull(discriminators[t], grid).numpy()
real = real_data(300).numpy()
fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(10, 4.5))
ax0.quiver(g1, g2, field[:, 0], field[:, 1], color="0.6", label="discriminator pull")
ax0.scatter(real[:, 0], real[:, 1], s=4, c="k", alpha=0.3, label="data")
ax0.scatter(x[:, 0], x[:, 1], s=10, c="tab:blue", label="G_t(z)")
ax0.quiver(x[:, 0], x[:, 1], u[:, 0], u[:, 1], color="tab:red", label="kernel update u_t(z)")
ax0.set(title=f"step {t}: correlation {centered_correlation(u, p):.2f}", xlim=(-2, 2),
        ylim=(-2, 2))
ax0.legend(loc="lower left", fontsize=7)
with torch.no_grad():
    final = G(torch.randn(500, 2, generator=gen, dtype=dtype)).numpy()
ax1.scatter(real[:, 0], real[:, 1], s=4, c="k", alpha=0.3, label="data")
ax1.scatter(final[:, 0], final[:, 1], s=4, c="tab:blue", alpha=0.5, label="generated")
ax1.set(title="after training", xlim=(-2, 2), ylim=(-2, 2))
ax1.legend(loc="lower left", fontsize=7)
fig.tight_layout()
