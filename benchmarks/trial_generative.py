"""User trial s53: generative models (VAE, DDPM denoiser, GAN) against per-sample autograd.

What a generative-model researcher would check, with the public API only. Three small
float64 models are trained in the user's own loop under ``PathRecorder``:

- a convolutional VAE (Conv2d, SiLU, Linear, ConvTranspose2d) whose reparameterisation
  noise ``eps`` is drawn in the loop and declared with the image as the training input
  ``(x, eps)``; the network returns ``[x_hat, mu, logvar]`` and the declared per-sample
  loss is the reconstruction plus the KL term;
- a DDPM denoiser (timestep Embedding read from the input's second channel, Conv2d,
  GroupNorm, SiLU, a strided down-sampling, Upsample and ConvTranspose2d back, a skip
  concatenation): random timestep and noise per step, each draw a declared training input
  ``(x_t, t)`` with its noise as the target, loss ``squared_error``;
- a GAN (ConvTranspose2d generator, Conv2d discriminator, Adam, alternating steps, the
  non-saturating loss) with *both* networks recorded at once: the generator on declared
  ``(z_i, r_i)`` pairs with the linear loss ``r . f`` (``r = d softplus(-D(x)) / dx`` at
  ``x = G(z)``), the discriminator on each step's real and (detached) fake images with
  labels +-1 and the loss ``softplus(-s f)`` (``set_batch(weights=1/B)``).

References use no part of the engine: ``J_k`` by one ``torch.autograd.grad`` per sample
and output on a fresh module holding recorded point ``k``; tangent kernel (``output="full"``
blocks and trace / C), path kernel (SGD models: ``sum_k lr J_k J_k^T``), ``decompose``
(closure ``initial + contributions.sum(1) + regularization`` against the module's own
forward at the last point), ``attribute(method="unrolled", output=c)`` against central
differences (eps 1e-6) of retraining from the same initial weights and the same draws with
declared point ``i``'s weight ``u_i`` in its step's loss ``sum(u l) / sum(u)``, and the
rank-gap detector's ``method="residual"`` score against the relative residual of the
dense ``vec J(x)`` outside the span of the training features (SVD).

Probes of what cannot be exact: the same VAE with ``eps`` drawn inside ``forward`` (the
natural way to write it), and the generator's unrolled scores against the coupled GAN
retrained with the discriminator reacting.

Usage: ``taskset -c 0 python -m benchmarks.trial_generative [OUT.json]``.
"""

import copy
import json
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from sklearn.frozen import FrozenEstimator
from torch import nn
from torch.func import functional_call, jacrev, vmap

from skpathkernel import OODRankDetector, PathRecorder
from skpathkernel.kernels import PathKernel, TangentKernel
from skpathkernel.rules import layer_routes

ROOT = Path(__file__).resolve().parent.parent
DT = torch.float64
EPS_FD = 1e-6
STEPS, B, N_DATA = 4, 4, 8
ND = STEPS * B  # declared draws


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-300))


def images(n, seed):
    g = torch.Generator().manual_seed(seed)
    base = torch.zeros(n, 1, 4, 4, dtype=DT)
    for i in range(n):  # bars and blobs, 4 x 4, in [-1, 1]
        if i % 2:
            base[i, 0, :, i % 4] = 1
        else:
            base[i, 0, i % 4, :] = 1
    return (base * 2 - 1 + 0.1 * torch.randn(n, 1, 4, 4, generator=g, dtype=DT)).clamp(-1, 1)


# ----------------------------------------------------------------------------- models
class VAE(nn.Module):
    """Input rows ``[x (16), eps (2)]``; output ``[x_hat (16), mu (2), logvar (2)]``."""

    def __init__(self, noise_inside=False):
        super().__init__()
        self.noise_inside = noise_inside
        self.enc = nn.Sequential(
            nn.Conv2d(1, 3, 3, padding=1), nn.SiLU(), nn.Flatten(), nn.Linear(48, 4)
        )
        self.dec_in = nn.Linear(2, 8)
        self.dec = nn.ConvTranspose2d(2, 1, 4, stride=2, padding=1)

    def forward(self, inp):
        x = inp[:, :16].reshape(-1, 1, 4, 4)
        h = self.enc(x)
        mu, logvar = h[:, :2], h[:, 2:]
        eps = torch.randn_like(mu) if self.noise_inside else inp[:, 16:18]
        z = mu + torch.exp(0.5 * logvar) * eps
        xh = self.dec(F.silu(self.dec_in(z).reshape(-1, 2, 2, 2)))
        return torch.cat([xh.flatten(1), mu, logvar], dim=1)


