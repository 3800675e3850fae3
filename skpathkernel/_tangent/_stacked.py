"""Path kernels of a plain MLP over blocks of recorded points at once.

The path kernel ``sum_k w_k J_k(x) D_k J_k(y)^T`` of a small network spends its time on
work repeated at every point when the points are taken one at a time (a capture, a
routing plan, a dozen small GEMMs, each a few microseconds of arithmetic behind tens of
microseconds of Python). For an ``nn.Sequential`` of ``nn.Linear`` layers and
elementwise activations (the estimators' default network), this module stacks the
parameters of ``B`` recorded points and runs one forward and one backward over the block
(batched GEMMs over the points), which gives every layer's inputs ``a`` (with a 1 for
the bias) and backprops ``delta_c`` for all points and outputs at once.

Each layer's step kernel is then contracted by one of four routes; with ``N x M`` the
panel of the Gram, ``q = d_in + 1``, ``p = d_out`` and ``C`` the outputs used, per point:

``"onehot"`` (an output layer with no activation after it): its backprops are one-hot,
    so their products over the outputs are constant and the layer's kernel is
    ``A diag(s) A'^T`` with ``s`` the weighted preconditioner summed over the outputs'
    rows: ``2 N M q`` FLOPs, one GEMM over the whole block of points.
``"rank1"`` (no preconditioner): ``(A A'^T) * (Delta Delta'^T)``, ``2 N M (q + C p)``
    FLOPs in two batched GEMMs over the block and one weighted elementwise sum.
``"units"`` (diagonal ``D``): ``sum_o (Delta_o Delta_o'^T) * (A D_o A'^T)`` over the
    output units ``o``, ``2 N M p (q + C)`` FLOPs: ``A D_o A'^T`` of all units in one GEMM
    (the scaled rows of all units stacked), the ``C``-wide ``Delta_o`` products batched
    over units, and an elementwise product summed over the units (one product with
    ones), whose passes over memory are what bounds it. With one backprop (``C = 1``)
    the product ``Delta_o Delta_o'^T`` is an outer product: rows and columns are scaled
    instead. Its products are written into reused buffers (fresh ones of that size cost
    page faults comparable to the GEMMs).
``"dense"`` (diagonal ``D``): the per-sample gradients ``delta_c (x) a`` formed once per
    block of points for the whole Gram, scaled by ``sqrt(w D)`` on both sides of a
    symmetric Gram (``w D`` on one side where a weight is negative), and one GEMM per
    panel whose inner dimension runs over all the block's points: ``2 N M C p q``
    FLOPs, plus forming ``(N + M) C p q`` per point.

The layer right below a one-hot output layer backprops row ``c`` of that layer's
weights ``V`` times the same derivatives for every output: its products over the
outputs are those of a single backprop ``|V_o| d_o``, so it is contracted with
``C = 1`` (ten times fewer FLOPs than ``C = 10`` for SGD, and no ``Delta`` products).

:func:`layer_route` compares ``flops + 8 * element passes`` (one pass over memory costs
about eight FLOPs of a GEMM on the CPUs measured). The outcome on the default classifier
(64-64-10 GELU, ten outputs): the first layer takes ``"units"`` (ten times fewer FLOPs
than forming its per-sample gradients), the second (one backprop) ``"dense"`` at
N = 1000 (its formed gradients shared by all pairs) and ``"units"`` at N = 100, the
output layer ``"onehot"``. Unweighted steps (SGD) take
``"rank1"``, which is never more work.

A symmetric ``K(X, X)`` is computed in strips of 16 to 64 rows from the diagonal
rightwards (its upper triangle plus ``N * strip / 2`` entries, against ``5/8 N^2`` for
square 256-row panels at N = 1000 and all ``N^2`` at N <= 256) and mirrored; the squares
on the diagonal are symmetrised exactly. The trace's strips run to the last column (one
panel per strip: no narrow remainders, and the "units" route's calls cover whole rows),
and its "dense" layers are contracted apart (:func:`_dense_strips`): one point's
gradients at a time, formed right before 256-row strips read them from cache (the
strips' squares on the diagonal halved down to 64 rows), where the block's formed at
once would be written to memory and read back by every strip (at N = 1000, 8 points, in
128-row strips: 0.48 s against 0.54 s, and the forming 0.04 s against 0.10 s). The
block of points ``B`` and the panels are sized from ``memory_budget``.

On the CPU with torch on one thread, SciPy's BLAS (OpenBLAS, limited to one thread for
the call) takes up to two of these products: a "dense" layer's Gram is one SYRK, which
computes the upper triangle alone (:func:`_syrk`), and, except on an Intel CPU with
torch's MKL (:func:`_units_scipy`), the "units" route's ``A D_o A'^T`` and ``Delta_o
Delta_o'^T`` of panels of at least ``_BLAS_MIN`` entries are its GEMMs (:func:`_units`).
On an AMD EPYC at N = 1000 (8 points of the default classifier, one thread) the dense
layer took 0.38 s against torch's 0.48 s in strips, and the whole block 8-9% less time;
on an Intel Xeon the SYRK still wins (46 ms against 58 ms for one point's strips, by
hand) but SciPy's GEMMs lose on the "units" route (its strips 1.4x slower by hand,
``benchmarks/results/path.md``; the default classifier's first 21 points at N = 1000
1.1-1.2x, ``benchmarks/results/units_blas_ab.md``); at N = 100 the route is unchanged.
Torch's products stay on CUDA, with several torch threads (where both libraries' waiting
threads contend for the cores) and where SciPy's BLAS is not an OpenBLAS whose thread
limit is process-wide (its "pthreads" threading layer: an OpenMP layer, MKL or BLIS may
hold a limit per thread; :func:`_blas_process_wide`). One call at a time takes that
route, its thread setting and restoring the limit; a call that overlaps it from another
thread keeps torch's products (:func:`_blas_threads`). While it runs, NumPy's and
SciPy's BLAS calls from the process's other threads are held to one thread too. Every
block's sum is added to a float64 Gram, so the result equals the point-by-point sum to
float rounding.

``full=True`` gives the ``C x C`` blocks of the outputs instead of their trace. A
one-hot output layer's blocks are diagonal, ``A diag(w D_c) A'^T`` for output ``c`` (one
GEMM for all outputs, :func:`_onehot_full`). The layer below it (``"mixed"``) keeps its
single backprop ``m_o = |V_o| d_o``: its blocks are ``sum_o m_xo m_yo (A D_o A'^T)``
times ``Vh_o Vh_o^T`` (``Vh_o = V_o / |V_o|``), symmetric in the outputs, so each unit's
product is spread over the ``C (C + 1) / 2`` upper entries by one GEMM over the units
(:func:`_units`; without ``D``, one GEMM per point of the backprops scaled by those
entries, :func:`_mixed_rank1`): ``2 N M p (q + C (C + 1) / 2)`` FLOPs where the trace
needs ``2 N M p (q + 1)``. Other layers keep their ``C`` backprops: ``"rank1"`` without
a preconditioner and ``"units"`` with one (:func:`_units_full`, ``2 N M C^2`` FLOPs per
unit). A symmetric one's panels are mirrored as they are added. With one hidden layer
and no preconditioner (SGD) every block is symmetric in the outputs and the layers'
terms are written together tile by tile (:func:`_tiles_full`): the ``C (C + 1) / 2``
entries of a tile summed over the points in cache, then ``K`` written once, both
triangles, with no zero fill and no pass that adds panels or mirrors them.

What the full blocks cost against the trace, with SGD and one hidden layer: the
trace's layer below the output has one backprop, ``2 N M (q + p)`` FLOPs, where the
blocks need ``2 N M (q + p C (C + 1) / 2)``; with the output layer (``2 N M q`` each)
that is about 19 times the trace's FLOPs for the 64-64-10 classifier, more than ``C``,
so at large ``N`` (where both are GEMM-bound) the blocks take more than ``C`` traces.
Writing the ``(N, M, C, C)`` float64 result (52 MB at N = 256, C = 10; 4 ms at
13 GB/s, 6-7 ms with the page faults of fresh memory) is about one trace at N = 256.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import sys
import threading
from collections.abc import Callable, Sequence

import scipy
import torch
from scipy.linalg import blas
from threadpoolctl import ThreadpoolController
from torch import nn
from torch.nn.modules import module as torch_module

from .._checkpoint import functional_call
from .._device import forward_input
from .._memory import large_tensor, rows_per_block

__all__ = ["StackedMLP", "stacked_mlp", "stacked_path_sum", "layer_route", "path_flops"]

# Elementwise activations: their derivative is the gradient of their sum, one autograd
# call per block. (Exact types: a subclass may override forward with anything.)
_ELEMENTWISE = (nn.Tanh, nn.ReLU, nn.GELU, nn.Sigmoid, nn.SiLU, nn.ELU, nn.LeakyReLU,
                nn.Softplus, nn.Identity, nn.Mish, nn.Hardtanh)

# One pass of an elementwise operation over an element, in GEMM FLOPs (the route's
# cost model: ``flops + _PASS * element passes``).
_PASS = 8

# Rows of the Gram's panels: the "units" route's product of one panel over a chunk of
# units stays in cache at 256 x 256 (about 2x faster per point than whole 1000-row
# panels at N = 1000 on the CPUs measured).
_PANEL = 256

# Where the products are launch-bound (:func:`_launch_bound`, a GPU): the most rows and
# columns of a panel, and of a symmetric Gram's strips (a quarter of the rows up to it;
# at N = 1000 strips of 250 rows compute 25% more than the triangle, in 4 panels per
# point and layer where 64-row strips took 16).
_GPU_PANEL = 2048
_GPU_STRIP = 512
# The share of the budget (1 / _GPU_SHARE) that one point's panel products, and a chunk
# of units, take at most there: a block then holds several points.
_GPU_SHARE = 16

# Bytes of one chunk of the "units" route's products: a few times a core's L2 cache,
# within L3 (7 units of a 64 x 1000 strip; 4 to 8 units measured alike at N = 1000, 16
# slower, and fewer units per chunk issue more calls).
_CACHE = 2**22

# Rows of the strips of a symmetric trace's "dense" layers (:func:`_dense_strips`), and
# of the squares on the diagonal that they compute whole: at N = 1000, 8 points, 256 and
# 64 took 6% less time than strips of 128 rows computed to the diagonal's squares (whose
# 13% of work below the diagonal outweighed the narrower GEMMs' slower rate; squares of
# 32 rows were slower than 64).
_DENSE_STRIP = 256
_DENSE_LEAF = 64

# Entries of a product from which SciPy's BLAS takes it on the CPU: a unit's panel
# product in the "units" route (:func:`_units`, where :func:`_units_scipy`; on the AMD
# EPYC at N = 1000, 64-row strips of 512-1000 columns took 5-10% less time per chunk
# than torch's products, at 128 columns alike,
# and at N = 100, 25 x 100 panels, the calls made the route 7% slower) and the "dense"
# layers' Gram (:func:`_dense_strips`; N >= 128). Smaller kernels keep torch's products
# and their rounding on one thread and on several.
_BLAS_MIN = 64 * 256


def _cpu_vendor(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's vendor ("GenuineIntel", "AuthenticAMD", ...), "" where unknown."""
    with contextlib.suppress(OSError), open(cpuinfo) as f:
        for line in f:
            if line.startswith("vendor_id"):
                return line.partition(":")[2].strip()
    if sys.platform == "win32":
        # ("AMD64 Family 25 Model 33 Stepping 0, AuthenticAMD"; elsewhere no source that
        # needs no subprocess names it.)
        return os.environ.get("PROCESSOR_IDENTIFIER", "").rpartition(",")[2].strip()
    return ""