def vae_loss(out, y):
    mu, lv = out[:, 16:18], out[:, 18:20]
    rec = 0.5 * (out[:, :16] - y).pow(2).sum(1)
    return rec + 0.5 * (mu.pow(2) + lv.exp() - lv - 1).sum(1)


T_STEPS = 10
BETAS = torch.linspace(1e-2, 0.3, T_STEPS, dtype=DT)
ABAR = torch.cumprod(1 - BETAS, 0)


class Denoiser(nn.Module):
    """A tiny U-Net: input ``(n, 2, 4, 4)``, channel 1 holding the timestep."""

    def __init__(self):
        super().__init__()
        self.temb = nn.Embedding(T_STEPS, 4)
        self.cin = nn.Conv2d(1, 4, 3, padding=1)
        self.norm = nn.GroupNorm(2, 4)
        self.down = nn.Conv2d(4, 4, 3, stride=2, padding=1)
        self.up = nn.Upsample(scale_factor=2, mode="nearest")
        self.upt = nn.ConvTranspose2d(4, 4, 2, stride=2)
        self.out = nn.Conv2d(8, 1, 3, padding=1)

    def forward(self, x):
        t = x[:, 1, 0, 0].round().long()
        h = self.cin(x[:, :1]) + self.temb(t)[:, :, None, None]
        h = F.silu(self.norm(h))
        d = F.silu(self.down(h))
        u = self.up(d) + self.upt(d)
        return self.out(torch.cat([u, h], dim=1)).flatten(1)


class Gen(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 8)
        self.convt = nn.ConvTranspose2d(2, 1, 4, stride=2, padding=1)

    def forward(self, z):
        return torch.tanh(self.convt(F.silu(self.lin(z)).reshape(-1, 2, 2, 2))).flatten(1)


class Disc(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 3, 3, stride=2, padding=1)
        self.lin = nn.Linear(12, 1)

    def forward(self, x):
        return self.lin(F.leaky_relu(self.conv(x.reshape(-1, 1, 4, 4)), 0.2).flatten(1))


# ------------------------------------------------------------------------- references
def jacobian(module, X):
    """(N, C, P) by one autograd pass per sample and output, each sample alone."""
    params = [p for p in module.parameters() if p.requires_grad]
    rows = []
    for i in range(len(X)):
        out = module(X[i : i + 1]).reshape(-1)
        rows.append(
            torch.stack(
                [
                    torch.cat(
                        [
                            g.reshape(-1)
                            for g in torch.autograd.grad(
                                out[c], params, retain_graph=True, allow_unused=False
                            )
                        ]
                    )
                    for c in range(out.numel())
                ]
            )
        )
    return torch.stack(rows).detach()


def path_jacobians(factory, traj, X):
    ref = factory().to(DT)
    Js, Fs = [], []
    for k in range(len(traj)):
        ref.load_state_dict(traj.state_dict(k), strict=False)
        Js.append(jacobian(ref, X))
        with torch.no_grad():
            Fs.append(ref(X))
    return Js, Fs


def kernel_rows(net, X, Js, lr=None):
    C = Js[-1].shape[1]
    full = torch.einsum("ncp,mdp->nmcd", Js[-1], Js[-1]).numpy()
    row = {
        "TK full": _rel(TangentKernel(net, output="full")(X), full),
        "TK trace": _rel(TangentKernel(net)(X), np.einsum("nmcc->nm", full) / C),
    }
    if lr is not None:
        path = sum(lr * torch.einsum("ncp,mdp->nmcd", J, J) for J in Js[:-1]).numpy()
        row["PK full"] = _rel(PathKernel(net, output="full")(X), path)
        row["PK trace"] = _rel(PathKernel(net)(X), np.einsum("nmcc->nm", path) / C)
    return row


def decompose_rows(net, X, f_final):
    res = net.decompose(X)
    recon = res.initial + res.contributions.sum(1) + res.regularization
    return {"decompose closure": _rel(recon, f_final), "decompose error": float(res.error)}


def fd_attribution(retrain, n_decl, query_out):
    """Central differences of ``retrain(u)`` (-> outputs to explain) in each ``u_i``."""
    cols = []
    for i in range(n_decl):
        vals = []
        for s in (1, -1):
            u = torch.ones(n_decl, dtype=DT)
            u[i] += s * EPS_FD
            vals.append(retrain(u))
        cols.append((vals[0] - vals[1]) / (2 * EPS_FD))
    return np.stack(cols, axis=1)


def ood_residual(J_train, J_query, rtol=1e-6):
    """THEORY.md's s(x) from dense Jacobians: ``1 - k^T (Theta + lam I)^-1 k / Theta(x, x)``
    with the trace kernel of ``vec J`` and ``lam = rtol^2 max_i Theta(x_i, x_i)``."""
    C = J_train.shape[1]
    A = J_train.reshape(len(J_train), -1).numpy()
    Q = J_query.reshape(len(J_query), -1).numpy()
    theta, k = A @ A.T / C, A @ Q.T / C
    lam = rtol**2 * np.diag(theta).max()
    quad = np.einsum("nq,nq->q", k, np.linalg.solve(theta + lam * np.eye(len(A)), k))
    return np.sqrt(np.clip(1 - quad / (np.einsum("qp,qp->q", Q, Q) / C), 0, None))


def routes(module, X):
    return [(r.name, r.type, r.route, r.reason) for r in layer_routes(module, X)]


def _supervised_rows(factory, init, net, X, train):
    """Routes, kernels (SGD lr 0.05), decompose, and the unrolled scores of output 5 at
    the first two declared inputs against FD of ``train(module, u)`` from ``init``."""
    module = factory().to(DT)
    row = {"routes": routes(module, X)}
    Js, Fs = path_jacobians(factory, net.trajectory_, X)
    row.update(kernel_rows(net, X.numpy(), Js, lr=0.05))
    row.update(decompose_rows(net, X.numpy(), Fs[-1].numpy()))
    q = X[:2]
    tau = np.asarray(net.attribute(q.numpy(), method="unrolled", output=5))

    def retrain(u):
        m = factory().to(DT)
        m.load_state_dict(init)
        train(m, u)
        with torch.no_grad():
            return m(q)[:, 5].numpy()

    row["attribute unrolled vs FD"] = _rel(tau, fd_attribution(retrain, ND, q))
    return row


# ------------------------------------------------------------------------------- VAE
def train_vae(module, data, draws, u=None, recorder=False, lr=0.05):
    """SGD; step t uses data[draws['idx'][t]] with noise draws['eps'][t]."""
    opt = torch.optim.SGD(module.parameters(), lr=lr)
    rec = PathRecorder(module, opt, n_samples=ND) if recorder else None
    X = torch.empty(ND, 18, dtype=DT)
    with rec if rec is not None else warnings.catch_warnings():
        for t in range(STEPS):
            x = data[draws["idx"][t]].flatten(1)
            inp = torch.cat([x, draws["eps"][t]], dim=1)
            decl = torch.arange(t * B, (t + 1) * B)
            X[decl] = inp
            opt.zero_grad()
            li = vae_loss(module(inp), x)
            (li.mean() if u is None else (u[decl] * li).sum() / u[decl].sum()).backward()
            if rec is not None:
                rec.set_batch(decl)
            opt.step()
    return rec, X


def vae_draws(seed=1):
    g = torch.Generator().manual_seed(seed)
    return {
        "idx": [torch.randint(N_DATA, (B,), generator=g) for _ in range(STEPS)],
        "eps": [torch.randn(B, 2, generator=g, dtype=DT) for _ in range(STEPS)],
    }