def _units_scipy(vendor: str, mkl: bool) -> bool:
    """Whether SciPy's GEMMs (OpenBLAS) take the trace's "units" panels (:func:`_units`)
    where they may (:func:`_cpu_gemm`): everywhere but on an Intel CPU with torch's MKL,
    the one case measured where torch's products win.

    One thread, the route's 64-row strips at N = 1000: on an AMD EPYC (Zen 4) a chunk of
    7 units of 1000 columns took 670 + 202 us by SciPy's GEMMs against 735 + 260 us by
    torch's (MKL); on an Intel Xeon (AVX-512) 8 points' strip took 109 ms against 77 ms
    (both by hand, ``benchmarks/results/path.md``), and the default classifier's first 21
    points at N = 1000 1.14-1.20x and its ``kneighbors(kernel="path")`` 1.34-1.38x longer
    by SciPy's (``benchmarks/results/units_blas_ab.md``). Other CPUs and torch builds without MKL
    were not measured: they keep SciPy's GEMMs, chosen first. The "dense" layers' SYRK
    keeps SciPy's BLAS everywhere (torch has none; its strips of GEMMs were slower on
    both CPUs), and so do the full blocks' "mixed" panels (0.89-1.04x on the Intel Xeon, by
    hand).
    """
    return not (mkl and vendor == "GenuineIntel")


_UNITS_SCIPY = _units_scipy(_cpu_vendor(), torch.backends.mkl.is_available())

# Most units per chunk of the full blocks' "units" route: the inner dimension of its
# batched GEMMs.
_FULL_CHUNK = 64

# Rows and columns of the tiles of :func:`_tiles_full`.
_TILE = 64


@dataclasses.dataclass(frozen=True)
class _Linear:
    weight: str
    bias: str | None
    d_in: int
    d_out: int


@dataclasses.dataclass(frozen=True)
class StackedMLP:
    """The layers of an ``nn.Sequential`` MLP: ``_Linear`` records and activation modules."""

    items: tuple
    n_inputs: int

    @property
    def linears(self) -> list[_Linear]:
        return [it for it in self.items if isinstance(it, _Linear)]


def _hooked(m: nn.Module) -> bool:
    return bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks
                or getattr(m, "_backward_pre_hooks", None) or "forward" in m.__dict__)


def _global_hooks() -> bool:
    return any(getattr(torch_module, name, None) for name in (
        "_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
        "_global_backward_pre_hooks"))


def stacked_mlp(module: nn.Module, names: Sequence[str]) -> StackedMLP | None:
    """The module as a :class:`StackedMLP`, or None when it is anything else.

    ``names``: the parameters in flat (trajectory) order, which must be exactly the
    Linear layers' weights and biases. Only exact ``nn.Sequential`` / ``nn.Linear`` /
    activation types without hooks or a patched ``forward`` qualify: anything that could
    compute something else than the layers' own operations takes the general engine.
    """
    if type(module) is not nn.Sequential or _hooked(module) or _global_hooks():
        return None
    items, seen = [], []
    # named_children() lists a module used twice once: a Sequential that reuses an
    # activation or a Linear would be read as another network.
    children = list(module._modules.items())
    if len({id(child) for _, child in children}) != len(children):
        return None
    for prefix, child in children:
        if child is None or _hooked(child):
            return None
        if type(child) is nn.Linear:
            bias = None if child.bias is None else f"{prefix}.bias"
            items.append(_Linear(f"{prefix}.weight", bias, child.in_features,
                                 child.out_features))
            seen += [f"{prefix}.weight"] + ([] if bias is None else [bias])
        elif type(child) in _ELEMENTWISE and not list(child.parameters()):
            items.append(child)
        else:
            return None
    linears = [it for it in items if isinstance(it, _Linear)]
    if not linears or sorted(seen) != sorted(names) or len(set(seen)) != len(seen):
        return None
    return StackedMLP(tuple(items), linears[0].d_in)


def layer_route(n_outputs: int, d_in: int, d_out: int, weighted: bool, bias: bool = True,
                rows: int = _PANEL, cols: int = _PANEL) -> str:
    """``"rank1"``, ``"units"`` or ``"dense"`` for one Linear layer (see the module).

    ``rows`` and ``cols``: the Gram's rows and columns, over which the "dense" route's
    gradients, formed once per block of points, are shared.
    """
    if not weighted:
        return "rank1"
    q, p, C = d_in + bias, d_out, n_outputs
    # One output: no products of backprops, only the scaling of rows and columns.
    units = 2 * p * q + _PASS * 2 * p if C == 1 else 2 * p * (q + C) + _PASS * 6 * p
    # Forming both sides: about three passes per element.
    dense = 2 * C * p * q + _PASS * (2 + 3 * C * p * q * (1 / rows + 1 / cols))
    return "dense" if dense <= units else "units"


def path_flops(mlp: StackedMLP, n: int, m: int, n_outputs: int, weighted: bool,
               symmetric: bool) -> float:
    """The FLOP floor of one point's Gram by the cheapest exact route, per layer.

    ``rank1``: ``2 n m (q + C p)``; weighted: ``2 n m p min(q + C, C q)``; an output
    layer with one-hot backprops ``2 n m q``, and the layer below it counts one output
    (:func:`_factors`). Halved for a symmetric Gram. The forward and backward passes
    (``O((n + m) P C)``) are not counted.
    """
    total, routes = 0.0, _routes(mlp, n_outputs, weighted, n, m)
    for lin, route, C in zip(mlp.linears, routes, _outputs_per_layer(mlp, n_outputs)):
        q, p = lin.d_in + (lin.bias is not None), lin.d_out
        if route == "onehot":
            total += 2 * n * m * q
        else:
            total += 2 * n * m * (p * min(q + C, C * q) if weighted else q + C * p)
    return total / 2 if symmetric else total


def _outputs_per_layer(mlp: StackedMLP, n_outputs: int) -> list[int]:
    """The backprops per sample of every Linear: one below a one-hot output layer."""
    n = len(mlp.linears)
    onehot = isinstance(mlp.items[-1], _Linear)
    return [1 if onehot and li == n - 2 else n_outputs for li in range(n)]


# --------------------------------------------------------------------------- factors
def _layer_params(mlp: StackedMLP, theta: torch.Tensor, layout: dict) -> list[tuple]:
    """(W (B, p, d_in), b (B, p) or None) of every Linear, views of ``theta`` (B, P)."""
    out = []
    for lin in mlp.linears:
        s, size = layout[lin.weight]
        W = theta[:, s : s + size].view(-1, lin.d_out, lin.d_in)
        b = None
        if lin.bias is not None:
            s, size = layout[lin.bias]
            b = theta[:, s : s + size]
        out.append((W, b))
    return out


# The derivative of an activation by the kernel its autograd backward calls, seeded with
# ones: the same numbers without building a graph (the autograd call's set-up was 13% of
# ``attribute`` on the default classifier). Keyed by exact type; ``of_output`` says whether
# the kernel reads the activation's output (else its input, read before an in-place
# activation overwrites it).
_aten = torch.ops.aten
_BACKWARD = {
    nn.Tanh: (True, lambda a, g, h: _aten.tanh_backward(g, h)),
    nn.Sigmoid: (True, lambda a, g, h: _aten.sigmoid_backward(g, h)),
    nn.ReLU: (True, lambda a, g, h: _aten.threshold_backward(g, h, 0)),
    nn.GELU: (False, lambda a, g, z: _aten.gelu_backward(g, z, approximate=a.approximate)),
    nn.Softplus: (False, lambda a, g, z: _aten.softplus_backward(g, z, a.beta, a.threshold)),
    nn.SiLU: (False, lambda a, g, z: _aten.silu_backward(g, z)),
    nn.Mish: (False, lambda a, g, z: _aten.mish_backward(g, z)),
    # Of the input, as autograd calls them without ``inplace`` (with it, autograd reads
    # the output: other roundings for ELU).
    nn.ELU: (False, lambda a, g, z: _aten.elu_backward(g, a.alpha, 1, 1, False, z)),
    nn.LeakyReLU: (False, lambda a, g, z: _aten.leaky_relu_backward(
        g, z, a.negative_slope, False)),
    nn.Hardtanh: (False, lambda a, g, z: _aten.hardtanh_backward(g, z, a.min_val, a.max_val)),
}