def check_vae():
    data = images(N_DATA, 0)
    draws = vae_draws()
    torch.manual_seed(0)
    module = VAE().to(DT)
    init = copy.deepcopy(module.state_dict())
    rec, X = train_vae(module, data, draws, recorder=True)
    Y = X[:, :16]
    net = rec.as_estimator(X.numpy(), Y.numpy(), loss=vae_loss)
    row = {"model": "VAE, eps declared as input"}
    row.update(_supervised_rows(VAE, init, net, X, lambda m, u: train_vae(m, data, draws, u)))
    return row


def check_vae_noise_inside():
    """The natural VAE: eps drawn in ``forward``; X is the data, loss as above."""
    data = images(N_DATA, 0)
    draws = vae_draws()
    torch.manual_seed(0)
    module = VAE(noise_inside=True).to(DT)
    opt = torch.optim.SGD(module.parameters(), lr=0.05)
    Xd = data.flatten(1)
    out = {"model": "VAE, eps drawn inside forward (not declared)"}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with PathRecorder(module, opt, n_samples=N_DATA) as rec:
            for t in range(STEPS):
                idx = draws["idx"][t]
                opt.zero_grad()
                vae_loss(
                    module(torch.cat([Xd[idx], torch.zeros(B, 2, dtype=DT)], 1)), Xd[idx]
                ).mean().backward()
                rec.set_batch(idx)
                opt.step()
        out["warnings while training"] = [str(w.message)[:200] for w in caught]
    Xin = torch.cat([Xd, torch.zeros(N_DATA, 2, dtype=DT)], 1).numpy()
    net = rec.as_estimator(Xin, Xd.numpy(), loss=vae_loss)
    for name, call in [
        ("tangent kernel", lambda: TangentKernel(net)(Xin[:3])),
        ("decompose", lambda: net.decompose(Xin[:2])),
        ("attribute unrolled", lambda: net.attribute(Xin[:2], method="unrolled", output=5)),
    ]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                a, b = call(), call()
                if name == "tangent kernel":
                    out[name] = {"two calls differ by": _rel(a, b)}
                elif name == "decompose":
                    out[name] = {
                        "error": float(a.error),
                        "closure": _rel(
                            a.initial + a.contributions.sum(1) + a.regularization, a.prediction
                        ),
                    }
                else:
                    out[name] = {
                        "replay_error": float(getattr(a, "replay_error", np.nan)),
                        "two calls differ by": _rel(a, b),
                    }
            except Exception as exc:
                out[name] = {"raised": f"{type(exc).__name__}: {str(exc)[:300]}"}
            out[name]["warnings"] = sorted(
                {f"{w.category.__name__}: {str(w.message)[:300]}" for w in caught}
            )
    return out


class Decoder(nn.Module):
    """The VAE's decoder alone (shares the VAE's layers): latents to images."""

    def __init__(self, vae):
        super().__init__()
        self.dec_in, self.dec = vae.dec_in, vae.dec

    def forward(self, z):
        return self.dec(F.silu(self.dec_in(z).reshape(-1, 2, 2, 2))).flatten(1)


def recon_loss(out, y):
    return 0.5 * (out - y).pow(2).sum(1)


def check_vae_decoder():
    """Generated samples: the decoder recorded on its own, each step's latents
    ``z_i = mu + sigma eps`` declared with the image as target (the KL term does not reach
    the decoder). One optimizer over the whole VAE is refused by a recorder of the
    decoder; two optimizers (encoder, decoder) train the same as one for SGD."""
    data = images(N_DATA, 0)
    draws = vae_draws()
    torch.manual_seed(0)
    vae = VAE().to(DT)
    dec = Decoder(vae)
    row = {"model": "VAE decoder at new latents (two optimizers)"}
    try:
        PathRecorder(dec, torch.optim.SGD(vae.parameters(), lr=0.05), n_samples=ND).close()
    except ValueError as exc:
        row["one optimizer"] = str(exc)
    opt_d = torch.optim.SGD(dec.parameters(), lr=0.05)
    opt_e = torch.optim.SGD(vae.enc.parameters(), lr=0.05)
    Zs, Ys = torch.empty(ND, 2, dtype=DT), torch.empty(ND, 16, dtype=DT)
    with PathRecorder(dec, opt_d, n_samples=ND) as rec:
        for t in range(STEPS):
            x = data[draws["idx"][t]].flatten(1)
            out = vae(torch.cat([x, draws["eps"][t]], 1))
            decl = torch.arange(t * B, (t + 1) * B)
            with torch.no_grad():
                Zs[decl] = out[:, 16:18] + torch.exp(0.5 * out[:, 18:20]) * draws["eps"][t]
            Ys[decl] = x
            opt_d.zero_grad(), opt_e.zero_grad()
            vae_loss(out, x).mean().backward()
            rec.set_batch(decl)
            opt_d.step(), opt_e.step()
    net = rec.as_estimator(Zs.numpy(), Ys.numpy(), loss=recon_loss)
    zq = torch.randn(4, 2, generator=torch.Generator().manual_seed(5), dtype=DT)
    row["routes"] = routes(dec, zq)
    Js, Fs = path_jacobians(lambda: Decoder(VAE()), rec.trajectory, zq)
    row.update(kernel_rows(net, zq.numpy(), Js, lr=0.05))
    row.update(decompose_rows(net, zq.numpy(), Fs[-1].numpy()))
    return row


# ------------------------------------------------------------------------------ DDPM
def ddpm_draws(seed=2):
    g = torch.Generator().manual_seed(seed)
    return {
        "idx": [torch.randint(N_DATA, (B,), generator=g) for _ in range(STEPS)],
        "t": [torch.randint(T_STEPS, (B,), generator=g) for _ in range(STEPS)],
        "noise": [torch.randn(B, 1, 4, 4, generator=g, dtype=DT) for _ in range(STEPS)],
    }


def ddpm_input(x0, t, noise):
    a = ABAR[t].reshape(-1, 1, 1, 1)
    xt = a.sqrt() * x0 + (1 - a).sqrt() * noise
    return torch.cat([xt, t.to(DT).reshape(-1, 1, 1, 1).expand(-1, 1, 4, 4)], dim=1)


def train_ddpm(module, data, draws, u=None, recorder=False, lr=0.05):
    opt = torch.optim.SGD(module.parameters(), lr=lr)
    rec = PathRecorder(module, opt, n_samples=ND) if recorder else None
    X, Y = torch.empty(ND, 2, 4, 4, dtype=DT), torch.empty(ND, 16, dtype=DT)
    with rec if rec is not None else warnings.catch_warnings():
        for t in range(STEPS):
            inp = ddpm_input(data[draws["idx"][t]], draws["t"][t], draws["noise"][t])
            target = draws["noise"][t].flatten(1)
            decl = torch.arange(t * B, (t + 1) * B)
            X[decl], Y[decl] = inp, target
            opt.zero_grad()
            li = 0.5 * (module(inp) - target).pow(2).mean(1)
            (li.mean() if u is None else (u[decl] * li).sum() / u[decl].sum()).backward()
            if rec is not None:
                rec.set_batch(decl)
            opt.step()
    return rec, X, Y


def check_ddpm():
    data = images(N_DATA, 0)
    draws = ddpm_draws()
    torch.manual_seed(0)
    module = Denoiser().to(DT)
    init = copy.deepcopy(module.state_dict())
    rec, X, Y = train_ddpm(module, data, draws, recorder=True)
    net = rec.as_estimator(X.numpy(), Y.numpy(), loss="squared_error")
    row = {
        "model": "DDPM tiny U-Net (Embedding t, GroupNorm, SiLU, Upsample, "
        "ConvTranspose2d, skip cat)"
    }
    row.update(_supervised_rows(Denoiser, init, net, X, lambda m, u: train_ddpm(m, data, draws, u)))
    return row


# ------------------------------------------------------------------------------- GAN
def pull(D, x):
    x = x.detach().requires_grad_(True)
    (r,) = torch.autograd.grad(F.softplus(-D(x)).sum(), x)
    return r


def linear_loss(out, r):
    return (out * r).sum(1)