def _derivative(act: nn.Module, z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``act(z)`` and its elementwise derivative at ``z``."""
    if type(act) is nn.Identity:
        return z, torch.ones_like(z)
    kernel = _BACKWARD.get(type(act))
    if kernel is not None:
        of_output, backward = kernel
        ones = torch.ones_like(z)
        if of_output:
            h = act(z)
            return h, backward(act, ones, h)
        d = backward(act, ones, z)
        return act(z), d
    with torch.enable_grad():
        z = z.detach().requires_grad_(True)
        # An in-place activation may not overwrite a leaf that requires grad: a copy.
        h = act(z.clone() if getattr(act, "inplace", False) else z)
        (d,) = torch.autograd.grad(h, z, torch.ones_like(h))
    return h.detach(), d


def _first_input(mlp: StackedMLP, X: torch.Tensor) -> torch.Tensor:
    """``X`` as (1, N, d_in); a copy where an activation comes before the first Linear,
    which in place would overwrite the caller's inputs."""
    h = X.unsqueeze(0)
    return h if isinstance(mlp.items[0], _Linear) else h.clone()


def forward_factors(mlp: StackedMLP, theta: torch.Tensor, layout: dict,
                    X: torch.Tensor) -> tuple[torch.Tensor, list, list, list]:
    """One forward pass over the block's points (batched GEMMs): the outputs (B, N, C),
    every Linear's parameters (:func:`_layer_params`), every Linear's inputs (B, N, d_in;
    the first layer's are ``X`` (1, N, d_in), shared by the points) and, per item of
    ``mlp.items``, None for a Linear or the activation's derivative (B, N, d)."""
    params = _layer_params(mlp, theta, layout)
    h, inputs, derivs, li = _first_input(mlp, X), [], [], 0
    for it in mlp.items:
        if isinstance(it, _Linear):
            W, b = params[li]
            li += 1
            inputs.append(h)
            h = torch.matmul(h, W.transpose(1, 2))
            if b is not None:
                h = h + b[:, None, :]
            derivs.append(None)
        else:
            h, d = _derivative(it, h)
            derivs.append(d)
    return h, params, inputs, derivs


def _factors(mlp: StackedMLP, theta: torch.Tensor, layout: dict, X: torch.Tensor,
             outputs: Sequence[int], units_major: bool, scratch: _Scratch | None = None,
             side: str = "x") -> list[tuple]:
    """Every Linear's inputs ``a`` (B, N, d_in) and backprops, by one forward and one
    backward pass over the block's points (batched GEMMs).

    The backprops are (B, N, C, d_out), or (B, d_out, N, C) with ``units_major`` (the
    layout of the "units" route's per-unit products, so that no copy reorders them; a
    backprop written by a GEMM is stored (B, d_out, C, N), and viewed so).
    An output layer with no activation after it has one-hot backprops, which carry no
    information: its entry is None and :func:`_onehot` contracts it. The layer below it
    then backprops row ``c`` of the output layer's weights ``V`` times the same
    derivatives ``d`` for every output, so that its products over the outputs,
    ``sum_c V_co^2 d_xo d_yo``, are those of one backprop, ``|V_o| d_o``: its entry is
    that single one (C = 1); the ``C x C`` blocks spread it over the outputs again
    (:func:`_units`).

    The backprops that GEMMs write go to ``scratch``'s buffers (named by ``side`` and
    layer) where given: at tens of MB per block, fresh memory's page faults cost about
    as much as the GEMM (21 points at N = 1000: 57 against 31 ms).
    """
    h, params, inputs, raw = forward_factors(mlp, theta, layout, X)
    B = theta.shape[0]
    inputs = [a.expand(B, *a.shape[1:]) for a in inputs]
    # (B, N, d) as the layout's broadcast factor of the backprops.
    derivs = [d if d is None else d.transpose(1, 2).contiguous().unsqueeze(3)
              if units_major else d.unsqueeze(2) for d in raw]
    n, C = X.shape[0], len(outputs)
    sel = torch.as_tensor(list(outputs), device=h.device)

    def onehot() -> torch.Tensor:
        eye = torch.zeros(C, h.shape[-1], dtype=h.dtype, device=h.device)
        eye[torch.arange(C), sel] = 1
        delta = (eye.T[None, :, None, :] if units_major else eye[None, None])
        return delta.expand(B, *((-1, n, -1) if units_major else (n, -1, -1)))

    # The backprop below a one-hot output layer is kept factored, ``Wc`` (B, C, d) times
    # the derivatives met since, ``dprod`` (B, N, d): the next Linear's backprop
    # ``sum_r dprod_r Wc_cr W_r`` is then one GEMM of ``dprod`` against ``Wc_cr W_r``
    # (B, d, C d_in), the same FLOPs as forming ``Wc * dprod`` (B p N C numbers written
    # and read back) and multiplying it by ``W``. The units-major backprops are stored
    # (B, p, C, N), the layout that GEMM writes, and viewed as (B, p, N, C); a backprop
    # a GEMM wrote is multiplied by the derivatives in place (``owned``).
    delta, factored, owned = None, None, False
    merged, deltas, li = None, [], len(params)

    def product(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        """``a @ b`` (batched), into the layer's reused buffer where there is one."""
        if scratch is None:
            return torch.matmul(a, b)
        shape = (*a.shape[:-1], b.shape[-1])
        return torch.matmul(a, b, out=scratch.get(f"delta_{side}{li}", shape, a.dtype))

    for it, d, d_raw in zip(reversed(mlp.items), reversed(derivs), reversed(raw)):
        if not isinstance(it, _Linear):
            if factored is not None:
                Wc, dprod = factored
                factored = (Wc, d_raw if dprod is None else dprod * d_raw)
            else:
                if delta is None:  # an activation after the output layer: one-hot rows
                    delta = onehot()
                delta = delta.mul_(d) if owned else delta * d
                owned = True
            if merged is not None:
                merged = merged * d
            continue
        li -= 1
        deltas.append(delta if merged is None else merged)
        merged = None
        if li == 0:  # the first layer's inputs need no backprop
            break
        W = params[li][0]
        if delta is None and factored is None:
            # One-hot: the backprop is the outputs' rows of W.
            Wc = W.index_select(1, sel)                              # (B, C, d_in)
            norm = Wc.square().sum(1).sqrt_()                        # (B, d_in)
            if units_major:
                merged = norm[:, :, None, None].expand(-1, -1, n, 1)
            else:
                merged = norm[:, None, None, :].expand(-1, n, 1, -1)
            factored = (Wc, None)
            continue
        if factored is not None:
            Wc, dprod = factored
            factored = None
            if dprod is None:  # no activation in between: the same rows for every sample
                rows = torch.matmul(Wc, W)                           # (B, C, d_in)
                delta = (rows.transpose(1, 2)[:, :, None, :].expand(-1, -1, n, -1)
                         if units_major else rows[:, None].expand(-1, n, -1, -1))
                owned = False
                continue
            if units_major:
                U = W.transpose(1, 2)[:, :, None, :] * Wc[:, None, :, :]  # (B, d_in, C, d)
                delta = product(U.reshape(B, it.d_in * C, it.d_out), dprod.transpose(1, 2))
            else:
                U = Wc.transpose(1, 2)[:, :, :, None] * W[:, :, None, :]  # (B, d, C, d_in)
                delta = product(dprod, U.reshape(B, it.d_out, C * it.d_in))
        elif units_major:
            delta = product(W.transpose(1, 2), delta.transpose(2, 3).reshape(B, it.d_out, C * n))
        else:
            delta = product(delta.reshape(B, n * C, it.d_out), W)
        delta = (delta.view(B, it.d_in, C, n).transpose(2, 3) if units_major
                 else delta.view(B, n, C, it.d_in))
        owned = True
    return list(zip(inputs, reversed(deltas)))


# Activations whose forward writes into a given buffer (in place over its input) by the
# aten op their module calls, and whose derivative reads their output only: the
# backprop through them is then written in place too (``grad_input=`` the gradient).
# Others are applied by their module (a fresh output) and differentiated by
# :data:`_BACKWARD`'s kernel.
_IN_PLACE = {
    nn.Tanh: (lambda z: _aten.tanh.out(z, out=z),
              lambda g, h: _aten.tanh_backward.grad_input(g, h, grad_input=g),
              lambda g, h, out: _aten.tanh_backward.grad_input(g, h, grad_input=out)),
    nn.Sigmoid: (lambda z: _aten.sigmoid.out(z, out=z),
                 lambda g, h: _aten.sigmoid_backward.grad_input(g, h, grad_input=g),
                 lambda g, h, out: _aten.sigmoid_backward.grad_input(g, h, grad_input=out)),
    nn.ReLU: (lambda z: _aten.relu.out(z, out=z),
              lambda g, h: _aten.threshold_backward.grad_input(g, h, 0, grad_input=g),
              lambda g, h, out: _aten.threshold_backward.grad_input(g, h, 0,
                                                                    grad_input=out)),
}

# ``nn.ELU(inplace=True)``: autograd's derivative of ``elu_`` reads its output.
_ELU_OF_OUTPUT = (True, lambda a, g, h: _aten.elu_backward(g, a.alpha, 1, 1, True, h))


class Arena:
    """Named buffers carved from one tensor, each region sized up front and starting on a
    64-byte boundary; :meth:`get` views the start of a region as any shape that fits.

    One allocation of torch's allocator instead of one per buffer: the C library's heap
    gives the same block back to the next call, whose pages are then already there (on
    the quick benchmark's 64-512-512-1 row at N = 1024, no page faults from the second
    call on). NumPy's memory, whose huge pages :func:`.._memory.large_tensor` asks for,
    made the benchmark's first timed calls 1.2-1.4x slower on the VM measured
    (``benchmarks/results/gram-mlp-s46.md``).
    """

    _ALIGN = 64

    def __init__(self, sizes: dict, dtype: torch.dtype, device: torch.device):
        itemsize = torch.empty((), dtype=dtype).element_size()
        step = max(1, self._ALIGN // itemsize)
        rounded = {key: -(-int(size) // step) * step for key, size in sizes.items()}
        buf = torch.empty((sum(rounded.values()) + step,), dtype=dtype, device=device)
        start = (-buf.data_ptr() % self._ALIGN) // itemsize if buf.device.type == "cpu" else 0
        self._regions = {}
        for key, size in rounded.items():
            self._regions[key] = buf[start : start + size]
            start += size

    def __contains__(self, key) -> bool:
        return key in self._regions

    def get(self, key, shape: tuple[int, ...]) -> torch.Tensor:
        return self._regions[key][: math.prod(shape)].view(shape)


def gram_factor_sizes(mlp: StackedMLP, n: int, last_out: bool = False) -> dict:
    """The buffers of :func:`gram_factors` for ``n`` samples: entries by key (without the
    last hidden Linear's output where ``last_out``: the caller's view holds it)."""
    sizes = {}
    for li, lin in enumerate(mlp.linears[:-1]):
        sizes[("z", li)] = sizes[("g", li)] = n * lin.d_out
    if last_out and len(mlp.linears) > 1:
        del sizes[("z", len(mlp.linears) - 2)]
    return sizes


def gram_factors(mlp: StackedMLP, params: dict, X: torch.Tensor, arena: Arena,
                 last_out: torch.Tensor | None = None) -> list[tuple]:
    """Every Linear's ``(weight name, inputs a (n, d_in), bias name or None, backprops
    (n, d_out))`` of a scalar-output MLP at one parameter point (its last item a Linear
    of one output, which the caller checks before sizing ``arena``), by one forward and
    one backward pass without autograd, in one workspace.

    The factors that :func:`._capture.capture` gives the tangent-kernel engine, computed
    by the same aten operations on the same operands (``addmm`` for a Linear with a bias,
    ``mm`` by the weight for its input's gradient, the activations' own backward
    kernels, see :data:`_BACKWARD`), so the numbers are the same bit for bit, without
    the use watch, the autograd graph and its saved tensors. Their memory is ``arena``'s
    (:class:`Arena`, keys of :func:`gram_factor_sizes`) instead of a dozen tensors of
    torch's allocator, each a first touch of fresh pages at every call: on the
    64-512-512-1 network at N = 1024, 3,900 page faults of the capture on a cold heap
    (``benchmarks/results/gram-mlp-s46.md``). ``last_out``: an ``(n, d_out)`` view
    (rows of stride ``d_out`` or more, ``d_out`` at least 2) where the last hidden Linear
    writes its output instead of a region of ``arena`` (sized then by
    ``gram_factor_sizes(..., last_out=True)``): the folded head's rows, see
    :func:`.._gram._head_in_fold`; the same bits.
    """
    items = mlp.items
    linears = mlp.linears
    n = X.shape[0]
    # A forward buffer (layer output, the activation in place over it) and a backprop
    # buffer per hidden Linear (:func:`gram_factor_sizes`).
    # (The last hidden Linear's output, and the activations in place over it, where the
    # caller gives: the head's input is then that view wherever nothing after it makes a
    # fresh tensor.)
    last = len(linears) - 2 if last_out is not None else -1
    bufs = [(last_out if li == last else arena.get(("z", li), (n, lin.d_out)),
             arena.get(("g", li), (n, lin.d_out))) for li, lin in enumerate(linears[:-1])]
    # Forward: every Linear's input, and per activation what its derivative reads.
    h, li, inputs, acts = X, 0, [], [[] for _ in linears]
    for it in items:
        if isinstance(it, _Linear):
            inputs.append(h)
            if li == len(linears) - 1:
                break  # the output itself is not needed
            W, z = params[it.weight], bufs[li][0]
            if it.bias is None:
                h = torch.mm(h, W.t(), out=z)
            else:
                h = torch.addmm(params[it.bias], h, W.t(), out=z)
            li += 1
            continue
        if type(it) is nn.Identity:
            continue
        if li == 0:  # before the first Linear: no backprop needed, X left as it is
            h = it(h.clone())
            continue
        # In place over the Linear's output only as the first activation after it (a
        # second would overwrite what the first one's derivative reads).
        kernels = _IN_PLACE.get(type(it))
        if kernels is not None and h is bufs[li - 1][0] and not acts[li - 1]:
            kernels[0](h)
            acts[li - 1].append((it, h, None))
            continue
        # The module's own call (a fresh output): its derivative reads its input or
        # output as :data:`_BACKWARD` says.
        # (An in-place module gets a copy: its input may be what another one's
        # derivative reads.)
        of_output, backward = _BACKWARD[type(it)]
        if type(it) is nn.ELU and it.inplace:
            # Autograd differentiates ``elu_`` from its output (another rounding).
            of_output, backward = _ELU_OF_OUTPUT
        z_in = h
        h = it(h.clone() if getattr(it, "inplace", False) else h)
        acts[li - 1].append((it, h if of_output else z_in, backward))
    # Backward: the scalar head's input gradient is its weight's row for every sample
    # (``ones (n, 1) @ W``, exact), then down through the activations and Linears.
    head = linears[-1]
    deltas = [None] * len(linears)
    deltas[-1] = X.new_ones((n, 1))
    g_row = params[head.weight]
    for li in range(len(linears) - 2, -1, -1):
        g = bufs[li][1]
        backs = list(reversed(acts[li]))
        if g_row is not None:
            if backs and backs[0][2] is None:
                # The first backward kernel reads the head's row broadcast and writes the
                # buffer: the same bits as copying the rows first, one pass fewer.
                it, saved, _ = backs.pop(0)
                _IN_PLACE[type(it)][2](g_row.expand(n, -1), saved, g)
            else:
                g.copy_(g_row.expand(n, -1))
            g_row = None
        for it, saved, backward in backs:
            if backward is None:
                _IN_PLACE[type(it)][1](g, saved)
            else:
                g = backward(it, g, saved)
        deltas[li] = g
        if li > 0:
            W = params[linears[li].weight]
            torch.mm(g, W, out=bufs[li - 1][1])
    return [(lin.weight, a, lin.bias, d) for lin, a, d in zip(linears, inputs, deltas)]


def forward_block(mlp: StackedMLP, theta: torch.Tensor, layout: dict,
                  X: torch.Tensor) -> torch.Tensor:
    """The network's outputs (B, N, C) at the block's points: the route's own forward."""
    params = _layer_params(mlp, theta, layout)
    h, li = _first_input(mlp, X), 0
    for it in mlp.items:
        if isinstance(it, _Linear):
            W, b = params[li]
            li += 1
            h = torch.matmul(h, W.transpose(1, 2))
            if b is not None:
                h = h + b[:, None, :]
        else:
            h = it(h)
    return h


# --------------------------------------------------------------------------- contraction
def _split_d(D: torch.Tensor | None, lin: _Linear, layout: dict):
    """The layer's preconditioner as (B, p, q): the weight's, then the bias's column."""
    if D is None:
        return None
    s, size = layout[lin.weight]
    Dw = D[:, s : s + size].view(-1, lin.d_out, lin.d_in)
    if lin.bias is None:
        return Dw
    s, size = layout[lin.bias]
    return torch.cat([Dw, D[:, s : s + size, None]], dim=2)


def _ones(a: torch.Tensor, lin: _Linear) -> torch.Tensor:
    """``a`` with the bias's input (a column of ones) appended: (B, N, q)."""
    if lin.bias is None:
        return a
    return torch.cat([a, a.new_ones(*a.shape[:-1], 1)], dim=-1)


def _rank1(out, fx, fy, w, scratch: _Scratch) -> None:
    """``out += sum_b w_b (A A'^T) * (Delta Delta'^T)`` for one layer.

    ``out`` of shape ``(N, C, M, C)`` takes the ``C x C`` blocks: ``Delta_c Delta'_d^T``.
    """
    (ax, dx), (ay, dy) = fx, fy
    B, n = dx.shape[:2]
    m = dy.shape[1]
    Ga = torch.bmm(ax, ay.transpose(1, 2), out=scratch.get("H", (B, n, m), out.dtype))
    if out.ndim == 4:
        C, p = dx.shape[2:]
        Gd = torch.bmm(dx.reshape(B, n * C, p), dy.reshape(B, m * C, p).transpose(1, 2))
        Gd = Gd.view(B, n, C, m, C).mul_(Ga[:, :, None, :, None])
        out.add_(torch.mm(w[None, :], Gd.view(B, -1)).view(out.shape))
        return
    Gd = torch.bmm(dx.reshape(B, n, -1), dy.reshape(B, m, -1).transpose(1, 2),
                   out=scratch.get("G", (B, n, m), out.dtype))
    Gd.mul_(Ga)
    out.view(1, n * m).addmm_(w[None, :], Gd.view(B, n * m))


class _Scratch:
    """Reused work buffers of the contraction, by name.

    The panels' products are each a few hundred kB, written thousands of times per
    point: fresh tensors of that size come from the allocator as new pages, whose faults
    cost about as much as the GEMMs that fill them (2x on the "units" route's chunk).
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """A contiguous tensor of ``shape`` (contents undefined) in the buffer ``name``."""
        numel = math.prod(shape)
        buf = self.buffers.get(name)
        if buf is None or buf.dtype != dtype or buf.numel() < numel:
            buf = self.buffers[name] = torch.empty(numel, dtype=dtype, device=self.device)
        return buf[:numel].view(shape)


def _units_full(out, fx, fy, wD, chunk: int, scratch: _Scratch) -> None:
    """The ``C x C`` blocks of :func:`_units`: ``out[i, c, j, d] += sum_b sum_o
    Delta_ico Delta'_jdo (A (w_b D_bo) A'^T)_ij``.

    The backprops are sample-major (B, N, C, p). Per chunk of units,
    ``T[i, o, j, d] = H_o[i, j] Delta'_jdo`` (one elementwise pass of ``N M C`` per unit)
    and one batched GEMM over the rows ``i``: ``Delta_i (C x u)`` times ``T_i (u x M C)``,
    ``2 N M C^2`` FLOPs per unit, against the trace's ``2 N M C``.
    """
    (ax, dx), (ay, dy) = fx, fy
    B, n, C, p = dx.shape
    m = ay.shape[1]
    flat = out.view(n, C, m * C)
    for b in range(B):
        ayt = ay[b].T
        for o in range(0, p, chunk):
            e = min(o + chunk, p)
            scaled = ax[b, None, :, :] * wD[b, o:e, None, :]          # (u, N, q)
            H = torch.mm(scaled.view((e - o) * n, -1), ayt).view(e - o, n, m)
            T = H.permute(1, 0, 2).unsqueeze(3) * dy[b, :, :, o:e].permute(2, 0, 1)
            flat.baddbmm_(dx[b, :, :, o:e], T.view(n, e - o, m * C))


def _units(out, fx, fy, wD, chunk: int, scratch: _Scratch, mix=None) -> None:
    """``out += sum_b sum_o (Delta_o Delta_o'^T) * (A (w_b D_bo) A'^T)`` for one layer.

    The backprops are units-major (B, p, N, C). A point's units are taken ``chunk`` at a
    time, so that the chunk's products stay in cache between the GEMMs that write them
    and the product that sums them; every product is written into ``scratch``. The loop
    runs a few hundred times per point: it issues as few torch calls as it can (each
    costs microseconds, as much as the arithmetic of a small panel).

    ``out`` is ``(R, N M)``: the units' products are summed with the rows of ``mix``
    (B, R, p), or with ones (R = 1) where None. The ``C x C`` blocks of a layer with one
    backprop ``m_o = |V_o| d_o`` (:func:`_factors`) are ``sum_o m_xo m_yo H_o`` times
    ``Vh_o Vh_o^T`` (``Vh_o = V_o / |V_o|``): one GEMM of a chunk's products against
    those ``C^2`` numbers per unit (without a preconditioner: :func:`_mixed_rank1`).
    """
    (ax, dx), (ay, dy) = fx, fy
    B, p, n, C = dx.shape
    m, q = ay.shape[1:]
    # Chunks of equal size (64 units in 14s leave a chunk of 8: a fifth more calls).
    u = chunk = -(-p // -(-p // chunk))
    # The sum over the chunk's units as a product with ones (one call, one read).
    ones = torch.ones(1, u, dtype=ax.dtype, device=ax.device) if mix is None else None
    S_ = scratch.get("scaled", (u, n, q), ax.dtype)
    H_ = scratch.get("H", (u * n, m), ax.dtype)
    G_ = None if C == 1 else scratch.get("G", (u, n, m), ax.dtype)
    # SciPy's GEMMs where a unit's product is large enough that a call's overhead (a few
    # microseconds, one per unit) is small against its time, on the CPUs where they beat
    # torch's (:func:`_units_scipy`; the full blocks' mix measured alike both ways).
    gemm = (_cpu_gemm(ax) if (_UNITS_SCIPY or mix is not None) and n * m >= _BLAS_MIN
            else None)
    if gemm is not None:
        # (A unit's backprops are copied by the wrapper unless their (N, C) rows are
        # contiguous: :func:`stacked_path_sum` lays the block's out so.)
        Hn, Gn = H_.numpy(), None if C == 1 else G_.numpy()
    for b in range(B):
        ayt, axb, wDb = ay[b].T, ax[b].unsqueeze(0), wD[b].unsqueeze(1)
        dxb, dytb = dx[b], dy[b].transpose(1, 2)                       # (p, N, C), (p, C, M)
        if gemm is not None:
            ayn, dxn, dyn = ay[b].contiguous().numpy(), dx[b].numpy(), dy[b].numpy()
        for o in range(0, p, chunk):
            e = min(o + chunk, p)
            k = e - o
            scaled, H = (S_, H_) if k == u else (S_[:k], H_[: k * n])
            # A D_o A'^T for the chunk's units: the scaled rows of all units, one GEMM.
            torch.mul(axb, wDb[o:e], out=scaled)
            if C == 1:
                # Delta_o Delta_o'^T is an outer product: scale the rows and columns.
                scaled.mul_(dxb[o:e])
            if gemm is None:
                torch.mm(scaled.view(k * n, q), ayt, out=H)
            else:
                # Row-major arrays as the column-major transposes: H^T = A' (S)^T.
                gemm(1.0, ayn.T, scaled.numpy().reshape(k * n, q).T, c=Hn[: k * n].T,
                     trans_a=1, overwrite_c=1)
            if C == 1:
                H.view(k, n, m).mul_(dytb[o:e])
            else:
                G = G_ if k == u else G_[:k]
                if gemm is None:
                    torch.bmm(dxb[o:e], dytb[o:e], out=G)
                else:
                    # A call per unit (SciPy has no batched GEMM): the ten-wide products
                    # are bound by writing their output, which OpenBLAS did faster
                    # than a batched MKL product on the AMD EPYC.
                    for j in range(k):
                        gemm(1.0, dyn[o + j].T, dxn[o + j].T, c=Gn[j].T, trans_a=1,
                             overwrite_c=1)
                H.view(k, n, m).mul_(G)
            weights = (ones if k == u else ones[:, :k]) if mix is None else mix[b, :, o:e]
            out.addmm_(weights, H.view(k, n * m))


def _mixed_rank1(out, fx, fy, mix, w, scratch: _Scratch) -> None:
    """``out[cd] += sum_b w_b (A A'^T) * (M diag(mix_b[cd]) M'^T)`` without a
    preconditioner: the ``C x C`` blocks (``out`` of shape ``(R, N M)``, ``R`` rows of
    ``mix`` (B, R, p)) of a layer with one backprop ``m`` (units-major, (B, p, N, 1)).

    One GEMM per point of the backprops scaled by every row of ``mix`` against the other
    side's, ``2 R N M p`` FLOPs, and one pass of ``R N M`` that multiplies in the inputs'
    Gram.
    """
    (ax, dx), (ay, dy) = fx, fy
    B, p, n, _ = dx.shape
    m = ay.shape[1]
    R = mix.shape[1]
    T = scratch.get("T", (R * n, m), out.dtype)
    for b in range(B):
        Ga = torch.mm(ax[b], ay[b].T).mul_(w[b])
        scaled = (mix[b][:, None, :] * dx[b, :, :, 0].T).view(R * n, p)
        torch.mm(scaled, dy[b, :, :, 0], out=T)
        out.view(R, n, m).addcmul_(T.view(R, n, m), Ga)


def _tiles_full(K, sides: _Sides, routes, w, symmetric: bool, first: bool, tile: int,
                scratch: _Scratch) -> None:
    """The ``C x C`` blocks of an unweighted network whose routes are ``"mixed"`` and
    ``"onehot"`` (one hidden layer), written into ``K`` (float64 ``(n, m, C, C)``) tile
    by tile: ``K[I, J] = `` the block of points' sum (``first``) or ``+=`` it.

    Each block is symmetric in the outputs: the ``R = C (C + 1) / 2`` entries of its
    upper triangle (``sides.mix``'s order, the diagonal last) are summed over the points
    in a tile ``acc[i, j, r]`` of the computation's dtype that stays in cache (about
    1 MB at 64 x 64 tiles and C = 10), and written to ``K`` once,
    spread over the ``C^2`` entries. Per point, the "mixed" layer's entries
    ``sum_o m_io m_jo mix_ro`` are one GEMM, ``m_I (t x p)`` times ``Y_J (p x t R)`` with
    ``Y[o, j, r] = m_jo w_b mix_ro`` (pair-major, as ``K`` is laid out), times the
    inputs' Gram ``A_I A_J^T``; the one-hot output layer adds ``sum_b w_b A_I A_J^T`` to
    the diagonal entries. A symmetric ``K(X, X)`` computes the tiles ``J >= I``
    (:func:`_tile_pieces`) and writes ``K[J, I] = K[I, J]`` (each block symmetric), the
    squares on its diagonal symmetrised exactly. That is the only pass over ``K``: no
    zero fill and no mirror pass.
    """
    n, m = K.shape[:2]
    C = len(sides.sel)
    flat = K.view(n, m, C * C)
    ax, ay = sides.fx[-1][0], sides.fy[-1][0]
    B, _, q = ax.shape
    # The one-hot layer: its Gram over all the block's points, one GEMM per tile.
    xs = (ax * w[:, None, None]).transpose(0, 1).reshape(n, B * q)
    ys = ay.transpose(0, 1).reshape(m, B * q)
    li = routes.index("mixed")
    (a_x, d_x), (a_y, d_y) = sides.fx[li], sides.fy[li]
    mix, upper, lower = sides.mix[li]
    R, p = mix.shape[1:]
    mx = d_x[:, :, 0]                                                   # (B, n, p)
    myt = d_y[:, :, 0].transpose(1, 2)                                  # (B, p, m)
    mixw = (mix * w[:, None, None]).transpose(1, 2)                     # (B, p, R)
    # (c, d) -> its entry r, in both triangles.
    where = torch.empty(C * C, dtype=torch.long, device=K.device)
    entries = torch.arange(R, device=K.device)
    where[upper] = entries
    where[lower] = entries[: len(lower)]
    for j0 in range(0, m, tile):
        j1 = min(j0 + tile, m)
        tj = j1 - j0
        # Y of the column tile at every point, shared by its row tiles (B p t R numbers,
        # counted in the block's budget).
        Y = scratch.get("Y", (B, p, tj, R), ax.dtype)
        torch.mul(myt[:, :, j0:j1, None], mixw[:, :, None, :], out=Y)
        for i0, i1, c0, c1 in _tile_pieces(j0, j1, n, tile, symmetric):
            ti, tc = i1 - i0, c1 - c0
            acc = scratch.get("acc", (ti, tc, R), ax.dtype)
            T = scratch.get("T", (ti, tc * R), ax.dtype)
            for b in range(B):
                torch.mm(mx[b, i0:i1], Y[b, :, c0 - j0 : c1 - j0].reshape(p, tc * R), out=T)
                Ga = torch.mm(a_x[b, i0:i1], a_y[b, c0:c1].T)
                if b == 0:
                    torch.mul(T.view(ti, tc, R), Ga[:, :, None], out=acc)
                else:
                    acc.addcmul_(T.view(ti, tc, R), Ga[:, :, None])
            acc[:, :, R - C :] += torch.mm(xs[i0:i1], ys[c0:c1].T)[:, :, None]
            if symmetric and i0 == c0:
                # The square on the diagonal, symmetrised exactly.
                square = acc[:, :ti]
                square.copy_(0.5 * (square + square.transpose(0, 1)))
            # (A 2-D index_select: about five times faster than one along dim 2.)
            vals = acc.view(ti * tc, R).index_select(1, where).view(ti, tc, C * C)
            _put(flat[i0:i1, c0:c1], vals, first)
            # Below the diagonal: K[j, i] = K[i, j], each block being symmetric.
            skip = max(i1 - c0, 0) if symmetric else tc
            if skip < tc:
                _put(flat[c0 + skip : c1, i0:i1], vals[:, skip:].transpose(0, 1), first)


def _tile_pieces(j0: int, j1: int, n: int, tile: int, symmetric: bool):
    """(rows, columns) ``(i0, i1, c0, c1)`` of the tiles of column tile ``[j0, j1)``.

    A symmetric Gram takes the tiles above the diagonal, and its diagonal tile as its
    upper rows across the tile and the square below them on the diagonal: 3/4 of that
    tile (N t / 4 entries past the upper triangle instead of N t / 2).
    """
    if not symmetric:
        return [(i0, min(i0 + tile, n), j0, j1) for i0 in range(0, n, tile)]
    pieces = [(i0, i0 + tile, j0, j1) for i0 in range(0, j0, tile)]
    h = j0 + (j1 - j0 + 1) // 2
    return pieces + ([(j0, h, j0, j1), (h, j1, h, j1)] if h < j1 else [(j0, j1, j0, j1)])


def _put(target: torch.Tensor, values: torch.Tensor, first: bool) -> None:
    if first:
        target.copy_(values)
    else:
        target.add_(values)


def _onehot_full(out, fx, fy, sides: _Sides, li: int, w) -> None:
    """The ``C x C`` blocks of an output layer with one-hot backprops: diagonal, output
    ``c``'s block ``sum_b A diag(w_b D_bc) A'^T`` (``D_bc`` the preconditioner of the
    layer's row ``c``; ``w_b A A'^T`` for every output without one). ``out`` is
    ``(C, C, N M)``."""
    ax, ay = fx[0], fy[0]
    B, n, q = ax.shape
    m = ay.shape[1]
    C = out.shape[0]
    diagonal = out.diagonal(dim1=0, dim2=1)                          # (N M, C)
    if sides.wD[li] is None:
        G = torch.mm((ax * w[:, None, None]).transpose(0, 1).reshape(n, B * q),
                     ay.transpose(0, 1).reshape(m, B * q).T)
        diagonal.add_(G.view(n * m, 1))
        return
    s = sides.wD[li].index_select(1, sides.sel)                      # (B, C, q)
    xs = (ax[:, None] * s[:, :, None, :]).permute(1, 2, 0, 3).reshape(C * n, B * q)
    G = torch.mm(xs, ay.transpose(0, 1).reshape(m, B * q).T)          # (C N, M)
    diagonal.add_(G.view(C, n * m).T)


def _form(f, wD: torch.Tensor | None, scratch: _Scratch | None = None,
          name: str = "formed") -> torch.Tensor:
    """The per-sample gradients ``delta_c (x) a`` of the block's points side by side,
    ``(N, B C p q)``, each point's scaled by ``w_b D_b`` where given.

    Formed once per block, so that every panel of the "dense" route is one GEMM whose
    inner dimension runs over all the block's points. Written into ``scratch``'s buffer
    ``name`` where given: at hundreds of MB per block, fresh memory's page faults cost
    more than the two passes that fill it (0.10 s against 0.04 s for 8 points at
    N = 1000).
    """
    a, d = f                                                           # (B, N, q), (B, p, N, C)
    B, p, n, C = d.shape
    q = a.shape[-1]
    shape = (n, B, C, p, q)
    g = (torch.empty(shape, dtype=a.dtype, device=a.device) if scratch is None
         else scratch.get(name, shape, a.dtype))
    for b in range(B):
        torch.mul(d[b].permute(1, 2, 0)[..., None], a[b][:, None, None, :], out=g[:, b])
        if wD is not None:
            g[:, b].mul_(wD[b])
    return g.view(n, -1)


def _form_sides(fx, fy, wD: torch.Tensor, scratch: _Scratch | None,
                name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Both sides of a "dense" layer's Gram, formed (:func:`_form`): ``w D`` on X's
    side, or, for one side's Gram (``fy is fx``) with ``w D >= 0``, ``sqrt(w D)`` on
    both, one matrix whose Gram it is."""
    if fy is fx and bool((wD >= 0).all()):
        g = _form(fx, wD.sqrt(), scratch, name)
        return g, g
    return _form(fx, wD, scratch, name), _form(fy, None, scratch, name + "y")


def _onehot(out, fx, fy, s) -> None:
    """``out += sum_b A diag(s_b) A'^T`` for an output layer with one-hot backprops.

    Its backprops' products over the outputs are the same for every pair of samples,
    so the layer's kernel is the inputs' Gram under ``s_b``, the weighted preconditioner
    summed over the outputs' rows (``w_b C`` without one): one GEMM over the block.
    """
    ax, ay = fx[0], fy[0]
    B, n, q = ax.shape
    m = ay.shape[1]
    xs = (ax * s[:, None, :]).transpose(0, 1).reshape(n, B * q)
    out.addmm_(xs, ay.transpose(0, 1).reshape(m, B * q).T)


def _diag(out, f, wD, w, s) -> None:
    """``out += sum_b w_b K_b(x, x)``: ``sum_o |delta_o|^2 (a^2 . D_o)`` per sample.

    The diagonal keeps its factorised form with ``D`` (``wD`` holds ``w_b D_b``; the
    backprops are units-major with it).
    """
    a, d = f
    if d is None:
        out.add_(((a * a) * s[:, None, :]).sum((0, 2)))
    elif wD is None:
        d2 = (d * d).sum(2)                                           # (B, N, p)
        per_point = (d2 * (a * a).sum(-1, keepdim=True)).sum(2)       # (B, N)
        out.add_(torch.mv(per_point.T, w))
    else:
        d2 = (d * d).sum(3)                                           # (B, p, N)
        s = torch.bmm(wD, (a * a).transpose(1, 2))                    # (B, p, N)
        out.add_((d2 * s).sum((0, 1)))


@dataclasses.dataclass
class _Sides:
    """The factors of X and Y for one block of points, the layers' (B, p, q) ``w D`` and
    (B, q) one-hot sums ``s`` (:func:`_onehot`); for the ``C x C`` blocks, the
    ``(B, C^2, p)`` products ``mix`` of a one-backprop layer's output rows
    (:func:`_units`) and the outputs ``sel``."""

    fx: list
    fy: list
    wD: list
    s: list
    units_major: bool
    formed: list
    mix: list
    sel: torch.Tensor


def _rows(f, idx, units_major: bool) -> tuple:
    a, d = f
    if d is not None:
        d = d[:, :, idx] if units_major else d[:, idx]
    return a[:, idx], d


def _contract_panel(out, sides: _Sides, routes, w, rows, cols, chunks,
                    scratch: _Scratch) -> None:
    """``out += `` the block's Gram over one panel, every layer by its route.

    ``out``: the trace's ``(N, M)``, or the ``C x C`` blocks' ``(N, C, M, C)``; the
    one-hot output layer and the one-backprop layer below it write the blocks as
    ``(C, C, N, M)`` in ``scratch`` ("blocks"), added to ``out`` at the end. ``chunks``:
    units per chunk of :func:`_units` and of :func:`_units_full`.
    """
    r, c = rows.stop - rows.start, cols.stop - cols.start
    blocks = None
    if out.ndim == 4 and ("mixed" in routes or "onehot" in routes):
        C = out.shape[1]
        blocks = scratch.get("blocks", (C, C, r * c), out.dtype).zero_()
    for li, route in enumerate(routes):
        if route is None:  # contracted elsewhere
            continue
        fx = _rows(sides.fx[li], rows, sides.units_major)
        fy = _rows(sides.fy[li], cols, sides.units_major)
        if route == "onehot":
            if blocks is None:
                _onehot(out, fx, fy, sides.s[li])
            else:
                _onehot_full(blocks, fx, fy, sides, li, w)
        elif route == "rank1":
            _rank1(out, fx, fy, w, scratch)
        elif route == "mixed":
            # Sample-major (B, N, 1, p) as units-major (B, p, N, 1); all of a point's
            # units in one chunk, the inner dimension of the GEMM that writes the
            # blocks (whose C^2 N M numbers are read and written once per chunk). The
            # blocks are symmetric in the outputs: their upper triangles, mirrored.
            fx, fy = [(a, d.permute(0, 3, 1, 2)) for a, d in (fx, fy)]
            mix, upper, lower = sides.mix[li]
            tri = scratch.get("triangle", (mix.shape[1], r * c), out.dtype).zero_()
            if sides.wD[li] is None:
                _mixed_rank1(tri, fx, fy, mix, w, scratch)
            else:
                _units(tri, fx, fy, sides.wD[li], mix.shape[-1], scratch, mix=mix)
            flat = blocks.view(-1, r * c)
            flat.index_add_(0, upper, tri)
            flat.index_add_(0, lower, tri[: len(lower)])
        elif route == "units" and out.ndim == 4:
            _units_full(out, fx, fy, sides.wD[li], chunks[1], scratch)
        elif route == "units":
            _units(out.view(1, r * c), fx, fy, sides.wD[li], chunks[0], scratch)
        else:
            gx, gy = sides.formed[li]
            out.addmm_(gx[rows], gy[cols].T)
    if blocks is not None:
        out += blocks.view(C, C, r, c).permute(2, 0, 3, 1)


def _dense_strips(K: torch.Tensor, sides: _Sides, layers: Sequence[int],
                  scratch: _Scratch) -> None:
    """``K += `` the "dense" layers' Grams over one block of points: the upper triangle
    of a symmetric ``K``, one point at a time.

    A point's per-sample gradients (16 MB at N = 1000 for a 64 x 65 layer) are formed
    right before they are contracted, so that they are read from cache: the block's
    gradients formed at once (hundreds of MB) are written to memory and read back. On
    the CPU, where one matrix's Gram is asked for (``w D >= 0``), the contraction is
    one BLAS SYRK (:func:`_syrk`): the upper triangle only, at the rate of a GEMM.
    Elsewhere it runs in strips of ``_DENSE_STRIP`` rows: each strip right of its square
    is one GEMM; the square on the diagonal is halved down to ``_DENSE_LEAF`` rows
    (:func:`_dense_square`), so that about ``N * _DENSE_LEAF / 2`` entries below the
    diagonal are computed, not ``N * _DENSE_STRIP / 2``, while the GEMMs that do most of
    the work stay wide. The Gram is summed over the block in float32 (as the panels'
    GEMMs sum over the block's points) and added to ``K`` once.
    """
    n = K.shape[0]
    acc = scratch.get("dense_acc", (n, n), sides.fx[0][0].dtype).zero_()
    # (Small Grams keep torch's products, as the "units" route's small panels do.)
    syrk = _syrk(acc) if n * n >= _BLAS_MIN else None
    for li in layers:
        wD = sides.wD[li]
        f = sides.fx[li]
        for b in range(wD.shape[0]):
            point = (f[0][b : b + 1], f[1][b : b + 1])
            gx, gy = _form_sides(point, point, wD[b : b + 1], scratch, "formed")
            if syrk and gx is gy:
                syrk(gx)
                continue
            for s in range(0, n, _DENSE_STRIP):
                e = min(s + _DENSE_STRIP, n)
                if e < n:
                    acc[s:e, e:].addmm_(gx[s:e], gy[e:].T)
                _dense_square(acc, gx, gy, s, e)
    for s in range(0, n, _DENSE_STRIP):
        e = min(s + _DENSE_STRIP, n)
        K[s:e, s:] += acc[s:e, s:]


def _syrk(acc: torch.Tensor) -> Callable[..., None] | None:
    """``(g, alpha=1) -> acc += alpha g g^T`` on and above the diagonal by the BLAS SYRK
    that SciPy links, for a CPU ``acc`` (``(n, n)``, float32 or float64, contiguous); None elsewhere
    (CUDA tensors keep torch's GEMMs).

    Torch has no SYRK; SciPy's OpenBLAS computes one triangle with a kernel about as
    fast per FLOP as its GEMM. Measured on one thread (AMD EPYC, N = 1000, one point's
    1000 x 4160 gradients): 44 ms against 54 ms for torch's strips (:func:`_dense_square`),
    94 GFLOP/s on the triangle's FLOPs. The arrays are views of the tensors' memory: a
    row-major ``(n, k)`` matrix is the column-major ``(k, n)`` one, so SYRK takes it
    transposed (``trans=1``), and the row-major upper triangle of ``acc`` is the
    column-major lower one (``lower=1``).
    """
    if _cpu_gemm(acc) is None or not acc.is_contiguous():
        return None
    syrk = blas.dsyrk if acc.dtype == torch.float64 else blas.ssyrk
    c = acc.numpy().T

    def update(g: torch.Tensor, alpha: float = 1.0) -> None:
        a = g.contiguous().numpy().T
        r = syrk(alpha, a, beta=1.0, c=c, trans=1, lower=1, overwrite_c=1)
        if r.ctypes.data != c.ctypes.data:  # the wrapper copied: write its result back
            c[...] = r

    return update


def _cpu_gemm(t: torch.Tensor):
    """SciPy's BLAS GEMM (``sgemm`` / ``dgemm``) for the CPU tensor ``t``'s dtype, where
    torch runs on one thread, SciPy's BLAS takes a process-wide thread limit
    (:func:`_blas_process_wide`) and this thread holds it (:func:`_blas_threads`); None
    (CUDA tensors, other dtypes, several threads, other BLAS builds, a concurrent call)
    where torch's products are used.

    One thread only: with two torch threads on two shared cores, SciPy's OpenBLAS on two
    threads between torch's products made the call 10x slower in wall time (each
    library's threads wait for work spinning, on the cores the other one needs)."""
    if not _holds_blas() or not _blas_eligible(t):
        return None
    return blas.dgemm if t.dtype == torch.float64 else blas.sgemm


def _blas_eligible(t: torch.Tensor) -> bool:
    """Whether SciPy's BLAS may take ``t``'s products (see :func:`_cpu_gemm`), given the
    limit of :func:`_blas_threads`."""
    return (t.device.type == "cpu" and t.dtype in (torch.float32, torch.float64)
            and torch.get_num_threads() == 1 and _blas_process_wide())


# Reentrant: :func:`_blas_process_wide` makes the controller while it holds it.
_BLAS_LOCK = threading.RLock()
_BLAS_STATE: dict = {"controller": None, "process_wide": None}


def _blas_process_wide() -> bool:
    """Whether SciPy's BLAS is OpenBLAS and every BLAS library that threadpoolctl limits
    takes the limit for the whole process (OpenBLAS's own "pthreads" threading layer, or
    a single-threaded build): what :func:`_blas_threads` sets then holds for every
    thread of the call, and its restoring restores it for all.

    An OpenMP-layer OpenBLAS, MKL or BLIS may keep a limit per thread or, OpenBLAS's own
    under OpenMP before 0.3.34, not apply it. Inspected once (milliseconds), with the
    libraries loaded then (SciPy's BLAS is, by this module's import).
    """
    known = _BLAS_STATE["process_wide"]
    if known is not None:
        return known
    with _BLAS_LOCK:
        state = _BLAS_STATE
        if state["process_wide"] is None:
            libs = _blas_controller().select(user_api="blas").info()
            state["process_wide"] = _process_wide(libs, _scipy_blas_name())
        return state["process_wide"]


def _blas_controller() -> ThreadpoolController:
    """threadpoolctl's view of the loaded libraries, made once (milliseconds)."""
    with _BLAS_LOCK:
        if _BLAS_STATE["controller"] is None:
            _BLAS_STATE["controller"] = ThreadpoolController()
    return _BLAS_STATE["controller"]


def _process_wide(libs: Sequence[dict], scipy_blas: str | None) -> bool:
    """:func:`_blas_process_wide` from threadpoolctl's ``info()`` of the BLAS libraries
    and the name of SciPy's BLAS in its build configuration (None where unknown)."""
    if scipy_blas is not None and "openblas" not in scipy_blas.lower():
        return False
    return bool(libs) and all(
        lib.get("internal_api") == "openblas"
        and lib.get("threading_layer") in ("pthreads", "disabled") for lib in libs)


def _scipy_blas_name() -> str | None:
    """The BLAS SciPy was built against (its build configuration), None where unknown."""
    config = getattr(getattr(scipy, "__config__", None), "CONFIG", None)
    try:
        return str(config["Build Dependencies"]["blas"]["name"])
    except (KeyError, TypeError):
        return None


# One thread at a time holds the BLAS limit (:func:`_blas_threads`); ``_BLAS_HELD.held``
# says, per thread, whether this one does.
_BLAS_OWNER = threading.Lock()
_BLAS_HELD = threading.local()


@contextlib.contextmanager
def _blas_threads(n: int):
    """Run a block with the BLAS libraries that NumPy and SciPy load limited to ``n``
    threads, set and restored by this thread, where it can take the limit: then
    :func:`_cpu_gemm` gives SciPy's products in this thread.

    One thread at a time: a call that another thread's block overlaps keeps torch's
    products (the thread that sets a limit is the one that restores it, so that no
    thread is left limited, and threadpoolctl 3.8+ only lets one thread at a time set
    OpenBLAS's limits, silently ignoring the others': then too, and where the limit did
    not take, torch's products). Only where the limit is process-wide
    (:func:`_blas_process_wide`): while such a block runs, NumPy's and SciPy's BLAS
    calls from other threads of the process are held to ``n`` threads too."""
    if _holds_blas() or not _BLAS_OWNER.acquire(blocking=False):
        # Already held: by this thread (a nested block), or by another one.
        yield
        return
    try:
        blas_libs = _blas_controller().select(user_api="blas")
        # As a context, the limiter restores the limits and hands back threadpoolctl's
        # control of OpenBLAS.
        with blas_libs.limit(limits=n, user_api="blas"):
            _BLAS_HELD.held = all(lib["num_threads"] == n for lib in blas_libs.info())
            try:
                yield
            finally:
                _BLAS_HELD.held = False
    finally:
        _BLAS_OWNER.release()


def _holds_blas() -> bool:
    return getattr(_BLAS_HELD, "held", False)


def _dense_square(acc: torch.Tensor, gx: torch.Tensor, gy: torch.Tensor, s: int,
                  e: int) -> None:
    """``acc[s:e, s:e] += gx[s:e] gy[s:e]^T`` on and above the diagonal: the square
    halved (its upper half's square, the block right of it, its lower half's square)
    down to ``_DENSE_LEAF`` rows, computed whole."""
    if e - s <= _DENSE_LEAF:
        acc[s:e, s:e].addmm_(gx[s:e], gy[s:e].T)
        return
    h = s + (e - s + 1) // 2
    _dense_square(acc, gx, gy, s, h)
    acc[s:h, h:e].addmm_(gx[s:h], gy[h:e].T)
    _dense_square(acc, gx, gy, h, e)


def _panels(n: int, m: int, symmetric: bool, size: int, strip: int):
    """(rows, cols) of the Gram's panels.

    A symmetric Gram is cut into strips of ``strip`` rows from the diagonal rightwards:
    its upper triangle plus ``n * strip / 2`` entries, where square panels compute the
    diagonal squares whole.
    """
    height = strip if symmetric else size
    for s in range(0, n, height):
        rows = slice(s, min(s + height, n))
        for t in range(s if symmetric else 0, m, size):
            yield rows, slice(t, min(t + size, m))


def _strip(n: int, panel: int, launch_bound: bool = False) -> int:
    """Rows of a symmetric Gram's strips: a quarter of ``n`` between 16 and 64 rows
    (``_GPU_STRIP`` rows where ``launch_bound``).

    Below 16 rows the strips' GEMMs are small and their number grows the Python per
    point; above 64 the square at the diagonal adds more than 6% at N = 1000.
    """
    return min(panel, max(16, min(_GPU_STRIP if launch_bound else 64, -(-n // 4))))


def _launch_bound(device: torch.device) -> bool:
    """Whether each call's launch, not the caches, sets the pace of the panels' products.

    On a GPU a torch call costs about 10 us of launch and Python, as much as a small
    panel's arithmetic, and the CPU's cache blocking (``_PANEL``, ``_CACHE``, 64-row
    strips) only multiplies the calls: the first GPU run (an H200,
    ``benchmarks/results/path-quick-cuda.md``) took 16 ms per point for the default
    classifier's Adam path kernel at N = 1000, 9.5 times its FLOP floor, where the
    route issues about 1600 torch calls per point (counted on the CPU): 10 us each.
    There the panels are whole (up to ``_GPU_PANEL``), the strips a quarter of the rows
    (up to ``_GPU_STRIP``), both within a sixteenth of the budget per point, and a chunk
    as many units as a sixteenth of the budget holds.
    """
    return device.type == "cuda"


def _routes(mlp: StackedMLP, n_outputs: int, weighted: bool, rows: int, cols: int,
            full: bool = False) -> list[str]:
    """Every Linear's route; an output layer without an activation after it is
    ``"onehot"``, and the layer below it has one backprop (see :func:`_factors`).

    The full blocks: every layer rank-one unweighted, else by units (forming the
    per-sample gradients costs ``C p q / (q + C)`` times more than units there), with
    every output's backprop; the one-hot output layer's blocks are diagonal
    (:func:`_onehot_full`), and the layer below it ``"mixed"``: its one backprop by
    units, each unit's product spread over the ``C x C`` blocks by its output rows
    (:func:`_units`).
    """
    if full:
        routes = ["units" if weighted else "rank1"] * len(mlp.linears)
        if isinstance(mlp.items[-1], _Linear):
            routes[-1] = "onehot"
            if len(routes) > 1:
                routes[-2] = "mixed"
        return routes
    routes = [layer_route(C, lin.d_in, lin.d_out, weighted, lin.bias is not None, rows, cols)
              for lin, C in zip(mlp.linears, _outputs_per_layer(mlp, n_outputs))]
    if isinstance(mlp.items[-1], _Linear):
        routes[-1] = "onehot"
    return routes


def stacked_path_sum(
    mlp: StackedMLP,
    layout: dict,
    load: Callable[[Sequence[int]], tuple[torch.Tensor, torch.Tensor | None]],
    weights: Sequence[tuple[int, float]],
    X: torch.Tensor,
    Y: torch.Tensor | None = None,
    *,
    outputs: Sequence[int],
    trace_scale: float = 1.0,
    weighted: bool,
    memory_budget: int,
    gram: bool = True,
    diag: bool = False,
    block: int | None = None,
    panel: int | None = None,
    full: bool = False,
    launch_bound: bool | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None] | None:
    """``sum_k w_k J_k(X) D_k J_k(Y)^T`` (float64) and / or its diagonals over the points.

    Where one point's block over all of ``X`` and ``Y`` exceeds ``memory_budget`` (with
    ``block=None``), the sum of tiles of their rows that fit (:func:`_tiled_sum`); None
    when not even a tile of one row and one column does: the caller then takes the
    step-by-step route.

    Parameters
    ----------
    mlp : StackedMLP
    layout : dict of str to (start, size)
        Where each parameter sits in the flat vector.
    load : callable
        ``load(points) -> (theta (B, P), D (B, P) or None)`` in the computation's dtype.
    weights : sequence of (point, w_k)
    X, Y : torch.Tensor of shape (n, d_in) and (m, d_in)
        ``Y=None``: ``K(X, X)``, symmetric.
    outputs : sequence of int
        The outputs summed over (the trace); ``trace_scale`` multiplies every weight.
    weighted : bool
        Whether ``load`` returns a preconditioner.
    memory_budget : int
        Bytes for one block's factors and intermediates.
    gram, diag : bool
        What to return: ``(K, dx, dy)``, None where not asked (``dy`` is ``dx`` for
        ``Y=None``).
    block : int, default=None
        Points per block; None sizes it from the budget.
    panel : int, default=None
        Rows and columns of the Gram's panels; None: 256 (on a GPU the Gram's size, up
        to 2048: :func:`_launch_bound`), and the strips of a symmetric trace run to its
        last column.
    full : bool, default=False
        The ``C x C`` blocks of the outputs instead of their trace: ``K`` of shape
        ``(n, m, C, C)`` (``trace_scale`` 1; no diagonals: ``diag`` must be False).
    launch_bound : bool, default=None
        The GPU's tiling (:func:`_launch_bound`) or the CPU's; None: by ``X``'s device.
        Where one point of the GPU's tiling does not fit the budget, the CPU's is taken.
    out : torch.Tensor or None, default=None
        Zeros of ``K``'s shape (float64, a view of a larger Gram: a tile's) that the sum
        is written to and returned as ``K``; None: a new tensor.
    """
    symmetric = Y is None
    Yt = X if Y is None else Y
    n, m = X.shape[0], Yt.shape[0]
    dtype, itemsize = X.dtype, X.element_size()
    C = len(outputs)
    if full and diag:
        raise ValueError("stacked_path_sum gives no diagonal blocks (full=True, diag=True).")
    widths = [(lin.d_in + 1) + C * lin.d_out for lin in mlp.linears]
    P = max(s + size for s, size in layout.values())
    # A symmetric trace's strips run from the diagonal to the last column: one panel
    # per strip, so that no panel is a narrow remainder and the "units" route issues
    # its calls for whole rows of the Gram.
    whole = panel is None and symmetric and not full
    asked = panel
    c2 = C * C if full else 1
    if launch_bound is None:
        launch_bound = _launch_bound(X.device)
    # Launch-bound, a point's panel products take at most a sixteenth of the budget (so
    # that a block holds several points), but never less than the CPU's tiling takes.
    held = memory_budget // (_GPU_SHARE * 3 * c2 * itemsize)
    if panel is None:
        panel = (max(_PANEL, min(max(n, m), _GPU_PANEL, math.isqrt(held))) if launch_bound
                 else _PANEL)
    width = m if whole else panel
    strip = _strip(n, panel)
    if launch_bound:
        strip = max(strip, min(_strip(n, panel, True), held // min(m, width)))
    pr, pc = min(n, strip if symmetric else panel), min(m, width)
    # The "dense" route's gradients are formed once per block, for the whole Gram.
    routes = _routes(mlp, C, weighted, n, m, full)
    # Per point: its parameters and D, both sides' factors, the panel's products (the
    # "units" route's chunk is bounded separately, below) and the formed gradients.
    # One hidden layer without a preconditioner: every block symmetric in the outputs,
    # written tile by tile (:func:`_tiles_full`; no zero fill, no panel to add, no
    # mirror pass). Per point it keeps a column tile's Y, (p, tile, C (C + 1) / 2).
    tiles = gram and full and not weighted and routes == ["mixed", "onehot"]
    # The factors' pass holds more than the factors it returns: every input beside its
    # copy with a column of ones (:func:`_ones`) and the hidden activations' derivatives
    # (units-major, also their transposed copies): about twice the factors in all,
    # measured (peak RSS) on the default MLP.
    passing = (sum(lin.d_in + 1 for lin in mlp.linears)
               + 2 * sum(lin.d_out for lin in mlp.linears[:-1]))
    per_point = itemsize * (2 * P + (n + m) * (sum(widths) + 8 + passing) + 3 * pr * pc * c2)
    if tiles:
        per_point += itemsize * mlp.linears[0].d_out * _TILE * C * (C + 1) // 2
    formed = itemsize * (n + m) * sum(
        c * lin.d_out * (lin.d_in + (lin.bias is not None))
        for lin, c, route in zip(mlp.linears, _outputs_per_layer(mlp, C), routes)
        if route == "dense")
    # A symmetric trace's "dense" layers outside the panels, in their own taller strips
    # (:func:`_dense_strips`), where one point's gradients and their float32 sum over a
    # block fit a quarter of the budget: then no block of points holds them.
    apart_fits = whole and gram and n * n * itemsize + formed <= memory_budget // 4
    if formed and not apart_fits and (not gram or per_point + formed > memory_budget):
        # Diagonals only need no gradients; where they do not fit, the units route.
        routes = ["units" if r == "dense" else r for r in routes]
    elif formed and not apart_fits:
        per_point += formed
    # SciPy's GEMMs take the "units" layers' products where the largest panel has
    # ``_BLAS_MIN`` entries and the CPU favours them (:func:`_units`, :func:`_units_scipy`):
    # their backprops are then laid out for them (:func:`_contiguous_units`), a second
    # copy of those layers'.
    cpu = _blas_eligible(X)
    relayout = cpu and _UNITS_SCIPY and weighted and not full and pr * pc >= _BLAS_MIN
    if relayout:
        # Each side's copy of every "units" layer, kept in reused buffers for the call.
        per_point += itemsize * (n if symmetric else n + m) * sum(
            c * lin.d_out for lin, c, route in
            zip(mlp.linears, _outputs_per_layer(mlp, C), routes) if route == "units")
    if block is None:
        if per_point > memory_budget and launch_bound:
            # The CPU's smaller panels may fit where the GPU's do not.
            return stacked_path_sum(
                mlp, layout, load, weights, X, Y, outputs=outputs, trace_scale=trace_scale,
                weighted=weighted, memory_budget=memory_budget, gram=gram, diag=diag,
                block=block, panel=asked, full=full, launch_bound=False, out=out)
        if per_point > memory_budget:
            # Not one point fits all the rows: tiles of them, each a sum over the whole
            # path (the step-by-step sum was 10 to 70 times slower than this route).
            return _tiled_sum(
                mlp, layout, load, weights, X, Y, outputs=outputs, trace_scale=trace_scale,
                weighted=weighted, memory_budget=memory_budget, gram=gram, diag=diag,
                panel=asked, full=full, out=out, launch_bound=launch_bound)
        block = rows_per_block(memory_budget, per_point, "A block of the path kernel's points")
        block = max(1, min(block, 64))
    elif per_point * block > memory_budget:
        # A block asked for that does not fit: one point at a time (rows_per_block
        # refused instead, which left this branch dead).
        block = 1
    # Units per chunk: the chunk's scaled rows, H and G of a panel, for one point, in
    # cache (and in a quarter of the budget); where launch-bound, in a sixteenth of the
    # budget (beside the blocks, which take all of it).
    unit_bytes = itemsize * (pr * max(lin.d_in + 1 for lin in mlp.linears) + 2 * pr * pc)
    chunk = max(1, (memory_budget // _GPU_SHARE if launch_bound
                    else min(_CACHE, memory_budget // 4)) // unit_bytes)
    # The full blocks' "units" route: T of a chunk, (N, u, M, C): a larger chunk makes
    # the batched GEMM's inner dimension; a quarter of the budget bounds it.
    chunks = (chunk, max(1, min(_FULL_CHUNK,
                                memory_budget // 4 // (unit_bytes + itemsize * pr * pc * C))))
    apart = [li for li, r in enumerate(routes) if r == "dense"] if apart_fits else []
    panel_routes = [None if li in apart else r for li, r in enumerate(routes)]
    K = result = None
    if gram and full:
        result = out if out is not None else large_tensor(
            (n, m, C, C), torch.float64, X.device, zero=not (tiles and weights))
        # Written as (n, C, m, C): the panels' layout.
        K = result.permute(0, 2, 1, 3)
    elif gram:
        K = result = (out if out is not None
                      else torch.zeros((n, m), dtype=torch.float64, device=X.device))
    dx = torch.zeros(n, dtype=torch.float64, device=X.device) if diag else None
    dy = None if (symmetric or not diag) else torch.zeros(m, dtype=torch.float64,
                                                          device=X.device)
    buffer = torch.empty((pr, C, pc, C) if full else (pr, pc), dtype=dtype, device=X.device)
    sel = torch.as_tensor(list(outputs), device=X.device)
    scratch = _Scratch(X.device)
    # On the CPU with torch on one thread, SciPy's BLAS takes the "dense" layers' SYRK and,
    # where :func:`_units_scipy`, the "units" route's products (:func:`_syrk`,
    # :func:`_units`), also on one.
    with _blas_threads(1) if cpu else contextlib.nullcontext():
        for s in range(0, len(weights), block):
            # The last block's factors go before this block's are made: both held at
            # once were two blocks of the budget's points.
            sides = None
            points = [k for k, _ in weights[s : s + block]]
            w = torch.tensor([wk * trace_scale for _, wk in weights[s : s + block]],
                             dtype=dtype, device=X.device)
            theta, D = load(points)
            sides = _block_sides(mlp, layout, theta, D, w, X, None if symmetric else Yt,
                                 outputs, sel, panel_routes, full, scratch)
            if relayout and sides.units_major and _holds_blas():
                _contiguous_units(sides, panel_routes, scratch)
            if diag:
                for li in range(len(routes)):
                    _diag(dx, sides.fx[li], sides.wD[li], w, sides.s[li])
                    if dy is not None:
                        _diag(dy, sides.fy[li], sides.wD[li], w, sides.s[li])
            if tiles:
                _tiles_full(result, sides, routes, w, symmetric, s == 0, _TILE, scratch)
                continue
            if not gram:
                continue
            if apart:
                _dense_strips(K, sides, apart, scratch)
            for rows, cols in _panels(n, m, symmetric, width, strip):
                r, c = rows.stop - rows.start, cols.stop - cols.start
                # A panel contiguous: the routes view it flat (and a full one's rows as
                # (C, M C) for the GEMMs).
                out = (buffer.view(-1)[: r * c * C * C].view(r, C, c, C) if full
                       else buffer.view(-1)[: r * c].view(r, c))
                out.zero_()
                _contract_panel(out, sides, panel_routes, w, rows, cols, chunks, scratch)
                if symmetric and rows.start == cols.start:
                    # The square on the diagonal, symmetrised exactly.
                    if full:
                        square = out[:, :, :r]
                        square.copy_(0.5 * (square + _transposed(square)))
                    else:
                        out[:, :r] = 0.5 * (out[:, :r] + out[:, :r].T)
                if full:
                    K[rows, :, cols] += out
                    if symmetric:
                        # Mirrored now, the panel right of its square: its C x C blocks
                        # transposed (a pass over the whole K afterwards costs more).
                        skip = r if rows.start == cols.start else 0
                        K[cols.start + skip : cols.stop, :, rows] += _transposed(
                            out[:, :, skip:])
                else:
                    K[rows, cols] += out
    if gram and symmetric and not full:
        # (Squares of at most _PANEL: each makes two temporaries of its size.)
        _mirror(K, min(panel, _PANEL))
    if diag and symmetric:
        dy = dx
    return result, dx, dy


def _tiled_sum(mlp, layout, load, weights, X, Y, *, gram, diag, full, out, **kw):
    """:func:`stacked_path_sum` of ``X`` and ``Y`` whose one point's block over all their
    rows exceeds the budget: the larger side halved, each part's sum written into its
    tile of the Gram (a symmetric Gram's two squares on the diagonal and the tile above
    them, mirrored below), halved again where it still exceeds it. Only the Gram is held
    beside the tiles' own blocks; each tile recomputes its rows' factors at every point.
    None where a tile of one row and one column exceeds the budget."""
    symmetric = Y is None
    n, m = X.shape[0], X.shape[0] if symmetric else Y.shape[0]
    if n == 1 and m == 1:
        return None
    C = len(kw["outputs"])
    K = out
    if gram and K is None:
        K = (large_tensor((n, m, C, C), torch.float64, X.device, zero=True) if full
             else torch.zeros((n, m), dtype=torch.float64, device=X.device))

    def part(A, B, rows, cols):
        return stacked_path_sum(mlp, layout, load, weights, A, B, gram=gram, diag=diag,
                                full=full, out=None if K is None else K[rows, cols], **kw)

    if symmetric:
        h = n // 2
        low, high = slice(0, h), slice(h, n)
        parts = [part(X[low], None, low, low), part(X[high], None, high, high)]
        if any(p is None for p in parts):
            return None
        if gram:
            if part(X[low], X[high], low, high) is None:
                return None
            # The tile below the diagonal: the one above it transposed (its C x C
            # blocks too).
            K[high, low] = (_transposed_full(K[low, high]) if full
                            else K[low, high].T)
        dx = torch.cat([p[1] for p in parts]) if diag else None
        return K, dx, dx
    whole = slice(None)
    if n >= m:
        h = n // 2
        halves = [part(X[:h], Y, slice(0, h), whole), part(X[h:], Y, slice(h, n), whole)]
    else:
        h = m // 2
        halves = [part(X, Y[:h], whole, slice(0, h)), part(X, Y[h:], whole, slice(h, m))]
    if any(p is None for p in halves):
        return None
    if not diag:
        return K, None, None
    if n >= m:
        return K, torch.cat([p[1] for p in halves]), halves[0][2]
    return K, halves[0][1], torch.cat([p[2] for p in halves])


def _transposed_full(block: torch.Tensor) -> torch.Tensor:
    """``K(Y, X)`` of an ``(n, m, C, C)`` block ``K(X, Y)``."""
    return block.permute(1, 0, 3, 2)


def _contiguous_units(sides: _Sides, routes: Sequence[str | None], scratch: _Scratch) -> None:
    """The "units" layers' backprops (B, p, N, C) laid out contiguously (a GEMM wrote
    them (B, p, C, N)), so that every unit's rows are one block that SciPy's GEMMs read
    in place (:func:`_units`). Copied into ``scratch``'s buffers: a fresh copy's page
    faults took three times the copy (21 points at N = 1000: 42 against 11 ms)."""
    same = sides.fy is sides.fx
    for side, f in (("x", sides.fx),) if same else (("x", sides.fx), ("y", sides.fy)):
        for li, route in enumerate(routes):
            a, d = f[li]
            if route == "units" and d is not None and not d.is_contiguous():
                f[li] = (a, scratch.get(f"units_{side}{li}", d.shape, d.dtype).copy_(d))


def _mirror(K: torch.Tensor, size: int) -> None:
    """The upper triangle of ``K`` copied below the diagonal, ``size`` columns at a time
    (no temporary as large as ``K``)."""
    n = K.shape[0]
    for s in range(0, n, size):
        e = min(s + size, n)
        square = K[s:e, s:e]
        square.copy_(torch.triu(square) + torch.triu(square, 1).T)
        K[e:, s:e] = K[s:e, e:].T


def _transposed(block: torch.Tensor) -> torch.Tensor:
    """``K(Y, X)`` of an ``(n, C, m, C)`` block ``K(X, Y)``: each ``C x C`` block
    transposed too."""
    return block.permute(2, 3, 0, 1)


def _block_sides(mlp, layout, theta, D, w, X, Y, outputs, sel, routes, full,
                 scratch: _Scratch | None = None) -> _Sides:
    """The factors of one block of points on both sides (``Y=None``: X's), with the
    layers' weighted preconditioners and one-hot sums. ``full``: the backprops
    sample-major (the layout of :func:`_units_full`) and the output rows' products of
    the ``"mixed"`` layer."""
    units_major = D is not None and not full
    fx = _factors(mlp, theta, layout, X, outputs, units_major, scratch, "x")
    fx = [(_ones(a, lin), d) for (a, d), lin in zip(fx, mlp.linears)]
    fy = fx
    if Y is not None:
        fy = _factors(mlp, theta, layout, Y, outputs, units_major, scratch, "y")
        fy = [(_ones(a, lin), d) for (a, d), lin in zip(fy, mlp.linears)]
    wD = [None if D is None else _split_d(D, lin, layout) * w[:, None, None]
          for lin in mlp.linears]
    s = [None] * len(routes)
    if routes[-1] == "onehot":
        q = fx[-1][0].shape[-1]
        s[-1] = ((w * len(outputs))[:, None].expand(-1, q) if D is None
                 else wD[-1].index_select(1, sel).sum(1))
    formed = [None] * len(routes)
    for li, route in enumerate(routes):
        if route == "dense":
            formed[li] = _form_sides(fx[li], fy[li], wD[li], scratch, f"formed{li}")
    mix = [None] * len(routes)
    if "mixed" in routes:
        # The one backprop m_o = |V_o| d_o of the layer below the output layer: its
        # blocks' products are m_xo m_yo Vh_o Vh_o^T with Vh_o = V_o / |V_o| (V_o = 0
        # makes m_o = 0, and Vh_o is then taken 0).
        V = _layer_params(mlp, theta, layout)[-1][0].index_select(1, sel)  # (B, C, p)
        norm = V.square().sum(1, keepdim=True).sqrt()
        Vh = torch.where(norm > 0, V / norm.clamp_min(torch.finfo(V.dtype).tiny), 0)
        C = V.shape[1]
        # The strict lower triangle's entries (d, c) first among the upper's (c, d).
        c, d = torch.triu_indices(C, C, 1, device=V.device)
        cc = torch.arange(C, device=V.device)
        c, d = torch.cat([c, cc]), torch.cat([d, cc])
        mix[routes.index("mixed")] = (Vh[:, c] * Vh[:, d], c * C + d,
                                      (d * C + c)[: len(c) - C])
    return _Sides(fx, fy, wD, s, units_major, formed, mix, sel)


def block_forward_error(mlp: StackedMLP, layout: dict, theta: torch.Tensor,
                        module: nn.Module, params: dict, X: torch.Tensor) -> float:
    """Relative difference between this route's forward and the module's own at a point.

    The route rebuilds the network from its layers; a module that computes something
    else (a subclass's behaviour the checks above cannot see) shows up here.
    """
    with torch.no_grad():
        ours = forward_block(mlp, theta[:1], layout, X)[0]
        ref = functional_call(module, params, (forward_input(X),))
    if ref.shape != ours.shape:
        return math.inf
    scale = ref.abs().max().clamp_min(torch.finfo(ref.dtype).tiny)
    return float((ours - ref).abs().max() / scale)