def disc_loss(out, s):
    return F.softplus(-s * out).sum(1)


def train_gan(G, D, data, draws, recorder=False, u=None, fixed_r=None, lr=0.01):
    steps = len(draws["zg"])
    nd = steps * B
    """Alternating Adam steps. ``u`` weights the generator's declared draws; with
    ``fixed_r`` the generator trains on the recorded pulls (D frozen as data)."""
    opt_g = torch.optim.Adam(G.parameters(), lr=lr, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(D.parameters(), lr=lr, betas=(0.5, 0.999))
    rg = PathRecorder(G, opt_g, n_samples=nd) if recorder else None
    rd = PathRecorder(D, opt_d, n_samples=2 * nd) if recorder else None
    Z, R = torch.empty(nd, 2, dtype=DT), torch.empty(nd, 16, dtype=DT)
    XD, SD = torch.empty(2 * nd, 16, dtype=DT), torch.empty(2 * nd, 1, dtype=DT)
    for t in range(steps):
        real = data[draws["idx"][t]].flatten(1)
        with torch.no_grad():
            fake = G(draws["zd"][t])
        opt_d.zero_grad()
        (F.softplus(-D(real)) + F.softplus(D(fake))).mean().backward()
        dd = torch.arange(2 * t * B, 2 * (t + 1) * B)
        XD[dd], SD[dd] = (
            torch.cat([real, fake]),
            torch.cat([torch.ones(B, 1, dtype=DT), -torch.ones(B, 1, dtype=DT)]),
        )
        if rd is not None:
            rd.set_batch(dd, weights=torch.full((2 * B,), 1.0 / B, dtype=DT))
        opt_d.step()
        z = draws["zg"][t]
        decl = torch.arange(t * B, (t + 1) * B)
        r = pull(D, G(z)) if fixed_r is None else fixed_r[decl]
        Z[decl], R[decl] = z, r
        opt_g.zero_grad()
        if fixed_r is None and u is None:
            F.softplus(-D(G(z))).mean().backward()  # the user's own loss
        elif fixed_r is None:
            li = F.softplus(-D(G(z))).sum(1)
            ((u[decl] * li).sum() / u[decl].sum()).backward()
        else:
            li = linear_loss(G(z), r)
            ((u[decl] * li).sum() / u[decl].sum()).backward()
        if rg is not None:
            rg.set_batch(decl)
        opt_g.step()
    if rg is not None:
        rg.close(), rd.close()
    return rg, rd, Z, R, XD, SD


def gan_draws(seed=3, steps=STEPS):
    g = torch.Generator().manual_seed(seed)
    return {
        "idx": [torch.randint(N_DATA, (B,), generator=g) for _ in range(steps)],
        "zd": [torch.randn(B, 2, generator=g, dtype=DT) for _ in range(steps)],
        "zg": [torch.randn(B, 2, generator=g, dtype=DT) for _ in range(steps)],
    }


def check_gan_coupling(steps):
    """The generator's unrolled scores against FD of the coupled GAN (D reacting) and of
    the declared training (the recorded pulls held), over ``steps`` alternating steps."""
    data = images(N_DATA, 0)
    draws = gan_draws(steps=steps)
    torch.manual_seed(0)
    G, D = Gen().to(DT), Disc().to(DT)
    g0, d0 = copy.deepcopy(G.state_dict()), copy.deepcopy(D.state_dict())
    rg, rd, Z, R, XD, SD = train_gan(G, D, data, draws, recorder=True)
    net_g = rg.as_estimator(Z.numpy(), R.numpy(), loss=linear_loss)
    q = Z[:2]
    tau = np.asarray(net_g.attribute(q.numpy(), method="unrolled", output=5))

    def retrain(u, fixed):
        Gm, Dm = Gen().to(DT), Disc().to(DT)
        Gm.load_state_dict(g0), Dm.load_state_dict(d0)
        train_gan(Gm, Dm, data, draws, u=u, fixed_r=R if fixed else None)
        with torch.no_grad():
            return Gm(q)[:, 5].numpy()

    nd = steps * B
    fixed = fd_attribution(lambda u: retrain(u, True), nd, q)
    coupled = fd_attribution(lambda u: retrain(u, False), nd, q)
    return {
        "steps": steps,
        "vs declared FD": _rel(tau, fixed),
        "vs coupled FD": _rel(tau, coupled),
        "corr with coupled": float(np.corrcoef(tau.ravel(), coupled.ravel())[0, 1]),
    }


def check_gan():
    data = images(N_DATA, 0)
    draws = gan_draws()
    torch.manual_seed(0)
    G, D = Gen().to(DT), Disc().to(DT)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rg, rd, Z, R, XD, SD = train_gan(G, D, data, draws, recorder=True)
    net_g = rg.as_estimator(Z.numpy(), R.numpy(), loss=linear_loss)
    net_d = rd.as_estimator(XD.numpy(), SD.numpy(), loss=disc_loss)
    rows = []
    row = {
        "model": "GAN generator (Adam), declared (z, r), linear loss",
        "routes": routes(G, Z),
        "warnings while training": sorted({str(w.message)[:200] for w in caught}),
    }
    Js, Fs = path_jacobians(Gen, rg.trajectory, Z)
    row.update(kernel_rows(net_g, Z.numpy(), Js))
    row.update(decompose_rows(net_g, Z.numpy(), Fs[-1].numpy()))
    # The unrolled scores of this path: check_gan_coupling(STEPS), the same draws.
    # OOD on latent inputs: in-distribution z vs far z, residual against THEORY's s(x).
    det = OODRankDetector(FrozenEstimator(net_g), method="residual").fit(Z.numpy())
    gq = torch.Generator().manual_seed(9)
    zq = torch.cat(
        [torch.randn(4, 2, generator=gq, dtype=DT), 6 * torch.randn(4, 2, generator=gq, dtype=DT)]
    )
    ref_res = ood_residual(Js[-1], jacobian(G, zq))
    row["OOD residual vs dense s(x)"] = float(
        np.abs(-det.score_samples(zq.numpy()) - ref_res).max()
    )
    row["OOD residuals (in, far)"] = [np.round(ref_res, 4).tolist()]
    rows.append(row)

    row = {"model": "GAN discriminator (Adam), real and fake, weights 1/B", "routes": routes(D, XD)}
    Js, Fs = path_jacobians(Disc, rd.trajectory, XD)
    row.update(kernel_rows(net_d, XD.numpy(), Js))
    row.update(decompose_rows(net_d, XD.numpy(), Fs[-1].numpy()))
    rows.append(row)
    return rows


class UNet(nn.Module):
    """The denoiser above at a size worth timing (float32, ``c`` channels)."""

    def __init__(s, c=16):
        super().__init__()
        s.temb = nn.Embedding(T_STEPS, c)
        s.cin = nn.Conv2d(1, c, 3, padding=1)
        s.norm = nn.GroupNorm(4, c)
        s.down = nn.Conv2d(c, c, 3, stride=2, padding=1)
        s.norm2 = nn.GroupNorm(4, c)
        s.up = nn.Upsample(scale_factor=2)
        s.upt = nn.ConvTranspose2d(c, c, 2, stride=2)
        s.out = nn.Conv2d(2 * c, 1, 3, padding=1)

    def forward(s, x):
        t = x[:, 1, 0, 0].round().long()
        h = F.silu(s.norm(s.cin(x[:, :1]) + s.temb(t)[:, :, None, None]))
        d = F.silu(s.norm2(s.down(h)))
        return s.out(torch.cat([s.up(d) + s.upt(d), h], 1)).flatten(1)


def bench(N, H, output, reps=5):
    """float32 tangent kernel of a U-Net with c=16 channels: TangentKernel against
    torch.func's vmap(jacrev) J J^T, alternated, CPU time of this thread, medians."""
    torch.manual_seed(0)
    m = UNet()
    opt = torch.optim.SGD(m.parameters(), lr=1e-3)
    X = torch.cat(
        [torch.randn(N, 1, H, H), torch.randint(T_STEPS, (N, 1, 1, 1)).float().expand(N, 1, H, H)],
        1,
    )
    Y = torch.randn(N, H * H)
    with PathRecorder(m, opt, n_samples=N) as rec:
        opt.zero_grad()
        (0.5 * (m(X) - Y).pow(2).mean()).backward()
        rec.set_batch(np.arange(N))
        opt.step()
    net = rec.as_estimator(X.numpy(), Y.numpy())
    params = {k: v.detach() for k, v in m.named_parameters()}

    def peer():
        J = vmap(jacrev(lambda p, x: functional_call(m, p, (x[None],))[0]), (None, 0))(params, X)
        J = torch.cat([j.reshape(N, H * H, -1) for j in J.values()], 2)
        if output == "trace":
            return (torch.einsum("ncp,mcp->nm", J, J) / (H * H)).numpy()
        return torch.einsum("ncp,mdp->nmcd", J, J).numpy()

    def ours():
        return TangentKernel(net, output=output)(X.numpy())

    a, b = ours(), peer()
    err = np.abs(a - b).max() / np.abs(b).max()
    ta, tb = [], []
    for _ in range(reps):
        t0 = time.thread_time()
        ours()
        ta.append(time.thread_time() - t0)
        t0 = time.thread_time()
        peer()
        tb.append(time.thread_time() - t0)
    row = (
        f"| U-Net c=16, {H}x{H}, N={N}, {output} | {np.median(tb):.3f} | "
        f"{np.median(ta):.3f} | {np.median(tb) / np.median(ta):.2f} | {err:.1e} |"
    )
    print(row, flush=True)
    return row


def speed():
    torch.set_num_threads(1)
    rows = [
        "| case | vmap(jacrev) J J^T (s) | TangentKernel (s) | peer / ours | rel. diff |",
        "|---|---|---|---|---|",
    ]
    for n, h, o in [(64, 8, "trace"), (128, 8, "trace"), (32, 8, "full"), (64, 16, "trace")]:
        rows.append(bench(n, h, o))
    return rows


COLUMNS = [
    "TK full",
    "TK trace",
    "PK full",
    "PK trace",
    "decompose closure",
    "decompose error",
    "attribute unrolled vs FD",
    "attribute unrolled vs coupled-GAN FD",
    "OOD residual vs dense s(x)",
]


def main():
    if sys.argv[1:] == ["--speed"]:
        print("\n".join(speed()))
        return
    torch.set_num_threads(1)
    out = (
        Path(sys.argv[1])
        if len(sys.argv) > 1
        else (ROOT / "benchmarks" / "results" / "user_trial_generative-s53.json")
    )
    rows = []
    start = time.time()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for fn in (check_vae, check_vae_decoder, check_ddpm):
            rows.append(fn())
            print({k: v for k, v in rows[-1].items() if k in COLUMNS}, flush=True)
        rows.extend(check_gan())
        probe = check_vae_noise_inside()
        coupling = [check_gan_coupling(s) for s in (STEPS, 16, 48)]
        gen_row = next(r for r in rows if r["model"].startswith("GAN generator"))
        gen_row["attribute unrolled vs FD"] = coupling[0]["vs declared FD"]
        gen_row["attribute unrolled vs coupled-GAN FD"] = coupling[0]["vs coupled FD"]
        print(coupling, flush=True)
    warned = sorted({f"{w.category.__name__}: {str(w.message)[:200]}" for w in caught})
    out.write_text(
        json.dumps(
            dict(
                rows=rows,
                noise_inside=probe,
                gan_coupling=coupling,
                warnings=warned,
                seconds=time.time() - start,
            ),
            indent=1,
            default=str,
        )
    )
    print("| model | " + " | ".join(COLUMNS) + " |")
    print("|---|" + "---|" * len(COLUMNS))
    for r in rows:
        print(
            f"| {r['model']} | "
            + " | ".join(f"{r[k]:.1e}" if k in r else "-" for k in COLUMNS)
            + " |"
        )
        for name, t, route, why in r["routes"]:
            print(f"    {name} {t} {route} {why or ''}")
    print(json.dumps(probe, indent=1))
    for w in warned:
        print("-", w)


if __name__ == "__main__":
    main()
