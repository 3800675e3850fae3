"""The kernel-machine representation: every prediction split over the training points.

For every recorded step, ``f(x; theta_{t+1}) - f(x; theta_t) = rho_t(x) . dtheta_t`` where
the row vector ``rho_t(x)`` is

- ``exact``: the segment-averaged Jacobian ``int_0^1 J(x; theta_t + s dtheta_t) ds`` by
  Gauss-Legendre quadrature, with nodes added per step until its error is under the
  tolerance (see *Error control* below);
- ``first_order``: ``J_t(x)`` (Domingos' formula, error O(lr));
- ``second_order``: ``J_t(x) + 1/2 (H_t(x) dtheta_t)^T`` (adds the curvature term, O(lr^2)).

Every solver's step is linear in the per-step loss gradients ``d_s``:
``dtheta_t = -coef_t D_t sum_{s<=t} m^{t-s} d_s (+ decoupled weight decay)`` with memory
``m`` = momentum (SGD), beta_1 (Adam / AdamW) or 0 (plain SGD, RMSprop), ``coef_t`` = lr_t
or Adam's ``lr_t (1 - beta_1) / (1 - beta_1^t)`` (``Trajectory.step_coefficients``), and
``D_t`` the recorded diagonal preconditioner. Nesterov momentum adds the step's own
gradient outside the memory, ``-direct_t D_t d_t`` (``direct_t = lr_t``,
``coef_t = m lr_t``).
``d_s = (1/|B_s|) sum_{i in B_s} J_s(x_i)^T r_{s,i} + wd * theta_s`` (L2 solvers).
So ``f(x; theta_T) - f(x; theta_0) = sum_s (lambda_s(x) - direct_s D_s rho_s(x)) . d_s``
with the adjoint ``lambda_s = nu_s + m lambda_{s+1}``, ``nu_t = -coef_t D_t rho_t(x)``
(the own-gradient term of a Nesterov step is added for its batch and taken off before
the memory carries ``lambda_s`` to earlier steps), computed backwards
over the steps with ONE (queries x outputs x P) buffer: no N x P x T tensor is formed.
Sample ``i``'s contribution is ``a_i(x) = sum_{s: i in B_s} lambda_s(x) . J_s(x_i)^T r_{s,i}
/ |B_s|``; weight decay goes to ``regularization``.

Routes. The layers' factors (:mod:`._tangent`) are used on both sides of every product,
so no Jacobian is formed for layers with a rule (:mod:`._tangent._pairs`):

- plain SGD (no memory, ``D = I``: Domingos' setting):
  with no memory, ``lambda_t = -lr_t rho_t(x)``, and sample i's share of step t is
  ``-lr_t / |B_t| sum_k w_k J(x; theta_t^k) J(x_i; theta_t)^T r_{t,i}``, a
  cross-parameter tangent Gram between the queries at the quadrature nodes and the
  batch at ``theta_t``: O(Q B sum_l (d_in + C d_out)) per node for nn.Linear;
- momentum, Adam, AdamW, RMSprop: the adjoint buffer is updated per layer by one batched
  GEMM over the quadrature nodes (``sum_k w_k delta_k a_k^T``) and contracted with the
  batch's per-sample gradients ``dhat_i (x) a_i`` (formed, one GEMM over each
  parameter, or with few query rows ``(lambda a_i) . dhat_i`` from the factors,
  ``_pairs.formed_contraction``): 2 Q C P B FLOPs per step, the floor of any method
  that forms the per-step pair terms. The steps stay one at a time: the adjoint's
  recursion runs through them, so a block of steps would pair every query's step with
  every later batch (``T_b / 2`` times the products) instead of sharing one GEMM;
- the dense route (``second_order`` only) forms each node's Jacobian and the batch's
  per-sample loss gradients, its adjoint a float64 P-vector per query output (a float32
  one erred over the round-off estimate the routes share,
  ``benchmarks/results/dense_roundoff-s47.md``). Terms of a layout the pair engine
  does not keep factored stay on the routes above, as per-sample gradients
  (``_pairs.pair_terms``); the dense route's ``method="exact"`` branch is what the
  tests check the other routes against, with a float32 path's round-off estimate as
  theirs.

Captures. For an ``nn.Sequential`` of ``nn.Linear`` layers and elementwise activations
(the estimators' default network, :func:`._tangent.stacked_mlp`), the factors come from
one batched forward and backward over a step's quadrature nodes, and the batch's from
one pass without the capture engine's hooks (:class:`_StackedCapture`, checked against
the engine's capture once per call). On the default classifier on digits the hooked
captures were about a sixth of ``attribute``'s time with Adam and half with SGD
(profiled, 100 queries): set-up repeated per capture, for little arithmetic. Neither
side of a step reads the adjoint, so both are captured for blocks of steps
(``STEP_BLOCK``, within an eighth of ``memory_budget`` each, of what the blocks of queries
and of batch rows leave at most a quarter): the batches of the steps the
walk takes next, each at its own parameters with its own rows, in one stacked pass
(:meth:`_Context._capture_ahead`), and a chunk's queries at the nodes of the next steps
(:class:`_NodesAhead`), at the count its step before ended with, which the next steps
try first unless they try one node less (every fifth step at least); a lowered or raised
try captures its step alone. A point's products in a pass of two points or more are the
same whatever the pass (torch's batched GEMM: bit for bit, 2 to 32 points measured), but
torch runs a pass of one point as a plain GEMM, another kernel (float32 contributions
6e-9 relative apart on a small SGD path): where the room holds two points, a pass of
one runs as two (:meth:`_StackedCapture.batched`), so that a step's captures do not
depend on the block it falls in, and a range of steps on a worker gives the serial
call's numbers. Where the budget holds one step a pass, every call captures every
step alone.
What stays per step is the float64 arithmetic that reads the step's direction or its
chunk's node choice (the products with the step, the adjoint's update and contraction,
plain SGD's shares).

Per-step arithmetic (issue 35). On the default classifier on digits (100 queries,
batches of 200) a step's products are tens of MFLOP, so the count and the memory passes
of the torch calls around them are the cost, not the GEMMs. The contributions are kept
sample-major, ``(N, queries, outputs)``, and a step's shares added to its batch's rows:
a query-major buffer took a scattered write per query and sample, the largest single
item of plain SGD's ``first_order`` profile (ten outputs), ahead of the step's GEMMs.
Plain SGD's shares come sample-major from their GEMMs (:func:`._tangent.factor_shares`,
all nodes of a chunk in one GEMM per factor), and the quadrature's products with the
step take one GEMM per layer for all its inputs and nodes
(:func:`._tangent.directional`). The first-order methods' query captures at
``theta_t`` are made for blocks of steps as the exact nodes are (:class:`_NodesAhead`
with ``at_start``): a chunk of queries took one capture per step, its set-up for a
single small pass. Measured in one process against the previous code
(``benchmarks/results/verbs_ab.md``: 1.1-1.3x on plain SGD's first-order
``decompose`` and ``attribute``; its exact ``attribute`` 0.88-1.25x over two runs, with
``verbs_ab-first.md``; none on Adam, whose time is its contraction)
and against the FLOP floors (``benchmarks/results/verbs_floor.md``): what is left is
per chunk of queries and per step (the float32 captures of each chunk apart, so that a
block of queries on a worker gives the serial call's numbers), and on the adjoint route
the float64 contraction itself.

Chunks. The node choice below is made per chunk of queries (``node_chunk``), from that
chunk's residuals: a block of the queries on a joblib worker, cut at chunk boundaries,
takes the serial call's nodes and gives its numbers. A chunk's node choice costs about
the same at every step whatever its size; on plain SGD it is most of the call and the
workers split the steps, so the chunks there are few: at most two up to ``2 NODE_CHUNK``
queries (seven of 16 before on 100 queries: plain SGD's exact ``attribute`` of 100
digits 1.9-2.2x faster, ``benchmarks/results/verbs_ab-chunks.md`` and ``-first.md``). On
the adjoint route the queries are the workers' blocks, and a chunk costs a few percent
of the call (two chunks instead of seven: Adam's ``attribute`` 1.24x, ``explain`` 1.11x,
``verbs_ab-chunks-first.md``): chunks of a quarter of the queries, at most
``BLOCK_CHUNK``, so that four workers or more get blocks. The chunks of a query block
walk the steps together: a step's batch capture, float64 directions and node parameters
are made once for all of them; the chunks that try the same node count take their
float64 products with the step in one pass (and in float64 their captures too). They
share one adjoint buffer (:class:`._tangent.Adjoint`): each chunk's rows are updated
from its own nodes, and the batch's formed gradients are made once per step and
contracted with every row of the block in one GEMM. A buffer per chunk (with chunks of
4-16 queries: 40-160 rows of ten outputs, 4-16 of the margin) forms the batch's
gradients once per chunk, and a chunk with fewer rows than a layer's inputs takes the
factor contraction's two extra passes: measured, about a third of ``decompose`` of 10
queries and of ``attribute`` of 100 (one thread). The queries' captures stay per chunk
in float32 (see below), about a fifth of those calls when made step by step: their GEMMs
are small, the per-capture set-up is most of it (hence a chunk's captures for a block of
steps, see *Captures*).

A contracted output (``weights``: ``attribute``'s ``w_q . f(x_q)``) takes the same routes
with one output per query: its captures backpropagate ``w_q . f`` once (the factors are
linear in the output's seed; the dense route forms ``d(w_q . f) / dtheta`` from them), so
every query-side product above costs what it costs for a single-output network. The
batch enters only through its loss gradients, captured the same way with the loss
residuals as the seed.

Thinned paths (``record_every > 1``). The steps between two recorded points are replayed
(:class:`EveryStep`, over the unrolled attribution's :class:`._unrolled.Replay`), and
every route above reads the thinned path as one recorded at every step: each step's own
gradients and preconditioner, its own quadrature. The replay's mismatch with the next
recorded point is the result's ``replay_error``, warned of above the dtype's limit. Where
the steps cannot be replayed (:func:`._unrolled.check_replayable`), an interval's steps
take its segment and their batches' gradients at its first point (:func:`_intervals`),
and the result warns with its error.

Error control (``method="exact"``). The quadrature error of step t is measured, not
guessed: with ``q_t(x) = rho_t(x) . dtheta_t`` computed from the same factors (in
float64), ``|q_t(x) - (f(x; theta_{t+1}) - f(x; theta_t))|`` is that step's error, since
everything else in the decomposition is linear algebra on the recorded path. Nodes are
added until the largest residual over the queries and outputs is under the step's share
of the tolerance, ``tol * S * |df_t| / sum_s |df_s|`` (``S`` the largest |f| along the
path, ``|df_t|`` the step's largest change), so that the steps' errors add up to at most
``tol * S``. Below the round-off of the two forward passes (a few ``eps |f|``) and of
the factors the residual cannot resolve the quadrature error: a step whose residual
reaches that floor stops there. Where the floor is one learnt at another step (raised
where a step stalled at its round-off), a node more must first fail to cut the residual
tenfold: a quadrature error falls, round-off does not. Nodes added without halving a
residual under ``FLOOR_MAX`` times that floor's factor part say the same: the factors'
rounding, nearly alike at nodes this close, adds up over the nodes while the 2-norm of
the terms it is scaled by falls with the weights (a float32 query alone, its share of
tol under its residual's round-off, took nodes to the memory limit). The step stops
there, and the later ones assume that floor. A step that reaches neither
within ``MAX_NODES`` nodes (or stops converging: a non-smooth activation) is reported in
a ConvergenceWarning.

The residual is that of the SUM of the step's shares: point i's share errs by
``delta_rho_t . dtheta_t^(i)``, which it does not bound where the points' parts of the
step cancel (a full batch near convergence, Adam's normalised steps), nor where they
move along a direction in which the queries' gradients bend while f changes linearly
along the step: there the residual, and any estimate made from it, stays at round-off
while each share keeps its error (``benchmarks/audit_contribution_blind_spot.py``:
3e-15 read from the residuals against 0.03 measured, on modules built for it). Only a
quadrature with more nodes measures a share's error, so every exact decomposition takes
at each step, beside the chosen rule of n nodes, the rule of n + 1 (an embedded pair, in
the same walk): each capture of the queries at the n nodes holds the n + 1 others in the
same stacked pass (:class:`_NodesAhead` with ``pair``), and the difference of the two
rules, ``sum_k w'_k J(x; s'_k) - sum_k w_k J(x; s_k)``, goes through the adjoint (or
plain SGD's shares) on rows of its own beside the queries' (:func:`_pair_groups`), so
that the step's batch capture, its directions, the node choice and the contraction's
formed batch gradients serve both. The rule of n + 1 is returned (the contributions
plus the difference), and the largest difference of one contribution (over queries,
training points and outputs) is ``contribution_error``: the n-node rule's error up to
the returned rule's, so above the returned rule's own wherever a node more at least
halves it (Gauss-Legendre gained 10-300x per node on the paths measured). Where it is
over ``tol * S`` in a chunk of queries, that chunk's nodes are raised ``RAISE`` per walk
(at most ``CHECK_RAISES`` walks more) and the walk with the smallest measured error is
kept with it; over still, a ConvergenceWarning says so (:func:`_contribution_check`).
Fixed ``n_nodes`` are returned as asked, measured by the rule with a node more.
Round-off. On a float32 path a contribution's error is mostly the round-off of the
float32 factors its shares are computed from (the queries' and the batch's gradients,
the adjoint's float32 sums over steps), which the two rules' difference, taken from the
same factors, does not see: against a float64 16-node reference of the same recorded
path it read 0.33x the true error on the default classifier on digits and 0.0137 of
``1e-6 * S`` against a true 1.1 on converged full-batch Adam with training points as
queries (``benchmarks/results/contribution_roundoff.md``). Most of it is the round-off
of the batches' float32 loss residuals (``benchmarks/results/roundoff_model-s56.md``):
f(x_i) rounds by about eps |f| whatever the CPU's kernels (MKL's SSE2 path and ATen's
default capability left it unchanged), near convergence the residual is a small part of
f, and where the parameters barely move it rounds alike at every step, so its relative
round-off (median 5-7 eps32 on converged full-batch Adam, 69-99 at the 90th
percentile) adds up in each share, which is linear in it (the first-order prediction
``sum_t share_t dr_t / r_t`` matched the true errors with correlation 0.97-0.996; with
residuals from a float64 forward they fell 5.7-53x). So each contribution's difference
is reported with its round-off added, ``sum_t |share_t| (ROUNDOFF eps32 + e_t)``
(summed in the walk, beside the contributions): ``e_t`` the relative round-off of the
training point's residual at step t, measured against a float64 forward of the batch
(:meth:`_Context.rounding`), ROUNDOFF = 4 the other float32 factors' (at most 4.3 of
the error left with float64 residuals on three converged full-batch Adam paths). An
estimate, not a bound: 2.7x the true error on converged full-batch Adam (seed 1) on an
AVX2-only AMD EPYC, where a fixed ``15 eps32 sum_t |share_t|`` read 1.15x and 3 read
0.23x, and it follows a worse rounding (a residual error 60 eps32 more: 2.31x, where the
fixed 15 read 0.41x). Over the 39 audited paths the fixed 3 read 1.7-27.1x the true
error on an AVX-512 Xeon (``benchmarks/results/contribution_roundoff-s45.md``); against
a reference whose batch gradients are float32's, as the training's were, 2.65-52x
(``benchmarks/results/contribution_roundoff-s46.md``). It is checked against what
float32 products can be checked to: the default tol, 1e-6, is about 8 eps32, at their
round-off floor, and any coefficient that reaches the true error on every audited
path also warned on default paths whose true error is under ``1e-6 * S``. So with
``tol=None`` a float32 path's nodes are still chosen (and raised) for 1e-6, but
``contribution_error`` is checked against ``FLOAT32_CHECK_TOL * S`` (1e-5, the
products' floor); an explicit ``tol`` is checked as given, and where the round-off
estimate alone is over it, or tips over it a two rules' difference that meets it, a
PrecisionWarning names float64 as the fix (more nodes cannot help).
``Decomposition.contribution_tol`` says which. A float64 path's round-off, 2e-9 of
float32's, is not added.
Where a node more does not gain, the difference measures nothing: a kink of a
non-smooth activation (relu) on a step's segment before the first node or after the
last of both rules is missed by both alike (they agreed to 1e-17 where a contribution
missed by 1.2e-4, 3.5x ``tol * S``, with the step's sum within tol:
``benchmarks/results/contribution_error_kink.md``). The step's sum tells: its residual
by the rule with a node more is measured too (:meth:`_Quadrature.paired`), and a step
where it is above round-off and over twice the two rules' difference is warned of
(a ConvergenceWarning that ``contribution_error`` does not measure the error there).
A kink between nodes shows in the difference; a step whose kinks the sum's node choice
cannot integrate is warned of as failed. Smooth steps too large for a few nodes gain
less than twofold per node: there the difference read up to 1.4x under the returned
rule's error (RMSprop's first step at lr 0.2, under ``tol * S`` all the same).

Cost. Profiled (cProfile, one thread), a walk of the default classifier on digits
spends 58% in the adjoint's update and contraction, 26% in the queries' captures and
products at the nodes and 5% in the batches' captures; on a float64 regressor on
diabetes the batches' captures are 12%; on a small CNN the queries' captures through
the capture engine dominate. A second walk with a node more (tried first) cost 2.0x the
code before on the default classifier and 1.75x on the default regressor; the pair in
one walk costs 1.73x and 1.50x (float32), 0.62x on the regressor in float64 and 0.91x on
converged full-batch Adam, each of which that code walked three times (that code run on
today's kernels; ``benchmarks/results/contribution_check_overhead.md``). What it adds is
the queries' captures at n + 1 more nodes and the difference's rows in the adjoint's
update and contraction (the contraction's GEMM has twice the rows), and per step and
chunk one product of the two rules' difference with the step (the sum's check of the
pair).
A float32 adjoint contracts the difference's rows with the batch in float32 (``Adjoint``'s
``coarse``): their round-off is relative to the difference, far under ``tol * S``
(contributions moved 7.5e-14 of the largest at most, ``contribution_error`` not in its 3
digits), where float64's costs 1.35x: 0.96x the time on the default classifier, none
gained on the small regressor. Plain SGD's shares take the rule with a node more at its
own nodes and subtract the rule's after the walk (float64 sums of float32 products,
each node's product at float32 round-off: the n + 1 nodes' rows stacked in one GEMM
may round apart from the 2n + 1 nodes' that the difference's weights took, so a float32
path's contributions move at float32 round-off, a float64 one's at float64's), the n
nodes' products once instead of twice:
0.965x. The adjoint keeps the difference on rows of its own: in float32 two buffers'
difference holds their round-off, of the shares' size, and the subtraction gained
1-3% (same file).
A float32 path's round-off estimate (the shares' absolute values added per step into
one more buffer of the contributions' size) cost 0.997x and 0.998x the time before it
on the default classifier and regressor, within the runs' noise
(``benchmarks/results/contribution_roundoff-s45-cost.md``); its float64 forward of each
step's batch, for the residuals' round-off, costs what ``roundoff_model-s56.md`` gives.
"""

from __future__ import annotations

import functools
import math
import numbers
import warnings
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch
from sklearn.exceptions import ConvergenceWarning
from torch.func import grad, jacrev, jvp, vjp, vmap

from .._checkpoint import functional_call
from .._device import forward_input
from .._memory import rows_per_block
from .._modules import copy_module, recurrent_on_cuda
from .._parallel import _ranges
from .._path._losses import Loss
from .._path._trajectory import Trajectory, mean_batch_weights
from .._second_order import FORWARD_AD, check_twice_differentiable, twice_differentiable
from .._tangent import (
    Adjoint,
    capture,
    dense_rows,
    directional,
    factor_shares,
    forward,
    hidden_reads,
    pair_terms,
    stacked_mlp,
    tangent_features,
)
from .._tangent._pairs import Flat, prepare_directions
from .._tangent._stacked import _global_hooks, _hooked, _Scratch, forward_factors
from .._warnings import caller_stacklevel, worse, worst
from ._unrolled import PrecisionWarning, Replay, _first_moment, check_replayable, replay_limit

__all__ = ["Decomposition", "block_align", "check_tol", "decompose", "default_tol", "finish",
           "merge", "merge_steps", "node_chunk", "replays", "step_ranges"]

# Measured on RMSprop's first steps at lr 0.02 (every parameter moves by 0.2): 32 nodes
# reach 2e-8 relative there, 48 1e-11 (two to eight panels of fewer nodes do no better).
MAX_NODES = 64
# The walks that the per-contribution check may add where the error it measured is over
# tol * S (see _contribution_check), each with RAISE nodes more per step than the one
# before (a walk measures its own rule against the one of a node more: two nodes more
# is the next rule not measured yet).
CHECK_RAISES = 3
RAISE = 2
# A float32 path's round-off of one contribution beside its residuals' (measured at
# every step, _Context.rounding), in eps32 times its steps' summed absolute shares
# sum_t |w_i lambda_t . g_it|: the other float32 factors' (the batch's and the queries'
# factors, the adjoint's float32 sums over steps: a few roundings each). With the
# batches' residuals from a float64 forward, converged full-batch Adam (two training
# points as queries, seeds 0-2, AVX2 AMD EPYC) erred up to 2.3, 3.5 and 4.3 of these
# (benchmarks/results/roundoff_model-s56.md); with the adjoint in float64 and with
# MKL's SSE2 kernels, as before. The fixed 15 that this replaced (3 on AVX-512 Xeons)
# held the residuals' round-off too, which depends on the path (how small its
# residuals get), not on a coefficient: 15 read 1.15x on one path and 0.41x on it with
# a residual rounding 60 eps32 worse.
ROUNDOFF = 4
# A module that does not run in float64 (whose batches' residuals the walk cannot
# measure against float64, see _Context.rounding): the round-off of its f, in eps |f|
# (the most measured: 3.5 eps32 |f| on converged full-batch Adam).
RESIDUAL_ROUNDOFF = 4
# What a float32 path's contribution_error is checked against with tol=None, relative
# to the largest |f| along the path: the round-off floor of float32 products (2e-7 to
# 1e-5 relative, see default_tol), which the default tol of the node choice, 1e-6, sits
# under. Checked against 1e-6, ROUNDOFF's estimate warned on default paths whose true
# error is under it (from a coefficient of 0.78: contribution_roundoff.md), so no
# coefficient that reaches the true error is silent there; an explicit tol is checked
# as given (a PrecisionWarning names float64 where the round-off makes it miss).
FLOAT32_CHECK_TOL = 1e-5
# Nodes per step once the steps stop converging (non-smooth activations): the count
# from which _stalled judges.
NONSMOOTH = 8
# A residual under NOISE * eps * (|f(theta_t)| + |f(theta_{t+1})|) is at the round-off of
# the forward passes that define it (measured floors: 1-6 eps |f| in float64 and float32),
# plus FACTORS * eps * spread, the factors' own (see _pairs.directional).
NOISE = 16
FACTORS = 4
# A residual that stops falling below FLOOR_MAX * eps * spread is round-off, not a kink
# (relu kinks leave residuals orders of magnitude above it).
FLOOR_MAX = 100
# The relative reconstruction error that an exact decomposition reaches beyond its
# quadrature residuals, from the linear algebra's round-off; larger ones warn.
INEXACT_FLOOR = {torch.float64: 1e-10, torch.float32: 1e-4}
# The tolerance up to which a step range may restart the node choice: the ranges' sums
# then agree with the serial call's to 1e-12 relative (see replays).
REPLAY_TOL = 1e-12
# Gauss-Legendre nodes per step that the cost of splitting a path assumes (measured
# counts: 1-3 in float32, 2-6 in float64 at its default tol).
NODES_GUESS = 2
# A step's query side (the node choice's captures, the float64 products with the step
# and the reference f), in batch rows per query, where a range replays it: measured
# 8.75 ms a step for 10 queries against 2.25 ms for a batch of 64 on the 64-512-512-1
# MLP in float32 (per-step overheads dominate at few queries).
REPLAY_ROWS = 25
# The most queries whose nodes are chosen together (see node_chunk): the node count of
# a step is chosen from the residuals of one chunk of queries, the same whether the
# call gets all the queries or a block of them on a worker (blocks are cut at multiples
# of the chunk), so that the blocks give the serial call's numbers. Each chunk pays its
# own node choice at every step (its tries, retries and products with the step). On
# plain SGD that is most of the call, about 2.9 ms a step on the default classifier
# whatever the chunk's size from 16 to 128 queries (2.6 s of a 7-23 s call per chunk,
# benchmarks/results/node_chunk_sizes.md), and its workers split the steps, not the
# queries (step_ranges): a few large chunks (at most NODE_CHUNK). On the adjoint route
# a chunk costs 0.3-0.5 s of Adam's 11-16 s calls there (verbs_ab-chunks-first.md), and
# the queries are the workers' blocks: chunks of a quarter of them (at most
# BLOCK_CHUNK), as many blocks. (The dense route, second order only, chooses no nodes.)
NODE_CHUNK = 128
BLOCK_CHUNK = 32
# The most recorded steps whose batches one stacked pass captures (an eighth of the
# memory budget may cap it lower; the same for a chunk's queries at the nodes): the
# batch side of a step reads neither the queries nor the adjoint, so the steps the walk
# takes next are captured ahead, one set-up for the block. Beyond a few steps the pass's
# own arithmetic dominates (a batch of 200 rows of the default classifier is one
# 200 x 64 x 64 GEMM per layer).
STEP_BLOCK = 16
# A thinned path's replay (:class:`EveryStep`) holds its intervals within a quarter of the
# memory budget, else checkpoints them and holds PIECES pieces of each at once (two: a
# block of steps read ahead across a piece's first step does not replay it again).
REPLAY_SHARE = 4
PIECES = 2
# Bytes of a Hessian-vector product's formation per query, in units of its (C, P) result:
# torch.func's jvp of a jacrev under vmap held about 3.6 of them at once on the default
# MLPs (peak RSS; 1, 3 outputs, 5k to 69k parameters).
HVP_FORMS = 4
# Quadrature nodes whose parameter points (and their stack, two points each) the memory
# plan of an exact decomposition holds room for: a step's try of more nodes captures
# them in groups where the budget leaves no more room (:class:`_NodesAhead`).
NODE_POINTS = 4
# Float64 vectors over the parameters that an exact decomposition's step holds beside its
# node points (theta_t, theta_{t+1}, their float64 difference, the decay direction, the
# prepared directions, the preconditioner and the decay's product): measured, 6 of the
# 9 such vectors live at a capture on a small Adam path with weight decay.
STEP_VECTORS = 8


@dataclass
class Decomposition:
    """A prediction decomposed over the training points.

    ``initial + contributions.sum(axis=1) + regularization`` equals ``prediction`` up to
    ``error`` (exact for ``method="exact"``, the formula's own error otherwise).

    Attributes
    ----------
    initial : ndarray of shape (n_queries, n_outputs)
        f(X; theta_0), the network at initialization.
    contributions : ndarray of shape (n_queries, n_train, n_outputs)
        a_i(x): how much training point i moved the prediction at x.
    regularization : ndarray of shape (n_queries, n_outputs)
        What no training point owns (weight decay).
    prediction : ndarray of shape (n_queries, n_outputs)
        f(X; theta_T), the trained network.
    error : float
        max |initial + sum(contributions) + regularization - prediction|: the error of
        the contributions' sum; a single contribution's can be larger where the
        points' shares cancel: ``contribution_error`` is that one's (see the module's
        *Error control*).
    method, weighting : str
    n_nodes : ndarray of int of shape (n_steps,) or None
        ``method="exact"``: the Gauss-Legendre nodes each optimizer step used (the
        largest over the query blocks): with adaptive nodes those of the rule returned,
        a node more than the node choice's, whose residuals ``step_errors`` are; one
        per recorded interval on a thinned path whose steps could not be replayed
        (shape ``(len(trajectory) - 1,)``, as ``step_errors``). None for the other methods.
    step_errors : ndarray of shape (n_steps,) or None
        ``method="exact"``: each step's measured quadrature residual, the largest over
        queries and outputs of ``|rho_t(x) . dtheta_t - (f(x; theta_{t+1}) -
        f(x; theta_t))|`` (round-off of the two forward passes included); with
        ``normalize_y``, times the largest target scale (a bound in the units of y).
    tol : float or None
        The relative tolerance the exact method worked to (None with a fixed
        ``n_nodes`` or another method).
    replay_error : float or None
        On a thinned path (``record_every > 1``), whose steps between recorded points
        are replayed: the replay's largest mismatch with the next recorded point,
        relative to the interval's move (round-off, about 1e-15 in float64, when the
        record holds the training; a warning fires above the dtype's limit). None
        where every step is recorded or nothing could be replayed.
    contribution_error : float or None
        ``method="exact"``: the largest error of a single contribution (over queries,
        training points and outputs; ``error`` is that of their sum), measured as its
        largest difference between the Gauss-Legendre rule of each step and the rule of a
        node more, taken in the same walk; the contributions returned are the latter's
        (see the module's *Error control*). On a float32 path an estimate of each
        contribution's round-off, which the difference does not measure, is added to
        it (the module's *Round-off*). Checked against ``contribution_tol * S``
        (``S`` the largest |f| along the path) and warned of above it, after up to
        ``CHECK_RAISES`` walks with nodes raised where the difference is over
        ``tol * S``. It measures the quadrature error only where a node more gains:
        a kink of a non-smooth activation that both rules miss alike is not in it,
        and a warning says so where a step's sum shows it (see the module's *Error
        control*). None for the other methods.
    contribution_tol : float or None
        ``method="exact"``: what ``contribution_error`` was checked against, relative
        to ``S``: ``tol``; with ``tol=None`` on a float32 path, 1e-5, the round-off
        floor of float32 products (``FLOAT32_CHECK_TOL``: ``tol``, 1e-6, is under it,
        and the nodes are still chosen for it); with fixed ``n_nodes``, the exact
        checks' accuracy (1e-10 in float64, 1e-4 in float32). None for the other methods.
    """

    initial: np.ndarray
    contributions: np.ndarray
    regularization: np.ndarray
    prediction: np.ndarray
    error: float
    method: str
    weighting: str
    n_nodes: np.ndarray | None = field(default=None)
    step_errors: np.ndarray | None = field(default=None)
    tol: float | None = None
    replay_error: float | None = None
    contribution_error: float | None = None
    contribution_tol: float | None = None

    @property
    def reconstruction(self) -> np.ndarray:
        """``initial + contributions.sum(axis=1) + regularization``."""
        return self.initial + self.contributions.sum(axis=1) + self.regularization


def default_tol(dtype: torch.dtype) -> float:
    """The relative quadrature tolerance of ``method="exact"`` (``tol=None``).

    Below the dtype's round-off floor of the whole decomposition, so that the result sits
    at that floor: 1e-12 in float64 (measured results 1e-14 to 1e-12 relative), 1e-6 in
    float32, whose floor, the round-off that the recorded float32 updates carry, is about
    2e-7 to 1e-5 relative depending on the width, the solver and the size of the steps.
    The nodes are chosen for it; a float32 path's ``contribution_error``, which counts
    its products' round-off, is checked against that floor's top, ``FLOAT32_CHECK_TOL``
    (1e-5), instead: 1e-6 is below what float32 products can be checked to (an
    explicit ``tol`` is checked as given).
    """
    return 1e-6 if dtype == torch.float32 else 1e-12


def check_tol(tol) -> None:
    """``tol`` of every ``decompose``: None or a positive finite real."""
    if tol is not None and (isinstance(tol, bool) or not isinstance(tol, numbers.Real)
                            or not math.isfinite(tol) or tol <= 0):
        raise ValueError(
            f"tol must be a positive number (the relative quadrature tolerance) or None, "
            f"got {tol!r}."
        )


@functools.cache
def _gauss(n: int) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Gauss-Legendre nodes and weights on [0, 1] (asked for at every step of every
    chunk of queries: computed once)."""
    s, w = np.polynomial.legendre.leggauss(n)
    return tuple(((s + 1.0) / 2.0).tolist()), tuple((w / 2.0).tolist())


def _params(traj: Trajectory, flat: torch.Tensor):
    return dict(traj.unflatten(flat))


class _Reroute(Exception):
    """A capture found a parameter read outside its layer that the path check did not:
    the decomposition starts again with every capture routing it to the fallback."""

    def __init__(self, exclude: frozenset[str]):
        super().__init__(sorted(exclude))
        self.exclude = exclude


# --------------------------------------------------------------------------- nodes
class _Quadrature:
    """Chooses the Gauss-Legendre nodes of every step and keeps what they achieved."""

    def __init__(self, n_steps, *, tol, n_nodes, changes, scale, dtype, f=None, plan=None):
        self.fixed = n_nodes
        # Per step, a node count to take instead of choosing one (the check of the
        # contributions' own errors, see _contribution_check).
        self.plan = plan
        self._next = n_steps - 1  # the step the walk takes next (it walks backwards)
        self.f = f  # the reference f of the queries at every point
        self.scale = scale  # the largest |f| along the path
        self.eps = float(torch.finfo(dtype).eps)
        self.tol = tol
        total = float(changes.sum())
        self.budgets = (tol * scale * changes / total if total > 0
                        else np.zeros(n_steps))
        if not np.isfinite(self.budgets).all():
            # tol * scale * change overflowed (outputs near the dtype's largest value): an
            # infinite share would accept any residual. Rescaled only here, so that the
            # budgets of every other path keep their rounding.
            self.budgets = tol * scale * (changes / total)
        self.n_used = np.zeros(n_steps, dtype=np.int64)
        self.errors = np.zeros(n_steps)
        # The estimated round-off of a float32 path's largest contribution, and the
        # largest two rules' difference alone (what more nodes can cut; see
        # _contribution_check), zero where not estimated.
        self.roundoff = 0.0
        self.difference = 0.0
        self.failed: dict[int, float] = {}
        # Steps whose sum's error by the rule with a node more is above round-off and
        # over twice the two rules' difference: their ratio (see paired).
        self.slow: dict[int, float] = {}
        # Each step's largest round-off of a residual (the rule with a node more has
        # its own factors' round-off: float32's reached 4-16 eps * spread there).
        self._floors = np.zeros(n_steps)
        # Steps accepted at the round-off floor with a residual above their share of
        # the tolerance: a tol below what the dtype resolves (see finish).
        self.floored: dict[int, float] = {}
        self._n = None  # the node count of the step done before
        self._room = False  # whether that step had room for one node less
        self._since_lower = 0
        self._stalls = 0  # steps that stopped converging
        self._floor = FACTORS  # the factors' round-off, in eps * spread
        self._ratio = 0.1  # error reduction per added node, from the residuals seen
        # The most nodes whose captures of this chunk's queries fit memory_budget
        # (set by the walk, :func:`_node_limit`), and the steps that failed at it.
        self.limit = MAX_NODES
        self.capped: dict[int, float] = {}

    def choose(self, t, evaluate, df, noise):
        """The nodes of step t; returns the accepted evaluation's payload.

        ``evaluate(n) -> (q, spread, payload)``: the quadrature ``q`` (rows, C) of
        ``J_bar_t . dtheta_t``, the 2-norm of its terms (see ``_pairs.directional``),
        and what the caller keeps. ``df`` (rows, C) is the step's change of f (the
        reference), ``noise`` the round-off of that difference.
        """
        fixed = self.fixed if self.plan is None else self._planned(t)
        self._next = t - 1
        if fixed is not None:
            q, spread, payload = evaluate(fixed)
            r = _residual(q, df)
            self._floors[t] = noise + FLOOR_MAX * self._spread(spread)
            if not math.isfinite(r):
                self.failed[t] = r
            elif self.plan is not None and self.plan[t] > fixed and r > self.budgets[t]:
                # The check's raise stopped at memory's limit: its warning says so.
                self.capped[t] = r
            self._record(t, fixed, r)
            return payload
        budget = self.budgets[t]
        n, cap, lowered = self._start()
        self._since_lower = 0 if lowered else self._since_lower + 1
        seen, stalled = [], False
        probe = None  # the count whose residual a node more is checking (see below)
        while True:
            # The try before is dropped before the next is captured: both alive held
            # the captures of two node counts at once (on a narrow ResNet, with the
            # first try and the step before's, 1.07x a 477 MiB budget against 0.72x).
            q = spread = payload = None
            q, spread, payload = evaluate(n)
            r = _residual(q, df)
            if not math.isfinite(r):
                # NaN or inf at the nodes (or in the reference): no node count fixes it,
                # and the node estimate below cannot be formed from it.
                self.failed[t] = r
                break
            # The residual's floor: the forward passes' round-off and the factors' own,
            # a multiple of their dtype's eps times the 2-norm of the product's terms
            # (measured 0.02-16x; learnt from the steps that reached it).
            spread = self._spread(spread)
            floor = noise + self._floor * spread
            if not math.isfinite(floor):
                # The terms' norm overflowed: an infinite floor would accept any residual.
                self.failed[t] = r
                break
            goal = max(budget, floor)
            self._floors[t] = noise + FLOOR_MAX * spread
            # Nodes added without the residual halving, under the round-off ceiling: the
            # factors' round-off, which the floor assumed so far under-reads. Their
            # errors at nodes this close are nearly the same, so they add alike over the
            # nodes while spread, a 2-norm, falls with the weights (a float32 query alone,
            # whose share of tol was under its residual's round-off, took 7-31 nodes
            # where 2-5 reached it: benchmarks/results/node_floor-s57.md). A quadrature
            # error of a smooth integrand falls 10-300x per node (measured), a kink's
            # stays orders of magnitude above the ceiling.
            flat = (bool(seen) and r > budget and r > seen[-1][1] / 2
                    and r <= noise + FLOOR_MAX * spread)
            if seen and seen[-1][1] > floor and r > floor and not flat:
                (n0, r0) = seen[-1]
                self._ratio = min(max((r / r0) ** (1.0 / (n - n0)), 1e-3), 0.9)
            seen.append((n, r))
            if probe is not None:
                if seen[-2][1] / 10 < r <= goal:
                    # The node more did not cut the residual an order of magnitude:
                    # round-off. The next steps start from the count before it.
                    break
                probe = None  # it fell: quadrature error, under the budget or not yet
            if r <= goal:
                if r <= budget or r <= noise + FACTORS * spread or flat or n >= cap:
                    break
                # Under the floor learnt at another step (a stall there raised it, up to
                # FLOOR_MAX) but above this step's own round-off: possibly quadrature
                # error (measured: a float32 step accepted there at 10x its budget, whose
                # next node cut the residual 100x). One node more tells: a quadrature
                # error falls (10-300x per node, measured), round-off does not.
                probe = n
                n += 1
                continue
            stalled = _stalled(seen)
            if flat or stalled and r <= noise + FLOOR_MAX * spread:
                # Not a kink: the residual sits at the factors' round-off, higher than
                # the floor assumed so far. Later steps assume this one (and the probe
                # above tells their quadrature errors from it), and start from the
                # count before the nodes that did not help.
                self._floor = min(FLOOR_MAX, 2 * (r - noise) / max(spread, 1e-300))
                stalled = False
                if flat:
                    probe = seen[-2][0]
                break
            if n >= cap or stalled:
                self.failed[t] = r
                if n >= cap and cap == self.limit < MAX_NODES:
                    self.capped[t] = r
                break
            # Geometric convergence: the nodes that bring r under the goal (at most 1.5x
            # the nodes per try, the ratio is a guess until two residuals are seen).
            need = math.log(r / goal) / -math.log(self._ratio)
            n = min(cap, n + min(max(4, n // 2), max(1, math.ceil(need))))
        if t not in self.failed:
            # A failed step's count says nothing about the next: it starts from the last
            # count that worked.
            self._n, self._room = n if probe is None else probe, r <= goal * self._ratio
            if r > budget:
                self.floored[t] = r
        self._stalls += bool(stalled)
        self._record(t, n, r)
        return payload

    def _spread(self, spread: torch.Tensor) -> float:
        """The factors' round-off scale: eps times the largest norm of a product's terms."""
        return self.eps * float(spread.max()) if spread.numel() else 0.0

    def paired(self, t: int, r: float, d: float) -> None:
        """Step t's sum by the rule with a node more: its residual ``r``, and ``d`` the
        largest difference of the two rules.

        The two rules' difference of a contribution (``contribution_error``) stands for
        the error of the one returned (see :func:`_contribution_check`); on the step's
        sum, whose error is measured, that is checked: an error above round-off and
        over twice the difference says the difference does not measure the error there.
        A kink of a non-smooth activation on the segment before the first node or after
        the last of both rules is missed by both alike (measured: the rules of 3 and 4
        nodes agreed to 1e-17 where each missed by 1e-5,
        ``benchmarks/results/contribution_error_kink.md``).
        """
        if r > self._floors[t] and not r <= 2 * d:
            self.slow[t] = worse(self.slow.get(t, 0.0), r / d if d > 0 else math.inf)

    def start(self) -> int:
        """The node count the next step tries first."""
        if self.plan is not None:
            return self._planned(max(self._next, 0))
        return self.fixed if self.fixed is not None else self._start()[0]

    def last(self) -> int | None:
        """The node count the step before ended with (None before the first step): the
        count the next steps try first, unless one is lowered or raised."""
        if self.plan is not None:  # the count of the step after the next one
            return self._planned(max(self._next - 1, 0))
        return self.fixed if self.fixed is not None else self._n

    def _planned(self, t) -> int:
        """The plan's count of step t within the memory's limit: the check raises the
        counts by one, past the limit where it bound, and the first tries (:meth:`start`)
        and captures kept ahead (:meth:`last`) must be made at the count that
        :meth:`choose` takes, else they are made past the limit and then made again."""
        return min(int(self.plan[t]), self.limit)

    def _start(self):
        # Steps that stopped converging (a non-smooth activation: kinks on the segment)
        # cap the others at NONSMOOTH nodes: more would buy little. Steps without a kink
        # still converge within it, and every step that fails is reported.
        cap = min(NONSMOOTH if self._stalls >= 2 else MAX_NODES, self.limit)
        n = min(3, cap) if self._n is None else min(self._n, cap)
        # Consecutive steps have similar sizes: start where the last one ended, and try
        # one node less when it had room, or every few steps.
        lowered = self._n is not None and n > 1 and (self._room or self._since_lower >= 4)
        return n - lowered, cap, lowered

    def _record(self, t, n, r):
        self.n_used[t] = max(self.n_used[t], n)
        self.errors[t] = worse(self.errors[t], r)


class _Reference:
    """f along the path, in float64 where the module runs in float64.

    The residual of a step compares the quadrature, computed in float64 from the
    factors, with ``f(theta_{t+1}) - f(theta_t)``: in float32 that difference carries
    the round-off of two float32 forward passes (a few eps32 |f|, 10-100x the quadrature
    error float32 factors allow). A float64 copy of the module evaluates the recorded
    (float32) parameters without it; a module that does not run in float64 keeps its
    own dtype, with a correspondingly higher floor.

    With ``weights`` (n, C), :meth:`out` contracts f to the scalar output ``w_q . f``
    whose decomposition is asked for, and :meth:`noise` bounds the contraction's
    round-off by ``sum_c |w_qc| |f_c|`` (the terms of a margin cancel).
    """

    def __init__(self, module, traj, X, weights=None):
        self.traj, self.module, self.X, self.weights = traj, module, X, weights
        self.dtype = traj.dtype
        if self.dtype != torch.float64:
            try:
                wide = copy_module(module).to(torch.float64)
                Xw = X.to(torch.float64) if X.is_floating_point() else X
                flat = traj.parameters(0).to(device=X.device, dtype=torch.float64)
                out = forward(wide, _params(traj, flat), Xw[:1])
                if out.dtype == torch.float64:
                    self.module, self.X, self.dtype = wide, Xw, torch.float64
            except Exception:  # any failure: keep the module's own dtype
                pass
        self.upcast = self.dtype != traj.dtype
        # The point converted to the reference's dtype, one buffer for every call: f is
        # read at every recorded point, and a fresh float64 copy of each (8.5 MB at
        # P = 1M) was freed again at once (see _factored_block).
        self._point = None

    def __call__(self, t: int, rows=slice(None)) -> torch.Tensor:
        flat = self.traj.parameters(t)
        if flat.dtype != self.dtype or flat.device != self.X.device:
            if self._point is None:
                self._point = torch.empty(flat.shape, dtype=self.dtype, device=self.X.device)
            flat = self._point.copy_(flat)
        f = forward(self.module, _params(self.traj, flat), self.X[rows]).double()
        # f is kept for every point: an output that is a view of the parameters (a
        # learned constant, expanded) would be overwritten by the next point's copy.
        if flat is self._point and (f.untyped_storage().data_ptr()
                                    == flat.untyped_storage().data_ptr()):
            f = f.clone()
        return f

    def out(self, f, rows=slice(None)) -> torch.Tensor:
        """The decomposed output(s) of f (rows, C): f itself, or ``w_q . f`` (rows, 1)."""
        return f if self.weights is None else _contract(f, self.weights[rows])

    def noise(self, f_t, f_next, rows=slice(None)) -> float:
        """The round-off of the decomposed output's change ``out(f_{t+1} - f_t)`` for a
        block of rows (``f`` of all outputs)."""
        size = f_t.abs() + f_next.abs()
        if self.weights is not None:
            size = _contract(size, self.weights[rows].abs())
        size = float(size.max()) if size.numel() else 0.0
        return NOISE * float(torch.finfo(self.dtype).eps) * size


def _contract(f: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """``w_q . f_q`` per row, (rows, 1)."""
    return (f * weights.to(f.dtype)).sum(1, keepdim=True)


def _stalled(seen) -> bool:
    """Whether doubling the nodes (from 8 on) gained less than 10x: the integrand is not
    smooth (a relu network's kinks), more nodes would only cost time.

    A smooth integrand gains far more (measured: 20-300x per doubling in the first,
    largest RMSprop steps, whose convergence is the slowest seen).
    """
    n, r = seen[-1]
    return any(n0 >= 8 and n >= 2 * n0 and min(rr for nn, rr in seen if nn > n0) > r0 / 10
               for n0, r0 in seen[:-1])


def _residual(q: torch.Tensor, df: torch.Tensor) -> float:
    return float((q - df).abs().max()) if q.numel() else 0.0


# --------------------------------------------------------------------------- helpers
# Layers through which torch differentiates jacrev's batched backward right (checked
# against finite differences of J dtheta, torch 2.13): a network of these alone, in
# nn.Sequential containers (no forward of its own that could call F.layer_norm), takes
# all its outputs in one pass. Affine LayerNorm and InstanceNorm are not among them.
_BATCHED_BACKWARD_SAFE = (
    torch.nn.Sequential, torch.nn.Linear, torch.nn.Identity,
    torch.nn.Flatten, torch.nn.Unflatten, torch.nn.Dropout,
    torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Conv3d,
    torch.nn.ConvTranspose1d, torch.nn.ConvTranspose2d, torch.nn.ConvTranspose3d,
    torch.nn.MaxPool1d, torch.nn.MaxPool2d, torch.nn.MaxPool3d,
    torch.nn.AvgPool1d, torch.nn.AvgPool2d, torch.nn.AvgPool3d,
    torch.nn.AdaptiveAvgPool1d, torch.nn.AdaptiveAvgPool2d, torch.nn.AdaptiveAvgPool3d,
    torch.nn.GroupNorm, torch.nn.RMSNorm, torch.nn.Embedding,
    torch.nn.ReLU, torch.nn.Tanh, torch.nn.GELU, torch.nn.SiLU, torch.nn.Sigmoid,
    torch.nn.Softplus, torch.nn.ELU, torch.nn.LeakyReLU, torch.nn.Mish, torch.nn.Hardtanh,
)
_BATCH_NORMS = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d)


def _all_outputs_in_one_pass(module, traj) -> bool:
    """Whether ``jvp`` of ``jacrev`` (all outputs at once) is right for ``module``: a
    plain MLP (:func:`._tangent.stacked_mlp`), or nn.Sequential containers of
    :data:`_BATCHED_BACKWARD_SAFE` layers and batch norms in evaluation mode, none
    with a hook or a patched ``forward``."""
    if stacked_mlp(module, traj.names) is not None:
        return True
    # A hook or a patched forward runs code the types do not show: one normalizing a
    # Linear's output by learnt parameters (F.layer_norm) took the one pass and missed
    # the curvature term by 1%, silently. Such networks take the per-output route, as
    # stacked_mlp refuses them.
    if _global_hooks():
        return False
    return all((type(m) in _BATCHED_BACKWARD_SAFE
                or (type(m) in _BATCH_NORMS and not m.training)) and not _hooked(m)
               for m in module.modules())


def _add_hvp_rows(module, traj, layout, theta, delta, X, out, alpha, block, weights=None,
                  n_out=None):
    """``out += alpha (H_t(x) dtheta)^T`` for every query: the derivative of J(x) along
    dtheta, (Q, C, P), or its rows contracted with ``weights`` (Q, C) into (Q, 1, P).

    Formed ``block`` queries at a time (see ``HVP_FORMS``), each parameter's slice added
    to ``out`` in place: a (Q, C, P) product and its concatenation would not fit the
    budget that sized the query block.

    Forward over reverse. All outputs in one pass (``jvp`` of ``jacrev``) with ``n_out``
    None, where :func:`_all_outputs_in_one_pass` (decided once per call, with
    :func:`_checked_outputs` otherwise); else one output at a time of the ``n_out``
    (``jvp`` of ``grad``, vmapped over the queries): ``jacrev`` vmaps the backward over the outputs,
    and torch's derivative of that batched backward through an affine layer norm or
    instance norm is wrong (torch 2.13; ``jacrev`` of ``jacrev`` too): the curvature term
    of every TransformerEncoderLayer (its layer norms) missed by about 1%, silently. The
    loop over the outputs costs 1.3-2.9x the one pass (an MLP with one and three
    outputs, a small Conv1d network with 3-50 outputs; one thread).
    """
    # Primals of their own storage: forward-mode AD gives a view's tangent its base's
    # size, and a recorded point is a view of the whole stored path (about 7 times the
    # path per call, 101 MiB at 211 points of 18k parameters: memory growing with T).
    params = {name: t.clone() for name, t in _params(traj, theta).items()}
    tangent = _params(traj, delta)

    def f_single(p, x):
        # (C,) as the other routes read a sample's outputs: a one-output network may
        # return (n,), whose [0] is a scalar.
        return functional_call(module, p, (forward_input(x.unsqueeze(0)),)).reshape(1, -1)[0]

    # torch's recurrent kernels (nn.LSTM, nn.GRU, nn.RNN and their cells) have no vmap
    # rule for their forward-mode derivative: vmapped over the queries, every
    # second-order decomposition of a recurrent network raised a shape error (torch
    # 2.13). One query at a time computes the same products.
    recurrent = (torch.nn.RNNBase, torch.nn.RNNCellBase)
    batched = _query_loop if any(isinstance(m, recurrent) for m in module.modules()) else vmap
    # On CUDA they run as fused cells (cuDNN is off for the analyses), which have no
    # forward-mode derivative at all ("Trying to use forward AD with
    # _thnn_fused_lstm_cell"): there the same products by two reverse passes.
    forward = _jvp_by_reverse if recurrent_on_cuda(module, cells=True) else jvp
    if n_out is None:
        def products(Xb):
            return batched(lambda x: forward(lambda p: jacrev(f_single)(p, x), (params,),
                                             (tangent,))[1])(Xb)
    else:
        def products(Xb):
            def row(x, c):
                return forward(grad(lambda p: f_single(p, x)[c]), (params,), (tangent,))[1]

            outs = [batched(functools.partial(row, c=c))(Xb) for c in range(n_out)]
            # (q, C, *shape) per parameter, as the one pass gives them.
            return {name: torch.stack([o.pop(name) for o in outs], dim=1)
                    for name in traj.names}

    by_autograd = False
    for q0 in range(0, X.shape[0], block):
        rows = slice(q0, q0 + block)
        with FORWARD_AD, twice_differentiable():
            if not by_autograd:
                try:
                    hvp = products(X[rows])
                except (RuntimeError, NotImplementedError) as error:
                    if not _no_forward_derivative(error):
                        raise
                    # An operation that forward-mode AD or torch.func's transforms do
                    # not take: every packed recurrent network raised torch's "Trying to
                    # use forward AD with _pack_padded_sequence", or "Cannot access data
                    # pointer of Tensor that doesn't have storage" where its lengths came
                    # from the input. Plain autograd's double backward takes them; a
                    # genuine error of the network raises again from there.
                    by_autograd = True
            if by_autograd:
                hvp = _hvp_by_autograd(f_single, params, tangent, X[rows])
        for name in traj.names:
            # (q, C, *shape); a 0-d parameter (a learnt scalar) has no dimension after the
            # outputs to flatten from.
            h = hvp.pop(name)
            h = h.reshape(*h.shape[:2], -1)
            if weights is not None:
                h = torch.bmm(weights[rows].to(out.dtype).unsqueeze(1), h)
            start, size = layout[name]
            out[rows, :, start : start + size].add_(h, alpha=alpha)
            del h


# What torch raises where an operation has no forward-mode derivative, or torch.func
# cannot run its backward: only these fall back to the double backward. Any other error
# raises: a custom autograd.Function without setup_context (functorch's RuntimeError)
# would otherwise be differentiated twice through its backward, and one whose backward
# reads a detached tensor gave a curvature term 3% off, without a word.
_NO_FORWARD_DERIVATIVE = ("Trying to use forward AD with",
                          "Cannot access data pointer of Tensor that doesn't have storage")


def _no_forward_derivative(error: BaseException) -> bool:
    """Whether ``error`` is torch's refusal of forward-mode AD or of torch.func's
    transforms for an operation (see :func:`_add_hvp_rows`), not an error of the
    network."""
    return (not isinstance(error, torch.OutOfMemoryError)
            and any(text in str(error) for text in _NO_FORWARD_DERIVATIVE))


def _hvp_by_autograd(f_single, params, tangent, Xb) -> dict[str, torch.Tensor]:
    """:func:`_add_hvp_rows`' products ``H_c(x) dtheta`` (q, C, *shape) per parameter by
    plain autograd, one double backward per query and output: for networks with an
    operation that neither forward-mode AD nor ``torch.func``'s transforms of its backward
    take (a packed sequence), slower and the same numbers."""
    names = list(params)
    rows = []
    for x in Xb:
        live = [params[k].detach().requires_grad_(True) for k in names]
        with torch.enable_grad():
            out = f_single(dict(zip(names, live)), x)
            per_output = []
            for c in range(out.shape[0]):
                g = torch.autograd.grad(out[c], live, create_graph=True, allow_unused=True)
                dot = sum((gi * tangent[k]).sum() for gi, k in zip(g, names)
                          if gi is not None and gi.requires_grad)
                hv = (torch.autograd.grad(dot, live, retain_graph=True, allow_unused=True)
                      if torch.is_tensor(dot) else [None] * len(live))
                per_output.append([torch.zeros_like(p) if h is None else h.detach()
                                   for h, p in zip(hv, live)])
        rows.append([torch.stack(col) for col in zip(*per_output)])
    return {k: torch.stack([row[j] for row in rows]) for j, k in enumerate(names)}


def _jvp_by_reverse(f, primals, tangents):
    """``torch.func.jvp(f, primals, tangents)`` by reverse mode only: ``f``'s pullback
    ``u -> J^T u`` is linear in ``u``, and the pullback of that, at any ``u`` (zeros),
    takes ``tangents`` to ``J tangents``. For layers without a forward-mode derivative
    whose backward is differentiable (torch's fused recurrent cells on CUDA)."""
    out, pullback = vjp(f, *primals)
    probe = torch.utils._pytree.tree_map(torch.zeros_like, out)
    _, pullback_of_pullback = vjp(pullback, probe)
    (tangent_out,) = pullback_of_pullback(tuple(tangents))
    return out, tangent_out


def _query_loop(fn):
    """``vmap(fn)`` over the rows of a tensor, one row at a time (``fn`` returns a dict of
    tensors)."""
    def mapped(Xb):
        outs = [fn(x) for x in Xb]
        return {name: torch.stack([o[name] for o in outs]) for name in outs[0]}
    return mapped


def _checked_outputs(module, traj, theta, X) -> int:
    """The number of outputs, after refusing a ``@once_differentiable`` backward by name
    (functorch's transforms raise their own error about it, which names no layer)."""
    leaf = theta.detach().clone().requires_grad_(True)
    with torch.enable_grad(), twice_differentiable():
        out = functional_call(module, _params(traj, leaf), (forward_input(X[:1]),)).reshape(-1)
        # A seed that requires grad: such a backward then leaves the node
        # check_twice_differentiable finds.
        seed = torch.ones((), dtype=out.dtype, device=out.device, requires_grad=True)
        (g,) = torch.autograd.grad(out[0], leaf, grad_outputs=seed, create_graph=True)
        check_twice_differentiable(g)
    return len(out)


def _route(traj: Trajectory, method: str) -> str:
    """"factor" (plain SGD's Gram of factors), "adjoint" (the pair engine's buffer) or
    "dense" (Jacobians; the only route of the second-order term)."""
    if method == "second_order":
        return "dense"
    spec = traj.solver_spec
    # Parameter groups with their own step sizes make plain SGD's step preconditioned.
    grouped = traj._group_lrs is not None and any(
        traj.step_size_scales(k) is not None for k in range(len(traj) - 1))
    if spec.name == "sgd" and spec.momentum == 0 and not grouped:
        return "factor"
    return "adjoint"


def _path_changes(f, ref: _Reference, rows=slice(None)):
    """Each step's largest |change| and the largest |f| along the path (of the
    reference's decomposed output), from f at every point (of the queries ``rows``)."""
    changes = np.zeros(len(f) - 1)
    prev = ref.out(f[0], rows)
    scale = float(prev.abs().max()) if prev.numel() else 0.0
    for t in range(len(f) - 1):
        cur = ref.out(f[t + 1], rows)
        changes[t] = float((cur - prev).abs().max()) if cur.numel() else 0.0
        scale = max(scale, float(cur.abs().max()) if cur.numel() else 0.0)
        prev = cur
    return changes, scale


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, int(n)).bit_length() - 1)


def _pow2_ceil(n: int) -> int:
    return 1 << (max(1, int(n)) - 1).bit_length()


def _adaptive(method: str, n_nodes: int | None) -> bool:
    """Whether the call chooses its quadrature nodes (per chunk of queries)."""
    return method == "exact" and n_nodes is None


def node_chunk(traj: Trajectory, method: str, n_queries: int) -> int:
    """Queries per node choice for a call on ``n_queries`` queries, a power of two (query
    blocks on workers are cut at its multiples and pass it on; a memory budget that caps
    it takes a smaller power of two, which still divides them): on plain SGD's route the
    one that covers half of them, between 4 and ``NODE_CHUNK`` (at most two chunks up to
    ``2 NODE_CHUNK`` queries); on the others a quarter of them, between 4 and
    ``BLOCK_CHUNK`` (see ``NODE_CHUNK``)."""
    n = max(1, int(n_queries))
    if _route(traj, method) == "factor":
        return min(NODE_CHUNK, max(4, _pow2_ceil(-(-n // 2))))
    return _pow2_floor(min(BLOCK_CHUNK, max(4, n // 4)))


def block_align(traj: Trajectory, method: str, n_nodes: int | None, n_queries: int) -> int:
    """The multiple of rows at which workers' query blocks start: the node chunk where
    the call chooses nodes (a block then takes the serial call's choices), else 1 (the
    blocks balanced by rows)."""
    return node_chunk(traj, method, n_queries) if _adaptive(method, n_nodes) else 1


def _step_points(traj, t, weighting, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The samples step t credits and each one's weight in its gradient (float64): its
    batch and their weights in the loss, or (expected) the pool it drew the batch from
    and their probabilities of being in it times those weights (:meth:`Trajectory.pool`,
    read once: it forms the pool's rows and weights); times the step's gradient scale
    (clipping)."""
    if weighting == "realized":
        idx, w = traj.batch(t), traj.batch_weights(t)
    else:
        idx, w = traj.pool(t)
    return (torch.as_tensor(idx, device=device),
            torch.as_tensor(w * float(traj.gradient_scales[t]), dtype=torch.float64,
                            device=device))


def _decay_direction(traj, j, theta, decoupled) -> torch.Tensor:
    """``theta`` times each parameter's weight decay over the solver's (1 without
    parameter groups) and, for decoupled decay, its step size scale: what multiplies
    ``weight_decay`` (and ``lr``) in the step."""
    wd = traj.weight_decays()
    ratio = None if wd is None else wd / traj.solver_spec.weight_decay
    if decoupled:
        scales = traj.step_size_scales(j)
        if scales is not None:
            ratio = scales if ratio is None else ratio * scales
    return theta if ratio is None else theta * ratio.to(device=theta.device,
                                                        dtype=theta.dtype)


class _StackedCapture:
    """The captures of a plain MLP at several parameter points in one batched pass.

    For an ``nn.Sequential`` of ``nn.Linear`` layers and elementwise activations
    (:func:`._tangent.stacked_mlp`), the factors that a capture gives per point and
    layer, the inputs ``a`` and the seeded backprops ``delta``, come from one forward
    and one backward over all points at once (batched GEMMs), instead of a hooked
    forward and an autograd backward per point: a step's quadrature nodes are one such
    block. The terms are those of :func:`._tangent.pair_terms` (checked against a
    capture before use, :meth:`matches`), so every route reads them unchanged.
    """

    def __init__(self, mlp, layout):
        self.mlp, self.layout = mlp, layout
        # Each Linear's parameters in the capture's order: weight (with inputs), bias.
        self.inputs = [[lin.weight] + ([] if lin.bias is None else [lin.bias])
                       for lin in mlp.linears]

    def forward(self, thetas: torch.Tensor, X: torch.Tensor):
        """Outputs (B, N, C) at the points ``thetas`` (B, P), and what
        :meth:`backward` needs. ``X``: rows (N, d_in) shared by the points, or each
        point's own (B, N, d_in) (a block of steps' batches)."""
        h, params, acts, derivs = forward_factors(self.mlp, thetas, self.layout, X)
        if X.dim() == 3:
            # Own rows: forward_factors' leading broadcast dimension is 1, the points
            # come second (the same batched GEMMs over the points).
            h, acts = h[0], [a[0] for a in acts]
            derivs = [None if d is None else d[0] for d in derivs]
        return h, (params, acts, derivs)

    def backward(self, cache, seed: torch.Tensor) -> list[list[Flat]]:
        """Per point, the terms of the capture seeded with ``seed`` (B or 1, N, R, C):
        rows ``r`` of ``delta`` backpropagate ``seed[:, :, r] . f``."""
        params, acts, derivs = cache
        B = params[0][0].shape[0]
        delta, li, layers = seed, len(params), []
        for d in reversed(derivs):
            if d is not None:
                delta = delta * d[:, :, None, :]
                continue
            li -= 1
            layers.append((li, delta.expand(B, *delta.shape[1:])))
            if not li:
                # The first Linear's inputs need no backprop: an activation before it
                # (nn.Sequential(nn.Tanh(), nn.Linear(...), ...)) has the inputs' width.
                break
            # One GEMM per point over all rows: a broadcast matmul against W[:, None]
            # runs a matrix-vector product per row (measured 10x slower).
            full = delta.expand(B, *delta.shape[1:])
            delta = torch.bmm(full.reshape(B, -1, full.shape[-1]), params[li][0]).view(
                *full.shape[:-1], -1)
        layers.reverse()
        out = []
        for b in range(B):
            terms = []
            for li, delta in layers:
                a = acts[li][min(b, acts[li].shape[0] - 1)]
                names = self.inputs[li]
                terms.append(Flat(delta[b], [(names[0], a)] + [(n, None) for n in names[1:]]))
            out.append(terms)
        return out

    @staticmethod
    def batched(thetas: torch.Tensor, X: torch.Tensor):
        """``thetas`` (B, P) and ``X`` as a pass of two points at least: one point
        repeated (a view, no copy), whose first is then taken.

        torch's batched GEMM of one matrix is its plain GEMM, another kernel than the
        batched one of two or more: a float32 pass of one point rounded apart from the
        same point's in a pass of several (the last layer's matrix-vector product of a
        one-output network; a range of one step's contributions 1.6e-9 and 6.5e-9
        relative off the serial call's), where passes of 2 to 32 points agree bit for
        bit (1 to 16 threads, AVX2, torch 2.13). A step's captures then depend on the
        block of steps or nodes it was captured in, which a range of steps cuts apart
        from the serial call's (benchmarks/results/decompose_cuts-s56.md)."""
        if thetas.shape[0] != 1:
            return thetas, X
        return thetas.expand(2, -1), X.expand(2, *X.shape[1:]) if X.dim() == 3 else X

    def capture(self, thetas, X, weights, outputs, two=False):
        """The terms at every point of ``thetas`` (a list of flat vectors, or their stack
        (B, P)) of the ``outputs``, or of ``w_n . f(x_n)`` (``weights`` (N, C)); with
        ``two``, one point as a pass of two (:meth:`batched`)."""
        thetas = thetas if torch.is_tensor(thetas) else torch.stack(list(thetas))
        out, cache = self.forward(*self.batched(thetas, X)) if two else self.forward(thetas, X)
        return self.backward(cache, self.seed(weights, X.shape[0], outputs, out.shape[-1],
                                              out.dtype, out.device))[:len(thetas)]

    @staticmethod
    def seed(weights, n, outputs, n_final, dtype, device):
        """(1, N, R, C) rows of the backward: one per output, or the weights."""
        if weights is None:
            eye = torch.eye(n_final, dtype=dtype, device=device)[list(outputs)]
            return eye.expand(1, n, -1, -1)
        return weights.to(dtype)[None, :, None, :]

    def matches(self, ctx, theta, X, weights) -> bool:
        """Whether these terms are a capture's, to round-off (a module whose layers
        compute something else than their types say keeps the general captures)."""
        for w in (None, weights):
            ref = ctx.general_capture(theta, X, w)
            ours = self.capture([theta], X, w, ctx.outputs)[0]
            if len(ref) != len(ours):
                return False
            for tr, to in zip(ref, ours):
                if ([n for n, _ in tr.inputs] != [n for n, _ in to.inputs]
                        or tr.delta.shape != to.delta.shape):
                    return False
                pairs = [(tr.delta, to.delta)] + [
                    (ar, ao) for (_, ar), (_, ao) in zip(tr.inputs, to.inputs)
                    if ar is not None]
                for r, o in pairs:
                    if o is None or r.shape != o.shape:
                        return False
                    scale = float(r.abs().max()) if r.numel() else 0.0
                    eps = float(torch.finfo(r.dtype).eps)
                    if float((r - o).abs().max()) > 1e3 * eps * max(scale, 1e-30):
                        return False
        return True


class _Context:
    """What every step of one query block reads: the path, the batches, the routing."""

    def __init__(self, module, traj, X_train, Y_train, loss, *, weighting, budget, exclude,
                 outputs, b_block, ref, weights, intervals=None, row_bytes=1, point_bytes=0,
                 left=None, node_points=NODE_POINTS):
        self.module, self.traj, self.loss, self.ref = module, traj, loss, ref
        # The recorded intervals [start, stop) this call decomposes (all: None).
        self.intervals = (0, len(traj) - 1) if intervals is None else intervals
        self.X_train, self.Y_train = X_train, Y_train
        self.weighting, self.budget, self.exclude = weighting, budget, exclude
        self.outputs, self.b_block = outputs, b_block
        # Each step's batch captures, kept for the next query block (keep_batches) within
        # a quarter of the memory budget (of what the blocks leave, ``left``, at most
        # half); a storage shared by several kept steps (a block of steps' captures) is
        # charged once.
        left = budget if left is None else max(0, left)
        self.keep_batches, self._kept = False, {}
        self.kept_bytes = self._kept_room = min(budget // 4, left // 2)
        self._kept_storages: set[int] = set()
        # The queries' side: all outputs, or one (the outputs contracted with weights).
        self.weights = weights
        self.n_res = len(outputs) if weights is None else 1
        self.device = X_train.device
        sizes = [v.numel() for v in traj.unflatten(traj.parameters(0)).values()]
        self.layout = dict(zip(traj.names, zip(np.cumsum([0, *sizes[:-1]]).tolist(), sizes)))
        # What the captures made ahead for blocks of steps may hold: an eighth of the
        # budget for a batch's pass and for what the chunks of queries hold for their next
        # steps, a row and a parameter point charged as given (see ahead_steps); the
        # batches made ahead, and the walk's steps in order with their positions.
        # (Each an eighth of the budget, at most a quarter of what the blocks leave.)
        self.ahead_bytes = min(budget // 8, left // 4)
        self.row_bytes, self.point_bytes = row_bytes, point_bytes
        # The parameter points of a step's nodes captured at once (with their stack):
        # node_points in the plan's own room, more where what the blocks leave beyond
        # the captures kept and made ahead (a quarter of it) holds them.
        self.node_points = max(node_points, min(MAX_NODES, (
            2 * node_points * point_bytes + left // 4) // max(2 * point_bytes, 1)))
        self._ahead, self._walk, self._at = {}, None, None
        # A float32 path decomposed exactly measures its batches' residuals' round-off
        # (see rounding), against float64 where the module and the loss run in it
        # (measure_roundoff).
        self.roundoff = self.measured = False
        self.wide_point = self.wide_row = 0
        # The parameter points of the batches captured ahead, stacked (_capture_ahead).
        self.held = _Scratch(self.device)
        # The first step a block of steps made ahead may reach back to from step j: a
        # replayed path's long intervals are read one at a time (EveryStep.floor).
        self.floor = traj.floor if isinstance(traj, EveryStep) else (lambda j: 0)
        self.stacked = None
        mlp = None if exclude else stacked_mlp(module, traj.names)
        if mlp is not None and X_train.is_floating_point():
            stacked = _StackedCapture(mlp, self.layout)
            theta = traj.parameters(0).to(self.device)
            w = (None if weights is None
                 else torch.ones((2, len(outputs)), dtype=torch.float64, device=self.device))
            if stacked.matches(self, theta, X_train[:2], w):
                self.stacked = stacked

    def capture_nodes(self, thetas, X, weights=None, two=False):
        """:meth:`capture` at several points (a step's quadrature nodes): one batched
        pass for a plain MLP; ``two``: one point as a pass of two, where the room holds
        two (the captures of a point then those of any pass of several it falls in:
        :meth:`_StackedCapture.batched`)."""
        if self.stacked is None:
            return [self.general_capture(theta, X, weights) for theta in thetas]
        return self.stacked.capture(thetas, X, weights, self.outputs, two)

    def capture(self, flat, X, weights=None):
        """Factors of the rows X, of every output or of ``w_n . f(x_n)`` (``weights``)."""
        return self.capture_nodes([flat], X, weights)[0]

    def general_capture(self, flat, X, weights=None):
        """:meth:`capture` by the capture engine, for any module."""
        return pair_terms(self._terms(_params(self.traj, flat), X, weights))

    def _terms(self, params, X, weights):
        # Index terms (embeddings) are formed by scattering their deltas (pair_terms,
        # dense_rows), never through a one-hot factor.
        cap = capture(self.module, params, X, self.outputs, memory_budget=self.budget,
                      exclude=self.exclude, weights=weights, index=True)
        if cap.exclude != self.exclude:
            raise _Reroute(cap.exclude)
        return cap.terms

    def seeded_rows(self, params, X, weights, out):
        """``d (w_n . f(x_n)) / d theta`` (n, 1, P) into ``out``, from one capture whose
        backward pass is seeded with the weights (the dense route's contracted Jacobians
        and per-sample loss gradients, ``weights`` the loss residuals)."""
        return dense_rows(self._terms(params, X, weights), self.layout, out)

    def rounding(self, theta, sub, out, r, r64=None):
        """Per row of the batch ``sub`` at ``theta``, the relative round-off of its
        float32 loss residuals ``r`` (B, C) from the outputs ``out``: ``max_c |r_c -
        r64_c| / max_c |r_c|`` against the residuals of a float64 forward pass at the
        same point (the reference's float64 copy of the module, :class:`_Reference`),
        0 where ``r`` is 0; None unless the call measures it (``roundoff``: a float32
        path, ``method="exact"``). ``r64``: the float64 residuals where the caller made
        them (:meth:`_residuals64`, over a block of steps at once).

        The round-off of f(x_i) is absolute, 0.4-3.5 eps32 |f| measured, and near
        convergence the residual is a small difference of f and its target: its
        relative round-off was 5-7 eps32 at the median (point, step) of converged
        full-batch Adam and 69-99 at the 90th percentile, the same at every step where the
        parameters barely move, so it adds up over the path in each share (linear in
        its residual): there it was nearly all of the contributions' error
        (``benchmarks/results/roundoff_model-s56.md``). A module that does not run in
        float64 is not measured: its f's round-off is taken as ``RESIDUAL_ROUNDOFF``
        eps |f|, relative to the residual.
        """
        if not self.roundoff:
            return None
        r = r.reshape(out.shape[0], -1).to(torch.float64)
        size = r.abs().amax(1)
        if self.measured:
            if r64 is None:
                params = {k: v.to(torch.float64)
                          for k, v in _params(self.traj, theta).items()}
                r64 = self.loss.residuals(
                    forward(self.ref.module, params, _wide(self.X_train[sub])),
                    _wide(self.Y_train[sub]))
            err = (r - r64.reshape(r.shape)).abs().amax(1)
        else:
            err = (RESIDUAL_ROUNDOFF * float(torch.finfo(out.dtype).eps)
                   * out.reshape(out.shape[0], -1).abs().amax(1).to(torch.float64))
        return torch.where(size > 0, err / size.clamp_min(1e-300), torch.zeros_like(size))

    def measure_roundoff(self, on: bool, measured: bool = False,
                         wide: tuple[int, int] = (0, 0)) -> None:
        """Whether :meth:`rounding` measures (``on``: a float32 path, ``method="exact"``),
        and against float64 residuals (``measured``: :func:`_residuals_in_float64`), whose
        float64 pass the blocks of steps made ahead are charged (``wide``: its bytes a
        parameter point and a batch row, :meth:`ahead_steps`); else it takes the
        estimate of a module that does not run in float64."""
        self.roundoff, self.measured = on, on and measured
        self.wide_point, self.wide_row = wide if self.measured else (0, 0)

    def _residuals64(self, thetas, idx):
        """The float64 loss residuals (B, N, C) of the rows ``idx`` (N, or B x N: each
        point's own) at the points ``thetas`` (B, P), by the stacked engine in one pass
        and one call of the loss, where :meth:`rounding` measures against them; else
        None."""
        if not self.measured:
            return None
        idx = idx.view(-1, idx.shape[-1]).expand(thetas.shape[0], -1)
        out = self.stacked.forward(thetas.to(torch.float64), _wide(self.X_train[idx]))[0]
        r = self.loss.residuals(out.flatten(0, 1), _wide(self.Y_train[idx.flatten()]))
        return r.view(*out.shape[:2], -1)

    def batches(self, t, theta):
        """The step's batch in blocks: (indices, weights, factors, dhat, rounding) at
        theta_t (``rounding``: :meth:`rounding` of the block's rows, or None)."""
        kept = self._kept.get(t)
        if kept is not None:
            yield from kept
            return
        keep = [] if self.keep_batches else None
        for block in self._batches(t, theta):
            if keep is not None:
                keep.append(block)
            yield block
        if keep is not None:
            new = {k: v for k, v in _storages(keep).items() if k not in self._kept_storages}
            size = sum(new.values())
            if size <= self._kept_room:
                self._kept[t], self._kept_room = keep, self._kept_room - size
                self._kept_storages.update(new)

    def _batches(self, t, theta):
        idx, w = _step_points(self.traj, t, self.weighting, self.device)
        if self.stacked is not None and 0 < len(idx) <= self.b_block:
            if t not in self._ahead:
                self._capture_ahead(t, len(idx))
            yield self._ahead.pop(t)
            return
        params = _params(self.traj, theta)
        for b0 in range(0, len(idx), self.b_block):
            sub, w_sub = idx[b0 : b0 + self.b_block], w[b0 : b0 + self.b_block]
            Xb = self.X_train[sub]
            if self.stacked is not None:
                # One batched forward gives the residuals and the backward's inputs.
                r64 = self._residuals64(theta[None], sub)
                out, cache = self.stacked.forward(theta[None], Xb)
                r = self.loss.residuals(out[0], self.Y_train[sub])
                terms = self.stacked.backward(cache, r[None, :, None, :])[0]
                yield (sub, w_sub, terms, [t.delta[:, 0] for t in terms],
                       self.rounding(theta, sub, out[0], r, None if r64 is None else r64[0]))
                continue
            out = forward(self.module, params, Xb)
            r = self.loss.residuals(out, self.Y_train[sub])
            # The batch's factors enter only through their inputs and the loss-gradient
            # backprops dhat_i = sum_c r_ic delta_ic: one backward pass of r_i . f(x_i).
            terms = self.capture(theta, Xb, r)
            yield (sub, w_sub, terms, [t.delta[:, 0] for t in terms],
                   self.rounding(theta, sub, out, r))

    def ahead_steps(self, rows: int, points: int, room: int, residuals: bool = False) -> int:
        """How many steps one stacked pass captures ahead (1 to ``STEP_BLOCK``): each
        step ``points`` parameter points at ``rows`` rows, within ``room`` bytes. A row
        is charged ``row_bytes`` (a sample's captures with their graph, about 4x the
        stacked ones, which the pass also holds while it runs), a point twice its
        parameters (the points, and their stack); with ``residuals``, a step also the
        float64 pass that measures its batch's residuals' round-off
        (:meth:`_residuals64`: ``wide_point`` and ``wide_row`` a row)."""
        step = points * (rows * self.row_bytes + 2 * self.point_bytes)
        if residuals:
            step += self.wide_point + rows * self.wide_row
        return max(1, min(STEP_BLOCK, room // max(step, 1)))

    def _capture_ahead(self, t, size):
        """The batch captures of step ``t`` and of the steps the walk takes next with
        batches of the same ``size`` (those not kept from an earlier query block), at
        most ``STEP_BLOCK`` of them within an eighth of the memory budget
        (:meth:`ahead_steps`): one stacked forward and backward over the steps'
        parameters, each with its own batch (the residuals in one pass too). Each step's
        terms are those of any pass of two steps or more it falls in (a block of one
        runs as two where the room holds two: :meth:`_StackedCapture.batched`)."""
        walk = self._walk
        if walk is None:
            first, stop = self.intervals
            walk = self._walk = [(s, j) for j, steps in _intervals(self.traj)
                                 if first <= j < stop for s in steps]
            self._at = {s: k for k, (s, _) in enumerate(walk)}
        block, idx, w = [], [], []
        n = self.ahead_steps(size, 1, self.ahead_bytes, residuals=self.measured)
        floor = self.floor(t)
        for k in range(self._at[t], len(walk)):
            s, j = walk[k]
            if len(block) == n or s < floor:
                break
            if s in self._kept:  # read from the kept captures, not captured again
                continue
            i, ws = _step_points(self.traj, s, self.weighting, self.device)
            if len(i) != size:
                break
            block.append((s, j))
            idx.append(i)
            w.append(ws)
        points = [self.traj.parameters(j).to(self.device) for _, j in block]
        # Stacked in a buffer held for the walk, as the queries' points are (_NodesAhead).
        thetas = torch.stack(points, out=self.held.get(
            "batch points", (len(points), *points[0].shape), points[0].dtype))
        idx = torch.stack(idx)
        r64 = self._residuals64(thetas, idx)
        X = self.X_train[idx]
        if n > 1:
            # A block of one step (a range's only step, the last of a walk) as a pass of
            # two, so that the step's captures are those of any block it falls in; where
            # the budget holds one step a pass, every call captures every step alone.
            thetas, X = self.stacked.batched(thetas, X)
        out, cache = self.stacked.forward(thetas, X)
        out = out[:len(block)]
        r = self.loss.residuals(out.flatten(0, 1), self.Y_train[idx.flatten()])
        per_step = self.stacked.backward(cache, r.view(*out.shape[:2], 1, -1))
        if len(thetas) > len(block):
            # The step's own copy: views of the pass of two would keep both points'
            # storage alive with the captures kept for the next query block.
            per_step = [[Flat(t.delta.clone(), [(name, None if a is None else a.clone())
                                                for name, a in t.inputs])
                         for t in per_step[0]]]
        r = r.view(*out.shape[:2], -1)
        for k, ((s, _), sub, w_sub, terms) in enumerate(zip(block, idx, w, per_step)):
            self._ahead[s] = (sub, w_sub, terms, [t.delta[:, 0] for t in terms],
                              self.rounding(points[k], sub, out[k], r[k],
                                            None if r64 is None else r64[k]))


def _storages(blocks) -> dict[int, int]:
    """The distinct storages under the tensors of ``blocks`` (nested lists, tuples and
    Flat terms): their bytes by address."""
    seen, todo = {}, [blocks]
    while todo:
        x = todo.pop()
        if isinstance(x, torch.Tensor):
            storage = x.untyped_storage()
            seen.setdefault(storage.data_ptr(), storage.nbytes())
        elif isinstance(x, (list, tuple)):
            todo.extend(x)
        elif isinstance(x, Flat):
            todo.append(x.delta)
            todo.extend(a for _, a in x.inputs)
    return seen


def _nbytes(blocks) -> int:
    """Bytes of the distinct storages under the tensors of ``blocks``."""
    return sum(_storages(blocks).values())


def _wide(x: torch.Tensor) -> torch.Tensor:
    """A floating tensor in float64 (indices, token ids, as they are)."""
    return x.to(torch.float64) if x.is_floating_point() else x


def _as_float64(traj, flat) -> dict[str, torch.Tensor]:
    return {k: v.to(torch.float64) for k, v in traj.unflatten(flat).items()}


def _residuals_in_float64(ref, traj, loss, X_train, Y_train) -> bool:
    """Whether a path's residuals' round-off is measured against float64 residuals
    (:meth:`_Context.rounding`): where the reference's float64 copy of the module runs
    (:class:`_Reference`) and the loss takes its float64 outputs to float64 residuals.
    A user's per-sample loss written for the path's dtype (a float32 constant in a
    product, class weights) raises on them, and was only ever called in float32 before.
    Known before the memory plan, which charges that float64 pass (:func:`_run`)."""
    if not (ref is not None and ref.upcast and len(X_train)):
        return False
    params = _as_float64(traj, traj.parameters(0).to(X_train.device))
    try:
        r = loss.residuals(forward(ref.module, params, _wide(X_train[:1])),
                           _wide(Y_train[:1]))
    except Exception:  # any failure: the loss runs in the path's dtype only
        return False
    return r.dtype == torch.float64


# --------------------------------------------------------------------------- factored
def _factored_block(ctx: _Context, Xq, rows, chunks, *, method, route):
    """Contributions (Qb, N, C) and regularization (Qb, C) of one query block; for
    ``method="exact"`` with (2 Qb) rows, the second Qb those of the difference of the
    rule with a node more per step (the check's, see :func:`_pair_weights`). Third, on
    a float32 path with ``method="exact"``, the contributions' sums of the steps'
    absolute shares (Qb, N, C), else None.

    ``chunks``: ``[(rows, quad)]``, the block's chunks of queries (slices of the call's
    queries) with their node choices (None: no choice). The steps are walked once for
    all of them: a step's batch, its float64 directions and its nodes' parameters are
    made once and read by every chunk, whose own rows get their own nodes.
    """
    traj, device = ctx.traj, ctx.device
    spec = traj.solver_spec
    coefs, memory, direct = traj.step_coefficients(direct=True)
    wd = spec.weight_decay
    decoupled = spec.name == "adamw"
    n_q, N = Xq.shape[0], len(ctx.X_train)
    n_out = ctx.n_res
    first, stop = ctx.intervals
    exact = method == "exact"
    # The exact method's rows of the check: the queries' shares by the rule with a node
    # more minus those by the step's rule, from the same batch (see _contribution_check).
    n_rows = 2 * n_q if exact else n_q
    # Sample-major: every step adds its shares to its batch's rows, contiguous rows of
    # all queries and outputs (a query-major (n_q, N, n_out) buffer takes a scattered
    # write per query and sample; see the module docstring).
    contrib = torch.zeros((N, n_rows, n_out), dtype=torch.float64, device=device)
    reg = torch.zeros((n_rows, n_out), dtype=torch.float64, device=device)
    # A float32 path's contributions: their round-off, sum_t |share_t| (ROUNDOFF eps +
    # the relative round-off of its residual measured at the step: Context.rounding),
    # see _contribution_check.
    size = (torch.zeros((N, n_q, n_out), dtype=torch.float64, device=device)
            if exact and traj.dtype != torch.float64 else None)
    unit = ROUNDOFF * float(torch.finfo(traj.dtype).eps)
    parts = []
    for c_rows, quad in chunks:
        local = slice(c_rows.start - rows.start, c_rows.stop - rows.start)
        parts.append(_Chunk(c_rows, local, quad, Xq[local],
                            None if ctx.weights is None else ctx.weights[c_rows]))
    lo, hi = _replayed(ctx, chunks[0][1], method)
    nxt = traj.parameters(hi).to(device)
    adjoint = None
    if exact:
        for c in parts:
            c.f_next = c.quad.f[hi]
    # The step's vectors over the parameters (its float64 points and difference, the
    # prepared directions, the node points) are written to buffers held for the walk:
    # fresh ones at every step, each a few MB on a large network, were freed again at
    # once, and glibc's heap kept the fragments (1.2 GB resident beyond the plan at
    # P = 1M, about one run in two: benchmarks/results/user_trial_memory-s52.md). The
    # plan charges them (STEP_VECTORS, NODE_POINTS).
    held, held_D = _Scratch(device), None
    # The first-order methods' captures at theta_t are made for blocks of steps too.
    ahead = _NodesAhead(ctx, lo, n_q, at_start=not exact, pair=exact, held=held)
    for j, steps in _intervals(traj):
        if not lo <= j < hi:
            continue
        theta = traj.parameters(j).to(device)
        # theta_t in float64 (the decay direction's and the difference's).
        at64 = (held.get("theta64", theta.shape, torch.float64).copy_(theta) if exact or wd
                else None)
        theta64 = _as_float64(traj, _decay_direction(traj, j, at64, decoupled)) if wd else None
        # Decoupled decay, -lr wd theta_t, is not a gradient: rho_t . it is its share.
        # Plain SGD's L2 share is lambda_t . wd theta_t = -lr_t rho_t . wd theta_t.
        along = wd and (decoupled or route == "factor")
        # The step before's captures are not held through this step's tries.
        groups = None
        for c in parts:
            c.nodes = c.run = None
        if exact:
            # The exact difference of the two recorded points (exact in float64).
            d64 = held.get("d64", nxt.shape, torch.float64).copy_(nxt)
            d64 = _as_float64(traj, d64.sub_(at64))
            dirs = prepare_directions(*((d64, theta64) if along else (d64,)), scratch=held)
            ahead.passed(j, theta, nxt)

            def run(n, X, W, at, cuts=None, later=(False,), j=j, dirs=dirs):
                # later: per cut (or for all the rows), whether the next steps try n first
                w = _gauss(n)[1]
                own = None
                if cuts is None:
                    nodes = ahead.nodes(j, n, X, W, at, all(later))
                else:
                    # Captured cut by cut (each as on its own), their float64 products
                    # in one pass over the rows; each cut keeps its own capture, so
                    # its later float32 GEMMs read memory laid out as a serial call's.
                    own = [ahead.nodes(j, n, X[i], None if W is None else W[i],
                                       slice(at.start + i.start, at.start + i.stop), a)
                           for i, a in zip(cuts, later)]
                    nodes = _cat_rows(own)
                q, spread = directional(nodes[:n], w, prepared=dirs)
                return q, spread, nodes, list(w), own

            # Consecutive chunks that try the same count first (most, on a smooth path)
            # are taken together: their float64 products with the step in one pass, and
            # in float64 their captures too (the arithmetic of a whole block). A float32
            # chunk is captured on its own: a row's float32 GEMMs round differently in
            # a pass of more rows (measured 1e-8 relative in the sums), and a block on a
            # worker must give the serial call's numbers.
            together = traj.dtype == torch.float64
            tried = {}
            for group in _runs(parts, lambda c: c.quad.start()):
                n = group[0].quad.start()
                at = slice(group[0].local.start, group[-1].local.stop)
                cuts = None if together else [
                    slice(c.local.start - at.start, c.local.stop - at.start) for c in group]
                q, spread, nodes, w, own = run(
                    n, Xq[at], None if ctx.weights is None
                    else ctx.weights[group[0].rows.start : group[-1].rows.stop], at, cuts,
                    [c.quad.last() == n for c in group])
                # Plain SGD's products take the group's rows at once where they were
                # captured at once (float32 GEMMs again).
                whole = (nodes, w, at) if together else None
                for k, c in enumerate(group):
                    i = slice(c.local.start - at.start, c.local.stop - at.start)
                    rows = own[k] if own is not None else [_rows_of(t, i) for t in nodes]
                    tried[c] = (n, (q[:, i], spread[i], rows), w, whole)
            # Only tried holds the first tries' captures (evaluate drops them).
            q = spread = nodes = own = whole = rows = None

            def evaluate(n, c, tried=tried):
                c.run = None
                # Taken once: the first try is not held through the chunk's later ones.
                first = tried.pop(c, None)
                if first is not None and first[0] == n:
                    (q, spread, nodes), w, c.run = first[1:]
                else:
                    # A lowered try that missed comes back to the count the step before
                    # ended with: its block is made then.
                    q, spread, nodes, w, _ = run(n, c.X, c.W, c.local,
                                                 later=(c.quad.last() == n,))
                return q[0], spread, (nodes, w, q[1] if len(q) > 1 else None, q[0])

            for c in parts:
                f_t = c.quad.f[j]
                df = ctx.ref.out(c.f_next - f_t, c.rows)
                c.nodes, c.w, c.rho_theta, q = c.quad.choose(
                    j, functools.partial(evaluate, c=c), df,
                    ctx.ref.noise(f_t, c.f_next, c.rows))
                c.f_next = f_t
                # The rule with a node more along the step (and the decay): the sum's
                # residual by it tells whether it gained (its nodes alone: half the
                # product of the difference's weights over both rules' nodes).
                more = directional(c.nodes[len(c.w):], _gauss(len(c.w) + 1)[1],
                                   prepared=dirs, spread=False)[0]
                c.quad.paired(j, _residual(more[0], df), float((more[0] - q).abs().max()))
                if along:
                    # The factor route's check rows hold the rule with a node more
                    # (subtracted after the walk), the adjoint's the difference.
                    c.rho_theta_pair = more[1] - (0 if route == "factor" else c.rho_theta)
        else:
            ahead.passed(j, theta, nxt)
            # The decay direction prepared once for all chunks of the step (and its
            # merged layout kept there), as the exact branch's directions are.
            dirs = prepare_directions(theta64, scratch=held) if along else None
            for c in parts:
                c.nodes, c.w = ahead.nodes(j, 1, c.X, c.W, c.local, True), [1.0]
                c.rho_theta = (directional(c.nodes, c.w, prepared=dirs)[0][0] if along
                               else None)
        nxt = theta
        if not first <= j < stop:  # replayed: only its nodes were wanted
            continue
        D = None
        if route != "factor":
            if adjoint is None:
                # One buffer for the block's chunks: each chunk's rows take its own
                # nodes, the batch is contracted with all of them at once (the
                # check's rows too).
                adjoint = Adjoint(parts[0].nodes[0], memory, n_rows,
                                  coarse=n_q if exact else None)
            groups = _pair_groups([(c.nodes, c.w, c.local) for c in parts], exact, n_q)
            groups = [(at, nodes, w) for nodes, w, at in groups]
            D = traj._preconditioner_into(j, held_D)
            if D is not None and held_D is None and D.numel() > 1:
                held_D = torch.empty_like(D)  # the next steps' (the state's dtype, device)
            D = None if D is None else dict(traj.unflatten(D.to(device=device,
                                                                dtype=traj.dtype)))
        decay = None
        if wd and not decoupled and route != "factor":
            decay = {k: wd * v.to(traj.dtype) for k, v in theta64.items()}
        # The steps of the interval, last first (one step unless the path is thinned:
        # then each takes the interval's segment and its batch's gradients at theta_j).
        for t in steps:
            coef, lead = -float(coefs[t]), -float(direct[t])
            if along:
                moved = -float(traj.learning_rates[j]) * wd if decoupled else coef * wd
                for c in parts:
                    reg[c.local] += moved * c.rho_theta
                    if exact:
                        reg[_shifted(c.local, n_q)] += moved * c.rho_theta_pair
            if route == "factor":
                groups = _pair_groups(_share_groups(parts), exact, n_q, split=True)
                for sub, w_sub, terms, dhat, rel in ctx.batches(t, theta):
                    scale = (w_sub.to(torch.float64) * coef).view(-1, 1, 1)
                    for nodes, w, at in groups:
                        share = factor_shares(nodes, w, terms, dhat).mul_(scale)
                        contrib[:, at].index_add_(0, sub, share)
                        if size is not None and at.start < n_q:  # the rule's rows
                            size[:, at].index_add_(0, sub, share.abs().mul_(
                                (rel + unit).view(-1, 1, 1)))
                continue
            updated = False
            for sub, w_sub, terms, dhat, rel in ctx.batches(t, theta):
                if not updated:
                    share, part = adjoint.step(groups, coef + lead, D, terms, dhat, decay)
                else:
                    share, part = adjoint.contract(terms, dhat), None
                if part is not None:
                    reg += part.view(-1, n_out)
                share = share.view(n_rows * n_out, -1).mul_(w_sub.to(share.dtype))
                contrib.index_add_(0, sub, share.T.view(-1, n_rows, n_out))
                if size is not None:
                    size.index_add_(0, sub, share[: n_q * n_out].abs().mul_(rel + unit)
                                    .T.view(-1, n_q, n_out))
                updated = True
            if not updated:  # a step without samples: the momentum still moves the parameters
                _, part = adjoint.step(groups, coef + lead, D, None, None, decay)
                if part is not None:
                    reg += part.view(-1, n_out)
            if lead:  # Nesterov's own-gradient term does not enter the memory
                adjoint.add(groups, -lead, D)
    if exact and route == "factor":
        contrib[:, n_q:] -= contrib[:, :n_q]
        reg[n_q:] -= reg[:n_q]
    return contrib.permute(1, 0, 2), reg, None if size is None else size.permute(1, 0, 2)


class _NodesAhead:
    """The queries' captures at a step's quadrature nodes, made for blocks of steps.

    A chunk of queries tries first, at each step, the count its step before ended with
    (:meth:`_Quadrature.last`), except where :meth:`_Quadrature.start` tries one node
    less (every fifth step at least). A capture at that count that is not made yet is
    made together with those of the next steps of the walk at the same count (at most
    ``STEP_BLOCK`` steps), one stacked pass for the block. A lowered try, a raised one,
    a chunk's first step and the capture engine's captures (no set-up to share there)
    capture the step alone. A point's products are those of any pass of two points or
    more it falls in, and a pass of one point runs as two where the room holds two, so
    that every capture is the one the step alone would make (see *Captures* in the
    module's docstring). With ``at_start`` (``method="first_order"``) the one point of
    step ``t`` is ``theta_t`` itself, captured for blocks of steps the same way.

    The captures held for later steps stay within an eighth of the memory budget: a
    block within its rows' share of it (the query block's rows split it), and a new
    block of some rows first drops what is held for rows it overlaps (made at a count,
    or for a group of chunks, that those rows no longer try first).
    """

    def __init__(self, ctx: _Context, lo: int, n_rows: int, at_start: bool = False,
                 pair: bool = False, held: _Scratch | None = None):
        self.ctx, self.lo, self.n_rows = ctx, lo, max(n_rows, 1)
        # The buffers the parameter points are formed in, held for the walk (see
        # _factored_block): the step's, and a block of steps' stack.
        self.held = _Scratch(ctx.device) if held is None else held
        # pair: each capture at n nodes holds the n + 1 nodes of the check's rule after
        # them (see _pair_groups), in the same stacked pass.
        self.pair = pair
        # at_start: the captures at the steps' own points theta_t (one "node", the
        # first-order methods' J_t), else at their quadrature nodes.
        self.at_start = at_start
        # (j, n, rows.start, rows.stop) -> (the capture, a list over nodes; its block)
        self._made: dict = {}
        # The bytes of the blocks that captures in _made read (a block's terms are views
        # of its stacked pass: all of it stays alive while one of them is held).
        self.alive = 0
        self._step, self._points = None, {}

    def _take(self, key):
        capture, block = self._made.pop(key)
        block[1] -= 1
        if not block[1]:
            self.alive -= block[0]
        return capture

    def passed(self, j: int, theta: torch.Tensor, nxt: torch.Tensor) -> None:
        """The walk is at step ``j``, from ``theta`` to ``nxt``: forget the captures of
        the steps after it (the walk has left them)."""
        for key in [k for k in self._made if k[0] > j]:
            self._take(key)
        # The step's nodes of the count last asked, formed once for the chunks that try
        # it (those of every count tried, kept, held 11 parameter points at a try of 6).
        self._step, self._points = (j, theta, nxt), (None, [])

    def _step_points(self, n: int, nodes: slice = slice(None)) -> torch.Tensor:
        """The nodes ``nodes`` of the ``n`` of the walk's step, ``theta + s (nxt -
        theta)`` (``theta`` alone with ``at_start``), stacked (k, P) in a held buffer
        (overwritten by the next call that asks other nodes)."""
        key = (n, nodes.start, nodes.stop)
        if self._points[0] != key:
            _, theta, nxt = self._step
            if self.at_start:
                points = theta[None]
            else:
                s = self._abscissae(n)[nodes]
                points = self.held.get("step points", (len(s), *theta.shape), theta.dtype)
                self._segment(theta, nxt, s, points, "step")
            self._points = key, points
        return self._points[1]

    def _segment(self, theta, nxt, s, out, name):
        """``out[k] = theta + s[k] (nxt - theta)`` (``s[k] (nxt - theta)`` rounded first,
        as ``theta + sk * delta`` computes it), the difference in a held buffer."""
        delta = torch.sub(nxt, theta, out=self.held.get(name + " delta", theta.shape,
                                                        theta.dtype))
        for k, sk in enumerate(s):
            torch.add(theta, torch.mul(delta, sk, out=out[k]), out=out[k])

    def _abscissae(self, n: int) -> tuple[float, ...]:
        """The nodes on [0, 1] a capture at ``n`` holds: the rule's, and with ``pair``
        the rule of a node more after them."""
        return _gauss(n)[0] + (_gauss(n + 1)[0] if self.pair else ())

    def nodes(self, j: int, n: int, X, W, rows: slice, ahead: bool):
        """The capture of the rows ``rows`` (of the query block; ``X``, ``W``) at the
        ``n`` nodes of step ``j``; ``ahead``: whether the next steps will try ``n`` first
        (then, made here, for a block of steps)."""
        key = (j, n, rows.start, rows.stop)
        if key in self._made:
            return self._take(key)
        ctx, size = self.ctx, 1
        width = len(self._abscissae(n)) if not self.at_start else 1
        if ahead and ctx.stacked is not None:
            for k in [k for k in self._made if k[2] < rows.stop and rows.start < k[3]]:
                self._take(k)
            share = ctx.ahead_bytes * (rows.stop - rows.start) // self.n_rows
            size = ctx.ahead_steps(len(X), width,
                                   max(0, min(share, ctx.ahead_bytes - self.alive)))
        steps = range(j, max(self.lo, ctx.floor(j), j - size + 1) - 1, -1)
        if len(steps) == 1 and width > ctx.node_points:
            # More nodes than the plan's room for parameter points: captured a group at
            # a time (a point's products those of any pass of two points or more; a
            # group of one runs as two), the points of one group held (all of a try's at
            # once, with those of the step's earlier tries, put a small Adam path at
            # 1.25x a 200 kB budget).
            return [c for k in range(0, width, ctx.node_points) for c in ctx.capture_nodes(
                self._step_points(n, slice(k, k + ctx.node_points)), X, W,
                two=ctx.node_points > 1)]
        points = self._step_points(n)
        if len(steps) > 1:
            # The earlier steps' points, read once for the block; theta_j ends the last.
            params = [ctx.traj.parameters(i).to(ctx.device) for i in range(steps[-1], j)]
            params.append(self._step[1])
            s = self._abscissae(n)
            block = self.held.get("block points", (len(steps) * width, *points.shape[1:]),
                                  points.dtype)
            block[:width] = points
            for k, i in enumerate(steps[1:], 1):
                # theta_i + s (theta_{i+1} - theta_i), as the walk forms them
                theta, dest = params[i - steps[-1]], block[k * width : (k + 1) * width]
                if self.at_start:
                    dest[0] = theta
                    continue
                self._segment(theta, params[i + 1 - steps[-1]], s, dest, "block")
            points = block
        # A step alone (a range's first, a chunk's) where the room holds a block: its
        # one point (theta_t with at_start) as a pass of two, as in a block.
        made = ctx.capture_nodes(points, X, W, two=size > 1)
        if len(steps) > 1:
            block = [_nbytes(made), len(steps) - 1]
            self.alive += block[0]
            for k, i in enumerate(steps[1:], 1):
                self._made[(i, n, rows.start, rows.stop)] = (
                    made[k * width : (k + 1) * width], block)
        return made[:width]


class _Chunk:
    """A chunk of queries in :func:`_factored_block`: its rows (in the call, in the
    block), node choice, queries, their weights, and what the walk keeps for it
    (``run``: the group capture its nodes are rows of, where they were captured with
    other chunks' rows in one pass, else None)."""

    def __init__(self, rows, local, quad, X, W):
        self.rows, self.local, self.quad, self.X, self.W = rows, local, quad, X, W
        self.f_next = self.nodes = self.w = self.rho_theta = self.rho_theta_pair = None
        self.run = None


def _runs(items, key):
    """``items`` cut into runs of consecutive items with equal ``key``."""
    out = []
    for item in items:
        if out and key(out[-1][-1]) == key(item):
            out[-1].append(item)
        else:
            out.append([item])
    return out


def _share_groups(parts) -> list:
    """``(nodes, weights, rows in the block)`` to take products with: a group capture
    whose chunks all took it, once; every other chunk on its own."""
    out = []
    for group in _runs(parts, lambda c: None if c.run is None else id(c.run)):
        run = group[0].run
        if run is not None and (group[0].local.start, group[-1].local.stop) == (
                run[2].start, run[2].stop):
            out.append(run)
        else:
            out.extend((c.nodes, c.w, c.local) for c in group)
    return out


def _shifted(rows: slice, by: int) -> slice:
    return slice(rows.start + by, rows.stop + by)


def _pair_weights(n: int) -> list[float]:
    """Weights that take the difference of the rule of ``n + 1`` nodes and that of
    ``n`` over a capture holding both (:meth:`_NodesAhead._abscissae`)."""
    return [-w for w in _gauss(n)[1]] + list(_gauss(n + 1)[1])


def _pair_groups(groups, pair: bool, n_q: int, split: bool = False) -> list:
    """``(nodes, weights, rows)`` of the step's rules, and with ``pair`` those of the
    check's difference on the rows ``n_q`` further (its captures hold both rules).

    With ``split`` those rows take the rule with a node more, its nodes alone, and the
    caller subtracts the rule's rows: plain SGD's products weigh each node's float32
    GEMM in float64, so the difference is the same to the products' round-off (a
    float32 GEMM of the n + 1 nodes' stacked rows may round apart from one of 2n + 1),
    with the n nodes' products taken once instead of twice. (The adjoint's float32 buffer takes
    the difference directly: two buffers' difference holds their round-off.)
    """
    out = [(nodes[: len(w)], w, at) for nodes, w, at in groups]
    if pair:
        out += [(nodes[len(w):], list(_gauss(len(w) + 1)[1]), _shifted(at, n_q)) if split
                else (nodes, _pair_weights(len(w)), _shifted(at, n_q))
                for nodes, w, at in groups]
    return out


def _cat_rows(captures):
    """Captures (lists over nodes of lists of Flat) of consecutive rows as one."""
    if len(captures) == 1:
        return captures[0]
    return [[Flat(torch.cat([c[k][i].delta for c in captures]),
                  [(name, None if a is None else torch.cat([c[k][i].inputs[j][1]
                                                            for c in captures]))
                   for j, (name, a) in enumerate(term.inputs)])
             for i, term in enumerate(node)] for k, node in enumerate(captures[0])]


def _rows_of(terms, rows):
    """A capture's terms (a list of Flat) for a slice of its rows."""
    return [Flat(t.delta[rows], [(name, None if a is None else a[rows])
                                 for name, a in t.inputs]) for t in terms]


def _replayed(ctx: _Context, quad: _Quadrature | None, method: str):
    """The intervals ``[lo, hi)`` a step range walks: its own, and on an adaptive exact
    decomposition those the serial call chooses nodes for before it.

    The node choice carries over from step to step (within a chunk of queries, see
    ``NODE_CHUNK``): a range whose steps the serial call reaches with a state replays
    the choice of every step after its own, the queries' captures only, so that it
    takes the serial call's nodes and gives its numbers. Where :func:`replays` says no,
    it restarts at 3 nodes: the sums then move within ``tol``.
    """
    first, stop = ctx.intervals
    n = len(ctx.traj) - 1
    if quad is None or (first, stop) == (0, n) or not replays(method, quad.fixed,
                                                              quad.tol, ctx.traj.dtype):
        return first, stop
    return first, n


def _intervals(traj):
    """The recorded intervals, last first: ``(j, its optimizer steps, last first)``.

    With ``record_every=1`` interval ``j`` is step ``j``; a thinned path's interval holds
    the ``steps[j + 1] - steps[j]`` steps between two recorded points.
    """
    for j in reversed(range(len(traj) - 1)):
        yield j, range(int(traj.steps[j + 1]) - 1, int(traj.steps[j]) - 1, -1)


# --------------------------------------------------------------------------- replay
class _Rows:
    """Rows ``(n, P)`` of a path read one at a time by index, as a trajectory reads its
    stored rows (``read(k)``, a method of the path that holds these rows)."""

    def __init__(self, read, n: int, n_params: int, dtype: torch.dtype):
        # Weakly: the path holds its rows, and a strong reference back would make a
        # cycle that keeps its replayed vectors (up to a quarter of memory_budget) alive
        # after the call, until the garbage collector's next pass.
        self._read, self.shape, self.dtype = weakref.WeakMethod(read), (n, n_params), dtype

    def __getitem__(self, k: int) -> torch.Tensor:
        return self._read()(int(k))

    def numel(self) -> int:
        return self.shape[0] * self.shape[1]

    def element_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


class EveryStep(Trajectory):
    """A thinned path (``record_every > 1``) with every optimizer step as a point.

    Point ``t`` is the parameters after optimizer step ``t``: a recorded point as
    recorded, the others replayed (:class:`._unrolled.Replay`: each interval forward
    from its first recorded point, with its steps' batches, step sizes, clip factors and
    weight decays as recorded, the first moments from the replay's checkpoints), and the
    optimizer state that scaled each step is the replay's. The decomposition reads it as
    a path recorded at every step, so that each step is attributed with its own
    gradients and preconditioner.

    The replayed intervals are held for a few intervals only, in the order they were
    last read (a walk reads its steps last first and, for its captures made ahead, up to
    ``STEP_BLOCK`` steps before): intervals of more than ``STEP_BLOCK`` steps one at a
    time (the blocks made ahead stop at the interval's first step, :meth:`floor`), so
    that ``2 k`` vectors are held for intervals of ``k`` steps; shorter ones as many as
    ``STEP_BLOCK`` steps span and one more (at most about ``4 STEP_BLOCK`` vectors);
    besides the replay's checkpoints of the first moments (about ``sqrt(n_points)``
    vectors, and a segment of as many). ``replay.replay_error`` is the intervals' worst
    mismatch with their next recorded point.

    Where those intervals exceed ``budget / REPLAY_SHARE``, an interval's parameters and
    optimizer state are kept every ``_every`` steps (:func:`_checkpoint_every`) and the
    steps a read falls in replayed from the checkpoint before them, ``PIECES`` pieces
    held at once: ``s ceil(k / every) + 2 PIECES every`` vectors, ``s`` a checkpoint's.
    Where even the least of those exceeds the whole budget, it warns, naming the budget
    needed.
    """

    def __init__(self, replay, budget=math.inf):
        traj = self.recorded = replay.traj
        self.replay = replay
        if replay.needs_moments:
            replay._moments = replay.replay_moments()
        steps, n = traj.steps, traj.n_steps
        self._interval_of = np.searchsorted(steps, np.arange(n + 1), side="right") - 1
        point = self._interval_of[:n]
        counts = traj._state_steps[point] + np.arange(n) - steps[point]
        group_lrs = traj._step_group_lrs
        if traj._group_lrs is not None and group_lrs is None:
            # Each step's group step sizes as the replay takes them: the interval's
            # groups' ratios to its step size, times the step's own step size.
            ref = traj.learning_rates[point]
            ratio = np.divide(traj.step_learning_rates, ref, out=np.zeros(n), where=ref != 0)
            group_lrs = traj._group_lrs[point] * ratio[:, None]
        P, dtype = traj.n_params, traj.dtype
        self._kept: dict[int, tuple[list, list]] = {}
        self._carry = None  # (j, the first moment at point j) after interval j - 1
        longest = int(np.diff(steps).max())
        # Long intervals: the walk's alone; short ones: those a block made ahead spans.
        self._long = longest > STEP_BLOCK
        self._keep = 1 if self._long else -(-STEP_BLOCK // longest) + 1
        self._every, self._marks, self._pieces = None, None, {}
        vector = P * torch.empty((), dtype=dtype).element_size()
        room = budget // REPLAY_SHARE // vector  # vectors
        if 2 * longest * self._keep > room:
            per_mark = 1 + len(traj.solver_spec.state_keys) + _first_moment(traj.solver_spec)
            self._every, held = _checkpoint_every(longest, per_mark, room,
                                                  2 * longest * self._keep)
            # Past its quarter the replay only crowds the other blocks' shares (a path
            # thinned by "auto" to fit the budget leaves it little room, and decomposes
            # silently); past the whole budget the call goes over it.
            if held * vector > budget:
                warnings.warn(
                    f"The replay of the thinned path's unrecorded steps holds {held} "
                    f"vectors of its {P:,} parameters at once ({held * vector / 2**20:.1f} "
                    f"MiB) even checkpointed, more than memory_budget={budget} itself: the "
                    f"decomposition stays exact but goes over the budget. Raise "
                    f"memory_budget to at least {REPLAY_SHARE * held * vector:,} bytes "
                    "(the replay takes a quarter of it), or record more points (a smaller "
                    "record_every).", UserWarning, stacklevel=caller_stacklevel())
        super().__init__(
            names=traj.names, shapes=traj.shapes,
            params=_Rows(self._params_at, n + 1, P, dtype), steps=np.arange(n + 1),
            learning_rates=traj.step_learning_rates.copy(),
            batch_indices=traj._batch_indices, batch_offsets=traj._batch_offsets,
            states={key: _Rows(self._state_at, n, P, dtype)
                    for key in traj.solver_spec.state_keys},
            state_steps=counts, solver=traj.solver_spec, n_samples=traj.n_samples,
            record_every=1, gradient_scales=traj._gradient_scales,
            batch_weights=traj._batch_weights, group_lrs=group_lrs,
            param_groups=traj._param_groups,
            group_weight_decays=traj._group_weight_decays, pools=traj._pools,
            pool_weights=traj._pool_weights)

    def floor(self, t: int) -> int:
        """The first step a block of steps read ahead from step ``t`` may reach: its
        interval's first, where intervals are long (then held one at a time), else 0."""
        return int(self.recorded.steps[self._interval_of[t]]) if self._long else 0

    def _interval(self, j: int) -> tuple[list, list]:
        """Interval ``j``'s replayed points (after each of its steps but the last) and
        states (after each step)."""
        if j in self._kept:
            self._kept[j] = self._kept.pop(j)  # the most recently read
            return self._kept[j]
        # Read first first (the reference outputs at every step), each interval starts
        # from the first moment the one before ended with, not from a checkpoint.
        carried = self._carry[1] if self._carry is not None and self._carry[0] == j else None
        # The intervals it displaces go first, not after it is replayed beside them (a
        # long interval's 2 k vectors would otherwise be held twice).
        while len(self._kept) >= self._keep:
            del self._kept[next(iter(self._kept))]
        steps = self.replay.interval(j, moment=carried)
        if self.replay._moments is not None:
            self._carry = (j + 1, self.replay.end_moment)
        points = [nxt for _, _, nxt, _, _ in steps[:-1]]
        states = [v for _, _, _, _, v in steps]
        self._kept[j] = points, states
        return points, states

    def _piece(self, j: int, t: int) -> tuple[list, list]:
        """The replayed points after and states after the steps of the piece of interval
        ``j`` holding step ``t`` (``every`` steps from a checkpoint of the interval)."""
        first = int(self.recorded.steps[j])
        p = (t - first) // self._every
        if (j, p) in self._pieces:
            self._pieces[j, p] = self._pieces.pop((j, p))  # the most recently read
            return self._pieces[j, p]
        while len(self._pieces) >= PIECES:  # before replaying it, as _interval's
            del self._pieces[next(iter(self._pieces))]
        if self._marks is None or self._marks["j"] != j:
            carried = (self._carry[1] if self._carry is not None and self._carry[0] == j
                       else None)
            self._marks = None
            marks = {"every": self._every}
            self.replay.interval(j, moment=carried, marks=marks)
            if self.replay._moments is not None:
                self._carry = (j + 1, self.replay.end_moment)
            self._marks = dict(marks, j=j)
        t0 = first + p * self._every
        t1 = min(t0 + self._every, int(self.recorded.steps[j + 1]))
        theta, state = self._marks[t0]
        steps = self.replay.take(j, theta, state, self._marks["count"], t0, t1, keep=True)[0]
        self._pieces[j, p] = [s[2] for s in steps], [s[4] for s in steps]
        return self._pieces[j, p]

    def _params_at(self, t: int) -> torch.Tensor:
        j = int(self._interval_of[t])
        start = int(self.recorded.steps[j])
        if t == start:
            return self.recorded.parameters(j)
        if self._every is not None:  # the point after step t - 1
            return self._piece(j, t - 1)[0][(t - 1 - start) % self._every]
        return self._interval(j)[0][t - start - 1]

    def _state_at(self, t: int) -> torch.Tensor:
        j = int(self._interval_of[t])
        start = int(self.recorded.steps[j])
        if self._every is not None:
            return self._piece(j, t)[1][(t - start) % self._every]
        return self._interval(j)[1][t - start]

    def optimizer_state(self, k: int = -1) -> dict[str, torch.Tensor]:
        state = super().optimizer_state(k)
        # The replay's state lives on the replay's device, the record's on the CPU.
        return {key: value.cpu() if key != "step" else value for key, value in state.items()}


def _checkpoint_every(k: int, per_mark: int, room: int, whole: int) -> tuple[int | None, int]:
    """``(every, held)``: the steps between an interval's checkpoints where its replayed
    vectors (``whole`` of them, the intervals held at once) exceed ``room`` (vectors),
    and the vectors the replay then holds. The longest pieces whose checkpoints
    (``per_mark`` vectors each: the parameters and the optimizer's state) and ``PIECES``
    pieces of ``2 every`` vectors fit. Where none do, the pieces that hold the least, or
    none (None, ``whole`` held) where whole intervals hold less: not refused, since a
    path thinned by ``record_every="auto"`` to fit the budget leaves the replay little
    room, and its decomposition is expected to run (:class:`EveryStep` warns past the
    whole budget)."""
    def held(every):
        return per_mark * -(-k // every) + PIECES * 2 * every

    fits = [every for every in range(1, k + 1) if held(every) <= room]
    if fits:
        return max(fits), held(max(fits))
    least = min(range(1, k + 1), key=held)
    return (least, held(least)) if held(least) < whole else (None, whole)


def every_step(module, traj, X_train, Y_train, loss, budget=math.inf):
    """``(path, why)``: a thinned ``traj`` as :class:`EveryStep` where its steps can be
    replayed (``why`` None), else ``traj`` itself and why not; ``traj`` itself where
    every step is recorded."""
    if not np.any(np.diff(traj.steps) != 1):
        return traj, None
    try:
        check_replayable(traj, module, "the replay of the unrecorded steps")
    except ValueError as exc:
        return traj, str(exc)
    return EveryStep(Replay(module, traj, X_train, Y_train, loss, X_train.device),
                     budget), None


# --------------------------------------------------------------------------- dense
def _dense_block(ctx: _Context, Xq, rows, quad: _Quadrature | None, *, method):
    """The dense route for one query block: Jacobians at the nodes, per-sample loss
    gradients of the batch, one (Q C) x P x B product per step."""
    traj, device, module = ctx.traj, ctx.device, ctx.module
    spec = traj.solver_spec
    coefs, memory, direct = traj.step_coefficients(direct=True)
    dtype = traj.dtype  # not the queries' (token ids are int64)
    n_q, N = Xq.shape[0], len(ctx.X_train)
    n_res, P = ctx.n_res, traj.n_params
    decoupled = spec.name == "adamw"
    checked = dict(check_hidden=False, exclude=ctx.exclude)
    # The adjoint in float64: a float32 one, a full P-vector per query output carried
    # through every step, erred up to 2.7x the adjoint route's factored buffers on
    # float32 paths, over the round-off estimate both take (4.64 against 3.93 in units
    # of 1e-6 S on converged full-batch Adam; benchmarks/results/dense_roundoff-s47.md).
    lam = torch.zeros((n_q, n_res, P), dtype=torch.float64, device=device)
    rho = torch.empty((n_q, n_res, P), dtype=dtype, device=device)
    node = torch.empty_like(rho) if method == "exact" else None
    G = torch.empty((min(ctx.b_block, N), 1, P), dtype=dtype, device=device)
    contrib = torch.zeros((n_q, N, n_res), dtype=torch.float64, device=device)
    reg = torch.zeros((n_q, n_res), dtype=torch.float64, device=device)
    # A float32 path's contributions: their round-off, as the other routes take it
    # (see _contribution_check).
    size = (torch.zeros_like(contrib) if method == "exact" and dtype != torch.float64
            else None)
    unit = ROUNDOFF * float(torch.finfo(dtype).eps)
    # The queries' weights as (Q, 1, C): one batched product contracts a Jacobian.
    Wq = None if ctx.weights is None else ctx.weights[rows]

    def jac(flat, out):
        if Wq is None:
            return tangent_features(module, _params(traj, flat), Xq, output="full",
                                    memory_budget=ctx.budget, out=out, **checked)
        return ctx.seeded_rows(_params(traj, flat), Xq, Wq, out)

    nxt = traj.parameters(len(traj) - 1).to(device)
    f_next = quad.f[-1] if method == "exact" else None
    # The step's difference and the batch's float64 gradients, in buffers held for the
    # walk (see _factored_block).
    held = _Scratch(device)
    for j, steps in _intervals(traj):
        theta = traj.parameters(j).to(device)
        delta = torch.sub(nxt, theta, out=held.get("delta", theta.shape, theta.dtype))
        if method == "exact":
            f_t = quad.f[j]
            d64 = (nxt.to(torch.float64) - theta.to(torch.float64))

            def evaluate(n, theta=theta, delta=delta, d64=d64):
                s, w = _gauss(n)
                q = spread = 0.0
                for k, (sk, wk) in enumerate(zip(s, w)):
                    Jk = jac(theta + float(sk) * delta, rho if k == 0 else node).to(
                        torch.float64)
                    q = q + float(wk) * (Jk @ d64)
                    spread = spread + float(wk) ** 2 * (Jk * Jk) @ (d64 * d64)
                    if k == 0:
                        rho.mul_(float(wk))
                    else:
                        rho.add_(Jk.to(rho.dtype), alpha=float(wk))
                return q, spread.sqrt(), None

            quad.choose(j, evaluate, ctx.ref.out(f_next - f_t, rows),
                        ctx.ref.noise(f_t, f_next, rows))
            f_next = f_t
        else:
            jac(theta, rho)
            if method == "second_order":
                _add_hvp_rows(module, traj, ctx.layout, theta, delta, Xq, rho, 0.5,
                              ctx.hvp_block, Wq, n_out=ctx.hvp_outputs)
        nxt = theta
        D = traj.preconditioner(j)
        D = None if D is None else D.to(device)
        params = _params(traj, theta)
        for t in steps:
            scale, lead = -float(coefs[t]), -float(direct[t])
            # lambda_t = scale * D * rho_t + memory * lambda_{t+1}, in place.
            lam.mul_(memory)
            _add_scaled(lam, rho, D, scale + lead)
            if spec.weight_decay:
                direction = _decay_direction(traj, j, theta, decoupled)
                if decoupled:
                    decay = -float(traj.learning_rates[j]) * spec.weight_decay * direction
                    reg += (rho @ decay).double()
                else:
                    reg += lam @ (spec.weight_decay * direction).double()
            idx, w = _step_points(traj, t, ctx.weighting, device)
            for b0 in range(0, len(idx), ctx.b_block):
                sub = idx[b0 : b0 + ctx.b_block]
                out = forward(module, params, ctx.X_train[sub])
                r = ctx.loss.residuals(out, ctx.Y_train[sub])
                rel = ctx.rounding(theta, sub, out, r)
                # The per-sample loss gradients J_i^T r_i: one backward pass seeded with r.
                g = ctx.seeded_rows(params, ctx.X_train[sub], r, G[: len(sub)])[:, 0]
                if g.dtype != torch.float64:
                    g = held.get("g64", g.shape, torch.float64).copy_(g)
                share = (lam.flatten(0, 1) @ g.T).unflatten(0, lam.shape[:2])
                share = share.transpose(1, 2).double() * w[b0 : b0 + ctx.b_block, None]
                contrib.index_add_(1, sub, share)
                if size is not None:
                    size.index_add_(1, sub, share.abs().mul_((rel + unit)[None, :, None]))
            if lead:  # Nesterov's own-gradient term does not enter the memory
                _add_scaled(lam, rho, D, -lead)
    return contrib, reg, size


def _add_scaled(lam, rho, D, scale):
    """``lam += scale * D * rho`` in place (``D`` None: the identity)."""
    if D is None:
        lam.add_(rho, alpha=scale)
    else:
        lam.addcmul_(rho, D, value=scale)


# --------------------------------------------------------------------------- entry
def decompose(
    module: torch.nn.Module,
    traj: Trajectory,
    X_train: torch.Tensor,
    Y_train: torch.Tensor,
    loss: Loss,
    X: torch.Tensor,
    *,
    method: str = "exact",
    weighting: str = "realized",
    n_nodes: int | None = None,
    tol: float | None = None,
    memory_budget: int = 2**30,
    units=None,
    weights=None,
    warn: bool = True,
    intervals: tuple[int, int] | None = None,
    chunk: int | None = None,
) -> Decomposition:
    """Decompose ``f(X; theta_T)`` over the training points along ``traj`` (see module doc).

    ``n_nodes`` fixes the Gauss-Legendre nodes of every step (no error control); else the
    nodes of each step are chosen for the relative tolerance ``tol`` (``default_tol`` of
    the dtype when None), and each contribution's measured error, ``contribution_error``,
    is checked against ``tol`` (on a float32 path with ``tol=None``, against
    ``FLOAT32_CHECK_TOL``, its products' round-off floor: ``contribution_tol``).
    ``units`` maps the result to the units the caller reports (``normalize_y``'s
    targets) before the warnings quote its error.

    ``weights`` (n_queries, C) decomposes instead the scalar output ``w_q . f(x_q)`` of
    each query (the result has one output): the queries' backprops are linear in the
    output's seed, so each capture of the queries backpropagates the contracted output
    once, and every query-side product (the adjoint, the Gram of factors, the dense
    Jacobians) has one row per query instead of C. The reference f and so the residuals,
    ``tol``, ``step_errors`` and ``error`` are those of the contracted output. (The
    batch side is captured the same way with or without weights: one backward pass of
    ``r_i . f(x_i)``, its loss residuals as the seed.)

    ``warn=False`` returns ``(result, checks)`` in the network's units, for query blocks
    computed apart: :func:`merge` joins them and :func:`finish` maps and warns.

    ``intervals=(start, stop)``: only the steps of the recorded intervals
    ``start <= j < stop``, on a path whose steps are independent (:func:`step_ranges`);
    :func:`merge_steps` sums such parts. Their ``prediction`` and ``initial`` are the
    whole path's, and ``error`` means nothing until they are summed.

    ``chunk``: the queries whose nodes are chosen together (a power of two; None:
    :func:`node_chunk` of the call); a block of a larger call's queries passes the
    call's, and starts at a multiple of it.
    """
    if intervals is not None and _route(traj, method) != "factor":
        raise ValueError("decompose(intervals=...) splits the steps of plain SGD paths "
                         "only: the other solvers' adjoint runs through every step.")
    # A thinned path (record_every > 1) has no parameters between its recorded points:
    # they are replayed (EveryStep), and every step is then attributed as on a path
    # recorded at every step. Where the replay is impossible (``refusal``: why), each
    # of an interval's steps takes the interval's segment (its f-change is still
    # integrated exactly) and its batch's gradients at the interval's first point, which
    # is not the path the optimizer took; the error says by how much.
    recorded = traj
    traj, refusal = every_step(module, traj, X_train, Y_train, loss, memory_budget)
    thinned = refusal is not None
    replay = traj.replay if isinstance(traj, EveryStep) else None
    if replay is not None and intervals is not None:  # the recorded intervals' steps
        intervals = tuple(int(recorded.steps[k]) for k in intervals)
    device, dtype = X.device, traj.dtype
    exact = method == "exact"
    initial = forward(module, _params(traj, traj.parameters(0).to(device)), X).double()
    prediction = forward(module, _params(traj, traj.parameters(-1).to(device)), X).double()
    n_q, n_out = prediction.shape
    if weights is not None:
        weights = torch.as_tensor(np.asarray(weights, dtype=np.float64), device=device)
        if weights.shape != prediction.shape:
            raise ValueError(f"weights must have shape {tuple(prediction.shape)} (queries, "
                             f"outputs), got {tuple(weights.shape)}.")
        initial, prediction = _contract(initial, weights), _contract(prediction, weights)
    ref = _Reference(module, traj, X, weights) if exact else None
    P, N = traj.n_params, X_train.shape[0]
    requested = tol  # a tol the caller chose is warned about below the round-off floor
    tol = ((default_tol(dtype) if tol is None else float(tol)) if _adaptive(method, n_nodes)
           else None)
    route = _route(traj, method)
    itemsize = torch.empty((), dtype=dtype).element_size()
    # The engine's autograd check for hidden reads runs once, at the path's first, middle
    # and last points, instead of at each of the (n_nodes + 1) x T captures.
    theta_0, theta_T = traj.parameters(0).to(device), traj.parameters(-1).to(device)
    middle = traj.parameters(len(traj) // 2).to(device)
    exclude = hidden_reads(
        module, [_params(traj, t) for t in (theta_0, middle, theta_T)], [X, X_train],
        output="full", memory_budget=memory_budget)
    outputs = list(range(n_out))
    probe = capture(module, _params(traj, theta_0), X_train[:1], outputs,
                    memory_budget=memory_budget, exclude=exclude, index=True)
    exclude = probe.exclude
    terms = pair_terms(probe.terms)
    # One sample's factors (the captures keep them with their graph: x 4), or their pair
    # layout where it is larger (per-sample gradients of layers over many positions), and
    # the widest layer output, which sizes the pair engine's per-sample intermediates;
    # with the capture's copy of its rows where no factor holds it (Capture.input_bytes).
    sizes = [t.delta.numel() * itemsize + sum(a.numel() * itemsize for _, a in t.inputs
                                              if a is not None) for t in terms]
    node = max(probe.nbytes(), sum(sizes))
    row = 4 * node + probe.input_bytes
    width = max(t.delta.shape[2] for t in terms)
    largest = max(t.delta.shape[2] * (1 if a is None else a.shape[1])
                  for t in terms for _, a in t.inputs)
    dense = max((t.delta.shape[2] for t in terms for _, a in t.inputs if a is None),
                default=0)

    made, plans, paths = [], [], {}  # the walk's node choices, its plan, f per block

    def quadrature(rows, chunks):
        """The node choices of the chunks of queries ``chunks`` in the block ``rows``
        (None: no choice to make)."""
        if not exact:
            return [None] * len(chunks)
        key = (rows.start, rows.stop)
        if key not in paths:  # one pass for the block, kept for the check's passes
            paths[key] = [ref(t, rows) for t in range(len(traj))]
        f = paths[key]
        out = []
        for c_rows in chunks:
            i = slice(c_rows.start - rows.start, c_rows.stop - rows.start)
            f_c = [ft[i] for ft in f]
            changes, scale = _path_changes(f_c, ref, c_rows)
            out.append(_Quadrature(len(traj) - 1, tol=tol or 0.0, n_nodes=n_nodes,
                                   changes=changes, scale=scale, dtype=dtype, f=f_c,
                                   plan=plans[len(made) + len(out)] if plans else None))
            out[-1].rows = c_rows
        made.extend(out)
        return out

    def walk(plan=None):
        """The contributions, regularization and node choices of one walk of the path
        (``plan``: per chunk of queries, the node count of every step)."""
        nonlocal exclude
        plans[:] = plan or []
        while True:
            made.clear()
            try:
                c, r, pair = _run(
                    module, traj, X_train, Y_train, loss, X, method=method,
                    weighting=weighting, route=route, quadrature=quadrature,
                    memory_budget=memory_budget, exclude=exclude,
                    outputs=outputs, row=row, width=width, largest=largest, dense=dense,
                    itemsize=itemsize, node=(node, max(sizes)),
                    P=P, N=N, ref=ref, n_nodes=n_nodes,
                    chunk=node_chunk(traj, method, len(X)) if chunk is None else chunk,
                    weights=weights, intervals=intervals)
                return c, r, list(made), pair
            except _Reroute as new:
                exclude = new.exclude

    contributions, regularization, quads, pair = walk()
    contribution_error, measured, roundoff, difference = None, None, None, None
    # What contribution_error is checked against, relative to the path's largest |f|:
    # a fixed rule's exact checks' accuracy; with tol=None on a float32 path the
    # products' round-off floor (the nodes are still chosen for tol); else tol.
    contribution_tol = (None if not exact else INEXACT_FLOOR[dtype] if n_nodes is not None
                        else FLOAT32_CHECK_TOL if requested is None and dtype == torch.float32
                        else tol)
    if exact and quads:
        contributions, regularization, quads, contribution_error = _contribution_check(
            walk, (contributions, regularization, quads, pair),
            tol if n_nodes is None else INEXACT_FLOOR[dtype], adaptive=n_nodes is None,
            chosen=requested is not None)
        measured = contribution_error
        # NaN-aware: a chunk's NaN wins whatever the chunks' order (max keeps its first).
        roundoff = worst(q.roundoff for q in quads)
        difference = worst(q.difference for q in quads)
    result = _result(initial, prediction, contributions, regularization, method, weighting)
    result.replay_error = None if replay is None else replay.replay_error
    result.contribution_error = contribution_error
    scale, failed, floored, slow, capped = None, {}, {}, {}, {}
    if exact:  # each step's largest count and residual over the chunks, as merge joins
        result.n_nodes = np.max([q.n_used for q in quads], axis=0, initial=0)
        result.step_errors = np.max([q.errors for q in quads], axis=0, initial=0.0)
        result.tol = tol
        result.contribution_tol = contribution_tol
        scale = max((float(q.scale) for q in quads), default=0.0)
        for q in quads:
            _join(failed, q.failed)
            _join(slow, q.slow)
            _join(capped, q.capped)
            if requested is not None:
                _join(floored, q.floored)
    checks = _Checks(exact=exact, thinned=thinned, method=method, weighting=weighting,
                     tol=tol, scale=scale, dtype=dtype, failed=failed,
                     n_steps=len(traj) - 1, record_every=recorded.record_every,
                     floored=floored, n_nodes=n_nodes if exact else None,
                     unequal_weights=weighting == "expected" and _unequal_batch_weights(traj),
                     preconditioned=traj.solver_spec.name in ("adam", "adamw", "rmsprop"),
                     refusal=refusal, replay_limit=replay_limit(recorded),
                     compression=recorded.compression, measured=measured, slow=slow,
                     roundoff=roundoff, difference=difference,
                     contribution_tol=contribution_tol, capped=capped)
    if not warn:
        return result, checks
    return finish(result, checks, units)


def _contribution_check(walk, first, tol: float, *, adaptive: bool, chosen: bool):
    """``(contributions, regularization, quads, contribution_error)``: the walk's
    result with each chunk's per-contribution quadrature error, measured, and nodes
    raised where it is over (``contribution_error``: the largest of the chunks').

    ``first`` (and each ``walk(plan)``): ``(contributions, regularization, quads,
    (d_contributions, d_regularization))``, the last the difference of the rule with a
    node more per step, taken in the same walk (:func:`_factored_block`). The node
    choice bounds the residual of a step's SUM of shares only: point i's share errs by
    ``delta_rho_t . dtheta_t^(i)``, which that residual does not bound where the
    points' parts cancel, nor where they move along a direction in which the queries'
    gradients bend while f changes linearly along the step (the residual, and any
    estimate read from it, then stays at round-off while each share keeps its error:
    ``benchmarks/results/contribution_error_blind_spot.md``). A chunk with adaptive
    nodes returns the rule with a node more, and the largest difference of one of its
    contributions is its error (the n-node rule's, up to the returned rule's: above the
    returned rule's wherever a node more at least halves it; where it does not, the
    step's sum shows it, :meth:`_Quadrature.paired`). Where that is over
    ``tol`` times the chunk's largest |f|, the path is walked again with ``RAISE``
    nodes more per step in that chunk (up to ``CHECK_RAISES`` walks while the error
    falls fourfold per walk), and the walk with the smallest error is kept with it.
    Fixed ``n_nodes``, a chunk with a failed step (warned of as such) and one whose
    sums already missed a tolerance the caller ``chosen`` (below the dtype's round-off
    floor, warned of as such) are not raised; the first two return their own rule,
    measured by the rule with a node more (within the node's gain of its error). Each
    chunk of queries is judged on its own, as its node choice is, so that a block of
    the queries on a worker keeps the serial call's. On a float32 path each
    contribution's error adds to its difference ``sum_t |share_t| (ROUNDOFF eps + e_t)``
    (the walk's, ``e_t`` the relative round-off of the share's residual measured at its
    step: :meth:`_Context.rounding`), the round-off that the difference, taken
    from the same float32 factors, does not measure; the raises judge the difference
    alone (more nodes do not cut round-off), and each chunk's round-off and difference
    alone are kept (``quads[c].roundoff``, ``.difference``) for the warning naming
    float64. (The
    dense route, which the tests check the others against, takes the rule with a node
    more in a walk of its own, and adds no round-off estimate.)
    """
    quads = first[2]
    allowed = [tol * float(q.scale) for q in quads]
    base = [q.n_used for q in quads]
    # Per chunk: whether it returns the rule with a node more (adaptive nodes), and
    # whether a raise may still cut its error (a tolerance the dtype resolves, an error
    # still falling); the walk kept and its measured error.
    raised = [adaptive and not q.failed for q in quads]
    open_ = [r and not (chosen and q.floored) for r, q in zip(raised, quads)]
    kept, error, last = [0] * len(quads), [math.nan] * len(quads), [math.nan] * len(quads)

    def paired(result, plan):
        # The dense route takes no pair in its walk: a walk with a node more gives it
        # (the walk's own sums of the shares' sizes are kept).
        if result[3] is not None and result[3][0] is not None:
            return result
        more = walk([p + 1 for p in plan])
        size = None if result[3] is None else result[3][2]
        return (*result[:3], (more[0] - result[0], more[1] - result[1], size))

    walks = [paired(first, base)]
    for r in range(CHECK_RAISES + 1):
        if r:
            # The chunks still over take RAISE nodes more per walk, the others their
            # kept walk's counts again.
            plan = [b + RAISE * (r if open_[c] else kept[c]) for c, b in enumerate(base)]
            walks.append(paired(walk(plan), plan))
        diff = walks[-1][3][0]
        for c, q in enumerate(quads):
            if r and not open_[c]:
                continue
            e = float(np.max(np.abs(diff[q.rows]), initial=0.0))
            if not r or e < error[c]:
                kept[c], error[c] = r, e
            # Settled, or no longer falling fourfold per raise (round-off): stop.
            falling = not r or e < last[c] / 4
            last[c] = e
            open_[c] = open_[c] and falling and not e <= allowed[c]
        if not any(open_):
            break
    contributions, regularization = first[0].copy(), first[1].copy()
    out = []
    for c, q in enumerate(quads):
        w = walks[kept[c]]
        contributions[q.rows], regularization[q.rows] = w[0][q.rows], w[1][q.rows]
        quad = w[2][c]
        if raised[c]:
            contributions[q.rows] += w[3][0][q.rows]
            regularization[q.rows] += w[3][1][q.rows]
            quad.n_used = quad.n_used + 1
        if w[3][2] is not None:
            # The round-off that a node more does not measure, added to each
            # contribution's measured error (the raises above judge the quadrature).
            roundoff = w[3][2][q.rows]
            quad.roundoff = float(np.max(roundoff, initial=0.0))
            quad.difference = float(np.max(np.abs(w[3][0][q.rows]), initial=0.0))
            error[c] = float(np.max(np.abs(w[3][0][q.rows]) + roundoff, initial=0.0))
        out.append(quad)
    # Called with at least one chunk (every exact walk with steps has one).
    return contributions, regularization, out, worst(error)


@dataclass
class _Checks:
    """What the warnings about a decomposition need besides the result itself."""

    exact: bool
    # A thinned path split with each interval's gradients at its first point (its
    # steps not replayed: ``refusal`` says why).
    thinned: bool
    method: str
    weighting: str
    tol: float | None
    scale: float | None
    dtype: torch.dtype
    failed: dict
    n_steps: int
    record_every: int
    # Steps accepted at the round-off floor above their share of a tol the caller chose.
    floored: dict = field(default_factory=dict)
    n_nodes: int | None = None  # the fixed node count of an exact call
    # The path's batches weigh their entries unequally (sample_weight) but it recorded no
    # weights of its pools (a PathRecorder loop): the expected weighting's 1/N does not
    # follow them.
    unequal_weights: bool = False
    # The solver scales its steps by a recorded diagonal (Adam, AdamW, RMSprop), which a
    # thinned path also takes at each interval's first point.
    preconditioned: bool = False
    # Why a thinned path's steps could not be replayed (None: replayed, or not thinned).
    refusal: str | None = None
    # The replay's mismatch above which it warns (replay_limit), and the path's
    # trajectory_compression (its rounded points are not the training's).
    replay_limit: float = 0.0
    compression: str | None = None
    # The largest per-contribution error measured by walks with more nodes (None: none
    # was, the other methods).
    measured: float | None = None
    # Steps whose sum a node more did not halve (the ratio of the residuals by the rule
    # with a node more and by the rule): there the two rules' difference is no upper
    # estimate (_Quadrature.paired).
    slow: dict = field(default_factory=dict)
    # The failed steps whose node counts memory_budget limited (_Quadrature.capped).
    capped: dict = field(default_factory=dict)
    # The part of ``measured`` that is a float32 path's estimated round-off (zero on a
    # float64 path, None where nothing was measured).
    roundoff: float | None = None
    # The largest two rules' difference alone of a float32 path's contributions, the
    # part of ``measured`` that more nodes can cut (None where not estimated).
    difference: float | None = None
    # What ``measured`` is checked against, relative to ``scale``
    # (Decomposition.contribution_tol).
    contribution_tol: float | None = None

    def relative(self, value: float) -> float:
        """``value`` relative to the path's largest |f| (``scale``)."""
        return value / max(self.scale or 0.0, 1e-300)


def _join(into: dict, steps: dict) -> None:
    """Each step's worst residual over parts (NaN kept: see :func:`.worse`)."""
    for t, r in steps.items():
        into[t] = worse(into.get(t, 0.0), r)


def merge(parts: list) -> tuple[Decomposition, _Checks]:
    """The ``(result, checks)`` of query blocks (``decompose(..., warn=False)``) as one."""
    results, checks = [p[0] for p in parts], [p[1] for p in parts]
    first = results[0]
    merged = Decomposition(
        initial=np.concatenate([r.initial for r in results]),
        contributions=np.concatenate([r.contributions for r in results]),
        regularization=np.concatenate([r.regularization for r in results]),
        prediction=np.concatenate([r.prediction for r in results]),
        error=worst(r.error for r in results), method=first.method,
        weighting=first.weighting, tol=first.tol,
        contribution_tol=first.contribution_tol, replay_error=_worst_replay(results),
        contribution_error=None if first.contribution_error is None
        else worst(r.contribution_error for r in results))
    if first.n_nodes is not None:  # the blocks' largest, as within one call
        merged.n_nodes = np.max([r.n_nodes for r in results], axis=0)
        merged.step_errors = np.max([r.step_errors for r in results], axis=0)
    failed, floored, slow, capped = {}, {}, {}, {}
    for c in checks:
        _join(failed, c.failed)
        _join(floored, c.floored)
        _join(slow, c.slow)
        _join(capped, c.capped)
    c0 = checks[0]
    scale = None if c0.scale is None else max(c.scale for c in checks)
    roundoff = [c.roundoff for c in checks if c.roundoff is not None]
    difference = [c.difference for c in checks if c.difference is not None]
    return merged, _Checks(**{**c0.__dict__, "scale": scale, "failed": failed,
                              "floored": floored, "measured": _worst_measured(checks),
                              "slow": slow, "capped": capped,
                              "roundoff": worst(roundoff, None),
                              "difference": worst(difference, None)})


def _worst_measured(checks) -> float | None:
    """The parts' largest measured per-contribution error (None where none measured)."""
    errors = [c.measured for c in checks if c.measured is not None]
    return worst(errors) if errors else None


def _worst_replay(results) -> float | None:
    """The parts' worst replay mismatch (None where none replayed)."""
    errors = [r.replay_error for r in results if r.replay_error is not None]
    return worst(errors) if errors else None


def replays(method: str, n_nodes: int | None, tol: float | None, dtype) -> bool:
    """Whether a step range replays the node choice of the steps before it
    (:func:`_replayed`): on an adaptive exact decomposition whose ``tol`` is looser than
    ``REPLAY_TOL``. At that tolerance a range that restarts the choice still agrees with
    the serial call to 1e-12 relative; at float32's 1e-6 it moves the sums by about 1e-8.
    """
    if not _adaptive(method, n_nodes):
        return False
    return (default_tol(dtype) if tol is None else float(tol)) > REPLAY_TOL


def step_ranges(traj: Trajectory, method: str, weighting: str, n_queries: int,
                n_tasks: int, *, n_nodes: int | None = None,
                tol: float | None = None) -> list[tuple[int, int]] | None:
    """The step ranges ``n_tasks`` workers should split the path into, or None where
    they should split the queries.

    Steps are independent on plain SGD paths only (no memory: a step's share needs that
    step alone); the adjoint of momentum and Adam runs through every step, so those
    paths split their queries. On plain SGD, in rows captured per worker (a batch row at
    one point, a query row at each of ``NODES_GUESS`` quadrature nodes, about as costly):

    - query blocks: every block captures every step's batch and its queries, ``T b + k
      T Q_w`` for the largest block's ``Q_w`` queries (about ``Q / n``; an adaptive
      call's blocks are cut at its node chunks, at most one per chunk);
    - step ranges: each range captures its steps' batches and queries, but every
      query's reference f at all ``T + 1`` points (about half a capture each), and
      either restarts the adaptive node count at its first step (about 2 node captures
      of every query more) or replays the node choice of the steps after it
      (:func:`replays`). A replayed step costs its whole query side, ``REPLAY_ROWS Q``
      (which then stands for ``k Q`` throughout); the cuts balance it: a range that
      replays more takes fewer steps of its own.

    Measured on the 64-512-512-1 MLP (batch 64, 8 steps, CPU time of each worker's share
    on one thread, float64 paths that restart), 1.65x for ranges against 1.13x for
    blocks with 10 queries, and 1.46x against 1.66x with 200. Replaying float32 ranges
    cost more than the serial call there (the query side is most of each step), so a
    replay pays only with batches of several times ``REPLAY_ROWS`` rows per query.
    """
    n = len(traj) - 1
    if _route(traj, method) != "factor" or n_tasks < 2 or n < 2:
        return None
    sizes = (pool_sizes(traj) if weighting == "expected"
             else np.array([len(bt) for bt in traj.batches]))
    steps = np.asarray(traj.steps, dtype=np.int64)
    batch = np.array([sizes[steps[j]:steps[j + 1]].sum() for j in range(n)], dtype=float)
    Q = float(n_queries)
    replay = REPLAY_ROWS * Q if replays(method, n_nodes, tol, traj.dtype) else 0.0
    queries = replay or (NODES_GUESS if method == "exact" else 1) * Q  # a step's
    restart = 2 * Q if _adaptive(method, n_nodes) and not replay else 0.0
    ref = (n + 1) * Q / 2 if method == "exact" else 0.0
    # The largest query block's share of the queries, cut as decompose cuts them (an
    # adaptive call's at its node chunks: no more blocks than chunks, of unequal sizes).
    align = block_align(traj, method, n_nodes, n_queries)
    share = max((b - a for a, b in _ranges(n_tasks, n_queries, align)), default=0) / max(
        1, n_queries)
    blocks = batch.sum() + (n * queries + ref) * share
    # The cheapest cut: bisection on the largest worker cost, each range taken greedily
    # from the path's end (the order the serial call walks it).
    own = batch + queries

    def cut(limit):
        """Ranges from the path's end, each as long as its worker's cost stays under
        ``limit`` (one interval at least)."""
        bounds, stop, cost = [], n, ref
        for j in range(n - 1, -1, -1):
            if stop > j + 1 and cost + own[j] > limit:
                bounds.append((j + 1, stop))
                stop = j + 1
                cost = ref + restart + replay * (n - stop)
            cost += own[j]
        return [(0, stop), *bounds[::-1]]

    def worst(bounds):
        return max(ref + (restart if stop < n else 0.0) + replay * (n - stop)
                   + own[start:stop].sum() for start, stop in bounds)

    lo, hi = own.max(), ref + restart + replay * n + own.sum()
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (lo, mid) if len(cut(mid)) <= n_tasks else (mid, hi)
    bounds = cut(hi)
    if len(bounds) < 2 or worst(bounds) >= blocks:
        return None
    return bounds


def merge_steps(parts: list) -> tuple[Decomposition, _Checks]:
    """The ``(result, checks)`` of step ranges (``decompose(..., intervals=...)``) of
    the same queries as one: contributions and regularization summed, each step's
    nodes and residual from the part that computed it."""
    results, checks = [p[0] for p in parts], [p[1] for p in parts]
    first = results[0]
    merged = Decomposition(
        initial=first.initial, prediction=first.prediction,
        contributions=np.sum([r.contributions for r in results], axis=0),
        regularization=np.sum([r.regularization for r in results], axis=0),
        error=0.0, method=first.method, weighting=first.weighting, tol=first.tol,
        contribution_tol=first.contribution_tol, replay_error=_worst_replay(results),
        # The ranges' steps are apart: their errors of one contribution add up.
        contribution_error=None if first.contribution_error is None
        else float(np.sum([r.contribution_error for r in results])))
    if len(merged.prediction):
        merged.error = float(np.max(np.abs(merged.reconstruction - merged.prediction)))
    if first.n_nodes is not None:  # zero where a part did not compute the step
        merged.n_nodes = np.max([r.n_nodes for r in results], axis=0)
        merged.step_errors = np.max([r.step_errors for r in results], axis=0)
    failed = {t: r for c in checks for t, r in c.failed.items()}
    floored = {t: r for c in checks for t, r in c.floored.items()}
    slow = {t: r for c in checks for t, r in c.slow.items()}
    capped = {t: r for c in checks for t, r in c.capped.items()}
    measured = [c.measured for c in checks if c.measured is not None]
    roundoff = [c.roundoff for c in checks if c.roundoff is not None]
    difference = [c.difference for c in checks if c.difference is not None]
    return merged, _Checks(**{**checks[0].__dict__, "failed": failed, "floored": floored,
                              "slow": slow, "capped": capped,
                              "measured": float(np.sum(measured)) if measured else None,
                              "roundoff": float(np.sum(roundoff)) if roundoff else None,
                              "difference": float(np.sum(difference)) if difference
                              else None})


def finish(result: Decomposition, checks: _Checks, units=None,
           verb: str = "decompose") -> Decomposition:
    """Map the result into the caller's units and warn where it is not exact, naming
    ``verb``, the method the user called (attribute and explain decompose too)."""
    # Judged in the network's units, against the path's own scale. The expected
    # weighting is an approximation for minibatches, by design.
    # A replay that missed the record names its cause; the closure's miss is in it.
    missed_replay = (result.replay_error is not None
                     and not result.replay_error <= checks.replay_limit)
    # Steps whose quadrature missed tol still measured finite residuals, which bound the
    # miss they can explain: a larger one (a loop's loss other than the declared one, on a
    # ReLU network) was blamed on the quadrature alone.
    closure = (_inexact(result, checks) if checks.exact and not checks.thinned
               and all(map(math.isfinite, checks.failed.values())) and not missed_replay
               else None)
    inexact = closure if checks.weighting == "realized" else None
    # The expected weighting leaves a minibatch path's batch noise out of the split: its
    # contributions miss the prediction by design, and the miss is said, not implied met.
    smoothed = closure if checks.weighting == "expected" else None
    # The quadrature's summed residuals against what the tolerance allows them, in the
    # network's units (as the node choice judged them).
    missed = _missed_quadrature(result, checks) if checks.exact and not checks.failed else None
    one = (_missed_contribution(result, checks) if checks.exact and not checks.failed
           else None)
    # A float32 path whose round-off alone misses, or tips over a difference that meets
    # the tolerance: more nodes cannot help, float64 does.
    # Each part is warned of where it misses: the round-off (PrecisionWarning) and the
    # quadrature's own difference (ConvergenceWarning), both where both do.
    roundoff = _missed_roundoff(checks) if one is not None else None
    one = None if roundoff is not None and not _missed_difference(checks) else one
    if units is not None:
        result = units(result)
    if checks.failed:
        listed = _list_steps(checks.failed)
        bad = sum(not math.isfinite(r) for r in checks.failed.values())
        nonfinite = (f" {bad} of them have a non-finite residual (NaN or inf: the network's "
                     "output at the step's nodes or ends overflowed or is undefined)."
                     if bad else "")
        goal = ("did not reach a finite residual with the fixed "
                f"n_nodes={checks.n_nodes}" if checks.tol is None else
                f"did not reach tol={checks.tol:g} (relative to the largest |f| along the "
                f"path, {checks.scale:.3g}) within {MAX_NODES} Gauss-Legendre nodes or "
                "stopped converging")
        warnings.warn(
            f"{verb}(method='exact'): the quadrature of {len(checks.failed)} of "
            f"{checks.n_steps} steps {goal}: steps {listed}.{nonfinite} The "
            f"achieved error is {result.error:.3g} (Decomposition.error; per step: "
            "step_errors); on such steps Decomposition.contribution_error, measured "
            "by the rule with a node more, need not measure a single "
            "contribution's error. A non-smooth activation (relu) or very large steps make the "
            "integrand hard to integrate; a smaller learning rate or a smooth activation "
            "helps. A forward that draws at random (noise, dropout) differs at every node "
            "and never converges: declare its draws as inputs (its warning when the "
            f"network was built says so).{_capped_note(checks)}",
            ConvergenceWarning, stacklevel=caller_stacklevel(),
        )
    elif missed is not None:
        _warn_missed(result, checks, *missed, verb)
    if one is not None:
        _warn_contribution(result, checks, one, verb)
    if roundoff is not None:
        _warn_roundoff(result, checks, roundoff, verb)
    if checks.exact and checks.slow and not checks.failed:
        _warn_slow(result, checks, verb)
    if inexact is not None:
        _warn_inexact(result, inexact, verb)
    if checks.thinned:
        _warn_thinned(result, checks, verb)
    if missed_replay:
        _warn_replay(result, checks, verb)
    if checks.weighting == "expected" and (checks.unequal_weights or smoothed is not None):
        size = float(np.abs(result.prediction).max()) if len(result.prediction) else 0.0
        why = ("this path's batches weigh their points unequally (recorded in "
               "trajectory_.batch_weights) but it did not record the weights of the "
               "points they were drawn from: the expected representation ignores those "
               "weights (1/N each)" if checks.unequal_weights else
               "the minibatches' deviation from that average (the representation's noise "
               "term) is left out of the split")
        warnings.warn(
            f"{verb}(weighting='expected') credits each step to every point it could "
            "have drawn (the data of the fit or partial_fit call that took it; all N "
            "points of a PathRecorder path) by its probability of being in the batch, "
            f"and {why}: the contributions miss the prediction by "
            f"{result.error:.3g} ({result.error / max(size, 1e-300):.2g} relative; "
            "Decomposition.error), above the exact split's round-off. "
            "weighting='realized' splits the realized path exactly.",
            UserWarning, stacklevel=caller_stacklevel(),
        )
    return result


def thinned_miss(result: Decomposition) -> float:
    """A thinned path's reconstruction error relative to the largest change of the output
    since initialization, ``max |f(x_T) - f(x_0)|``, which the contributions split (NaN
    where the error is; inf where nothing changed but the error is not 0)."""
    if not len(result.prediction):
        return 0.0
    change = float(np.abs(result.prediction - result.initial).max())
    if change > 0 or math.isnan(result.error):
        return result.error / max(change, 1e-300)
    return 0.0 if result.error == 0 else math.inf


def _warn_thinned(result: Decomposition, checks: _Checks, verb: str) -> None:
    """Say what a thinned path's split approximates, how far its contributions' sum
    misses against the change it splits, and how far that error reaches: the closure
    measures the contributions' sum, not each contribution, so a small sum's miss does
    not silence it."""
    miss = thinned_miss(result)
    change = float(np.abs(result.prediction - result.initial).max()) \
        if len(result.prediction) else 0.0
    worse = (": more than the change itself, so they do not describe this training"
             if not miss <= 1 else "")
    frozen = ("their batches' gradients and the optimizer's preconditioner"
              if checks.preconditioned else "their batches' gradients")
    # Refitting every step removes the thinning's miss, not the formula's own.
    own = [f"the {checks.method} formula's own error" if checks.method != "exact" else "",
           "the expected weighting's own miss on minibatches"
           if checks.weighting == "expected" else ""]
    own = " and ".join(part for part in own if part)
    own = f"; it includes {own}, which record_every=1 does not remove" if own else ""
    target = ("the exact decomposition" if checks.method == "exact"
              and checks.weighting == "realized" else
              "the exact decomposition (method='exact', weighting='realized')")
    why = (checks.refusal or "").rstrip(".")
    warnings.warn(
        f"{verb}(method={checks.method!r}): the path was recorded every "
        f"{checks.record_every} optimizer steps, and the steps between two recorded "
        f"points cannot be replayed ({why}), so they are attributed with {frozen} at the "
        "interval's first point. The "
        f"contributions miss the prediction by {result.error:.3g} (Decomposition.error), "
        f"{miss:.2g} times the largest change of the output since initialization "
        f"({change:.3g}){worse}. Not round-off{own}. It measures only the sum of the "
        "contributions: a single training point's contribution (what explain and "
        "attribute rank) can miss by more, and the points' misses can add up to far "
        "more. Refit with record_every=1 (and a larger memory_budget if the path needs "
        f"it) for {target}.",
        UserWarning, stacklevel=caller_stacklevel(),
    )


def _warn_replay(result: Decomposition, checks: _Checks, verb: str) -> None:
    """Say that a thinned path's replayed steps miss its recorded points: the split then
    attributes a training that is not the recorded one, by an error the mismatch does
    not bound (the closure measures the contributions' sum)."""
    if checks.compression is not None:
        cause = (f"the path is stored with trajectory_compression={checks.compression!r}, "
                 "whose points are rounded steps of the training. Store the path without "
                 "compression")
    else:
        cause = ("the training step depended on something the record does not hold "
                 "(a loss, inputs or targets other than the declared ones, a gradient "
                 "changed between backward() and optimizer.step() otherwise than by a "
                 "recorded clip, randomness, a fused or foreach optimizer's rounding "
                 "in float32). Declare the loss and data the optimizer saw, or refit "
                 "with record_every=1")
    miss = thinned_miss(result)
    warnings.warn(
        f"{verb}(method={checks.method!r}): the path was recorded every "
        f"{checks.record_every} optimizer steps, and the steps between recorded points, "
        f"replayed from the record, miss the next recorded point by "
        f"{result.replay_error:.2g} relative to the interval's move "
        f"(Decomposition.replay_error; round-off is about "
        f"{'1e-15' if checks.dtype == torch.float64 else '1e-6'}): {cause}. The "
        f"contributions miss the prediction by {result.error:.3g} "
        f"(Decomposition.error), {miss:.2g} times the largest change of the output "
        "since initialization; that measures only their sum, a single point's "
        "contribution can miss by more.",
        UserWarning, stacklevel=caller_stacklevel(),
    )


def pool_sizes(traj: Trajectory) -> np.ndarray:
    """The number of points each step's pool holds (:meth:`Trajectory.pool`)."""
    pools, _ = traj._all_pools()
    calls = np.searchsorted(pools[:, 0], np.arange(traj.n_steps), side="right") - 1
    return (pools[:, 2] - pools[:, 1])[calls]


def _unequal_batch_weights(traj: Trajectory) -> bool:
    """Whether some step weighs its batch's entries other than the mean's ``1/|B|``
    where the path did not record the weights of its pools, which the expected
    weighting then cannot follow."""
    if traj._batch_weights is None or traj._pools is not None:
        return False
    return not np.allclose(traj._batch_weights, mean_batch_weights(traj._batch_offsets),
                           rtol=1e-12, atol=0)


def _missed_quadrature(result: Decomposition, checks: _Checks):
    """``(achieved, allowed)`` relative to the path's largest |f| where the steps' summed
    quadrature residuals exceed the tolerance, else None.

    A tol the caller chose may lie below what the dtype resolves: its steps are accepted
    at the round-off floor (``_Quadrature.floored``), which misses it. The default tol
    sits at that floor by design (:func:`default_tol`) and is not judged. Fixed
    ``n_nodes`` have no tolerance of their own: they are held to what an exact
    decomposition's round-off reaches (``INEXACT_FLOOR``).
    """
    if result.step_errors is None:
        return None
    if checks.n_nodes is not None:
        tol = INEXACT_FLOOR[checks.dtype]
    elif checks.floored:
        tol = checks.tol
    else:
        return None
    achieved = checks.relative(float(np.sum(result.step_errors)))
    return None if achieved <= tol else (achieved, tol)


def _missed_contribution(result: Decomposition, checks: _Checks) -> float | None:
    """The per-contribution error relative to the path's largest |f| where it exceeds
    what it is checked against (``contribution_tol``: ``tol``; ``FLOAT32_CHECK_TOL``
    with tol=None on a float32 path; with fixed ``n_nodes``, ``INEXACT_FLOOR``), else
    None (every exact decomposition measures it, :func:`_contribution_check`)."""
    if checks.measured is None:
        return None
    achieved = checks.relative(checks.measured)
    return None if achieved <= checks.contribution_tol else achieved


def _missed_roundoff(checks: _Checks) -> float | None:
    """The estimated round-off of one contribution relative to the path's largest |f|
    where a contribution misses what it is checked against because of it (it alone is
    over or NaN, or the two rules' difference alone meets it: more nodes would not bring
    the error under), else None. Called where a contribution misses."""
    if checks.roundoff is None or checks.roundoff == 0:
        return None
    achieved = checks.relative(checks.roundoff)
    if achieved <= checks.contribution_tol and _missed_difference(checks):
        return None
    return achieved


def _missed_difference(checks: _Checks) -> bool:
    """Whether the two rules' difference alone (the quadrature's part of a contribution's
    error) misses what a contribution is checked against, NaN included; False where no
    difference was measured apart from the round-off."""
    return (checks.difference is not None
            and not checks.relative(checks.difference) <= checks.contribution_tol)


def _held_to(checks: _Checks) -> str:
    """What a contribution is checked against, for a warning."""
    if checks.contribution_tol == checks.tol or checks.n_nodes is not None:
        return f"the {checks.contribution_tol:g} the decomposition is held to"
    return (f"the {checks.contribution_tol:g} that a float32 path's products can be "
            "checked to (their round-off floor; the default tol of the node choice, "
            f"{checks.tol:g}, is under it)")


def _warn_roundoff(result: Decomposition, checks: _Checks, achieved: float,
                   verb: str) -> None:
    # Relative errors only: contribution_error is in the caller's units, the path's
    # scale in the network's.
    total = checks.relative(checks.measured)
    part = (f"round-off alone is {achieved:.3g}, over it too"
            if not achieved <= checks.contribution_tol else
            f"round-off is {achieved:.3g} of it, beside the quadrature's "
            f"{checks.relative(checks.difference):.3g} (the two rules' difference, under it)")
    warnings.warn(
        f"{verb}(method='exact'): a single contribution's error is estimated at "
        f"{result.contribution_error:.3g} (Decomposition.contribution_error), {total:.3g} "
        "relative to the largest |f| along the path, over "
        f"{_held_to(checks)}: the {str(checks.dtype).removeprefix('torch.')} path's "
        f"{part}. The contributions are sums over the "
        "steps of shares computed from float32 gradients, each share carrying a few "
        "float32 roundings, which more quadrature nodes do not remove. Fit with "
        "dtype=\"float64\" (its round-off is 2e-9 of float32's) for contributions to "
        "this tolerance, or pass a larger tol.",
        PrecisionWarning, stacklevel=caller_stacklevel(),
    )


def _warn_contribution(result: Decomposition, checks: _Checks, achieved: float,
                       verb: str) -> None:
    if checks.n_nodes is not None:
        fix = "Pass n_nodes=None to choose the nodes of every step for tol."
    else:
        fix = (f"Walks with up to {CHECK_RAISES * RAISE} nodes per step more than the "
               "sums needed did not bring it under (round-off, or steps that need more); "
               "a smaller tol integrates every step further.")
    warnings.warn(
        f"{verb}(method='exact'): a single contribution's quadrature error is measured "
        f"at {result.contribution_error:.3g} (Decomposition.contribution_error"
        f"{_with_roundoff(checks)}), {achieved:.3g} relative to the largest |f| along "
        f"the path{_quadrature_part(checks)}, over {_held_to(checks)} (the contributions' "
        "sum misses by "
        f"{result.error:.3g}, Decomposition.error; where the training points' shares of "
        f"a step cancel, each can miss by more than their sum). {fix}",
        ConvergenceWarning, stacklevel=caller_stacklevel(),
    )


def _capped_note(checks: _Checks) -> str:
    """The failed steps' node counts that memory_budget limited, said (else "")."""
    if not checks.capped:
        return ""
    # Not "within MAX_NODES": the sentence before says that bound, the memory's was lower.
    steps = sorted(checks.capped)
    listed = ", ".join(str(t) for t in steps[:5]) + (
        f" and {len(steps) - 5} more" if len(steps) > 5 else "")
    return (f" memory_budget limited the nodes of steps {listed} to fewer than "
            f"{MAX_NODES} (Decomposition.n_nodes; each try holds its nodes' captures of a "
            "block of queries): a larger memory_budget allows more, or fewer queries per "
            "call.")


def _quadrature_part(checks: _Checks) -> str:
    """The quadrature's own part of a contribution's error (the two rules' difference)
    where a round-off estimate is part of it too, for a warning."""
    if not checks.roundoff or checks.difference is None:
        return ""
    return (f" (the two rules' difference alone, the quadrature's part: "
            f"{checks.relative(checks.difference):.3g})")


def _with_roundoff(checks: _Checks) -> str:
    """The round-off a float32 path's contribution_error includes (relative to the
    path's largest |f|: the error is in the caller's units), for a warning."""
    if not checks.roundoff:
        return ""
    return (f"; of it, an estimated {str(checks.dtype).removeprefix('torch.')} round-off "
            f"of {checks.relative(checks.roundoff):.3g} relative to the largest |f|, which "
            "dtype=\"float64\" removes")


def _warn_slow(result: Decomposition, checks: _Checks, verb: str) -> None:
    warnings.warn(
        f"{verb}(method='exact'): at {len(checks.slow)} of {checks.n_steps} steps the "
        "quadrature's residual by the Gauss-Legendre rule with a node more is above "
        "round-off and over twice that rule's difference from the step's own (steps "
        f"{_list_ratios(checks.slow)}). There the two rules' difference, "
        f"Decomposition.contribution_error ({result.contribution_error:.3g}), does not "
        "measure a single contribution's error, which may be larger by any amount: a "
        "kink of a non-smooth activation (relu) on a step's segment outside both rules' "
        "nodes is missed by both alike, and a step too large for a few nodes gains "
        "little from one more. A smooth activation or a smaller learning rate helps.",
        ConvergenceWarning, stacklevel=caller_stacklevel(),
    )


def _list_ratios(ratios: dict) -> str:
    """The first five steps with their ratio of residual to difference, for a warning."""
    steps = sorted(ratios)
    listed = ", ".join(f"{t} ({ratios[t]:.2g}x)" for t in steps[:5])
    return listed + (f" and {len(steps) - 5} more" if len(steps) > 5 else "")


def _list_steps(residuals: dict) -> str:
    """The first five steps with their residuals, and how many more, for a warning."""
    steps = sorted(residuals)
    listed = ", ".join(f"{t} (residual {residuals[t]:.1e})" for t in steps[:5])
    return listed + (f" and {len(steps) - 5} more" if len(steps) > 5 else "")


def _warn_missed(result: Decomposition, checks: _Checks, achieved: float,
                 allowed: float, verb: str) -> None:
    if checks.n_nodes is not None:
        why = (f"the fixed n_nodes={checks.n_nodes} Gauss-Legendre nodes per step do not "
               f"integrate the steps to within {allowed:g} of the largest |f|, the allowance of "
               "the exact decomposition's closure check")
        fix = "Pass n_nodes=None to choose the nodes of every step for tol."
    else:
        why = (f"tol={allowed:g} is below the round-off floor of the {checks.dtype} path "
               f"at {len(checks.floored)} of {checks.n_steps} steps, whose residuals stopped "
               f"there: steps {_list_steps(checks.floored)}")
        fix = ("Pass a tol the dtype resolves (tol=None: its round-off), or fit with "
               "dtype='float64'.")
    warnings.warn(
        f"{verb}(method='exact'): the quadrature's residuals add up to {achieved:.3g} "
        f"relative to the largest |f| along the path ({checks.scale:.3g}): {why}. The "
        f"achieved error is {result.error:.3g} (Decomposition.error; per step: "
        f"step_errors). {fix}",
        ConvergenceWarning, stacklevel=caller_stacklevel(),
    )


def _inexact(result: Decomposition, checks: _Checks) -> float | None:
    """The relative reconstruction error of an exact decomposition when it exceeds what
    the quadrature and the dtype allow, else None.

    Everything but the quadrature is linear algebra on the recorded path, so the
    reconstruction misses the prediction by at most the steps' measured residuals
    (``step_errors``) plus round-off. A larger miss means that the steps were not the
    ones the decomposition models (see :func:`_warn_inexact`).
    """
    if not len(result.prediction):
        return None
    size = max(checks.scale, float(np.abs(result.prediction).max()), 1e-300)
    allowed = (float(np.sum(result.step_errors))
               + max(checks.tol or 0.0, INEXACT_FLOOR[checks.dtype]) * size)
    if result.error <= allowed:
        return None
    return result.error / size


def _warn_inexact(result: Decomposition, relative: float, verb: str) -> None:
    change = float(np.abs(result.prediction - result.initial).max())
    warnings.warn(
        f"{verb}(method='exact'): the reconstruction misses the prediction by "
        f"{result.error:.3g} ({relative:.2g} relative to the largest |f| along the path, "
        f"{result.error / max(change, 1e-300):.2g} times the largest change of the output "
        f"since initialization; Decomposition.error), far above the quadrature's "
        f"measured error and the dtype's round-off. The recorded steps are not the ones "
        "the decomposition models: likely causes are batches that were not declared or "
        "only partly declared (set_batch with one process's shard of a distributed "
        "batch, a wrong index), a loss, inputs or targets other than the ones the "
        "optimizer saw, or a change of the gradients between backward() and "
        "optimizer.step() that the record does not hold (clipping, noise, gradient "
        "surgery), or a forward pass under torch.autocast, whose half-precision round-off "
        "the steps recomputed in the parameters' dtype do not make. The contributions do "
        "not add up to the prediction (attribute and "
        "explain read this decomposition).",
        UserWarning, stacklevel=caller_stacklevel(),
    )


def _run(module, traj, X_train, Y_train, loss, X, *, method, weighting, route, quadrature,
         memory_budget, exclude, outputs, row, width, largest, dense, itemsize, P, N, ref,
         n_nodes, chunk, weights, intervals, node):
    # n_res: the queries' outputs (one when contracted with weights), n_out the batch's.
    n_q, n_out = X.shape[0], len(outputs)
    n_res = n_out if weights is None else 1
    adaptive = _adaptive(method, n_nodes)
    # A float32 path's exact method measures its batches' residuals' round-off against a
    # float64 forward pass over them (_Context._residuals64, rounding), beside what the
    # plan charges the batch: a float64 copy of the step's point and, per batch row, the
    # pass's float64 inputs, activations and derivatives (twice a sample's factors in
    # float64: 1,280 bytes measured where they are 528 in float32). Uncharged, it put
    # torch's peak at 1.025x a 1.56 MB budget on a float32 SGD path (P = 18,817) and
    # 1.038x a 2.17 MB one on Adam: such budgets are now refused up front.
    residuals64 = (method == "exact" and itemsize != 8
                   and _residuals_in_float64(ref, traj, loss, X_train, Y_train))
    wide = (8 * P, 2 * (8 // itemsize) * node[0]) if residuals64 else (0, 0)
    # What the call holds beside the plan's terms for all of it: a float32 path's
    # training data and queries in its dtype (the call's conversion of the float64
    # inputs: charged where they may be views of the caller's too), the queries' initial
    # and final outputs (float64), and the exact method's float64 copies of the module,
    # the queries and the point (_Reference). Uncharged, with the training data the
    # estimators converted twice, torch's peak on a float32 32-32-2 MLP (P = 1,122, 200
    # samples, 10 queries) was 1.53x a 120 kB budget the plan accepted (1.33x 200 kB
    # on Adam): such budgets are now refused, naming the least (it grows with the
    # queries: they are the call's input and work).
    held = ((X_train.nbytes + Y_train.nbytes + X.nbytes) * (itemsize != 8)
            + 16 * n_q * n_res
            + ((16 * P + ref.X.nbytes) if ref is not None and ref.upcast else 0))
    # The exact method chooses its nodes from a query's outputs (float64, all of them)
    # at every recorded point, kept for the whole block (decompose's ``paths``: for the
    # whole call where the check walks again, see below).
    f_bytes = 8 * n_out * len(traj) if method == "exact" else 0
    if route == "dense":
        # lambda (float64), rho and the node buffer (Q x n_res x P each) and a Jacobian's
        # formation per query block, and a batch's per-sample loss gradients (B x P,
        # formed from one seeded capture: a row's factors). Both are held through the
        # walk: half the budget each. The second order's Hessian-vector products take the
        # node buffer's and the formation's room (a quarter), in blocks of queries.
        q_bytes = 2 * ((8 + 3 * itemsize) * n_res * P + f_bytes)
        # Checked first: a query's products need more than its buffers (n_out >= n_res,
        # no f_bytes), so the first refusal names the budget that passes both; checked
        # after them, a budget raised to what the buffers asked was refused again.
        hvp_block = (rows_per_block(memory_budget, 4 * HVP_FORMS * n_out * P * itemsize,
                                    "The second-order term's Hessian-vector products")
                     if method == "second_order" else 0)
        q_block = rows_per_block(memory_budget, q_bytes, "The decomposition's adjoint buffers")
        chunk = min(chunk, _pow2_floor(q_block)) if adaptive else q_block
        b_bytes = 2 * (2 * P * itemsize + row)
        q_used = 0  # the two sides in half of the budget each
    else:
        # The adjoint (Q x C x P; none for plain SGD's Gram of factors), a query's float64
        # contributions (N x C) and its captures (a few nodes' worth: the factors are
        # small next to the adjoint; those made ahead for later steps are held within
        # an eighth of the budget, :class:`_NodesAhead`).
        # The exact method holds the check's rows beside them (_factored_block): the
        # adjoint, the contributions and the captures twice.
        copies = 2 if method == "exact" else 1
        # A float32 path's exact method sums the shares' round-off too (N x C float64).
        sizes = method == "exact" and itemsize != 8
        q_bytes = (copies * (n_res * P * itemsize * (route == "adjoint") + 8 * n_res * N
                           + 4 * row) + 8 * n_res * N * sizes)
        # The queries' f at every point is kept for every block, not one (decompose's
        # ``paths``, read again by the check's walk): charged per block, the blocks
        # walked before held it beside the plan (8 B a query, output and point: 4 kB on
        # the 32-32-2 MLP above with 30 queries in blocks of a few).
        held += n_q * f_bytes
        # And, not per query, a step's vectors over the parameters (STEP_VECTORS) and
        # the exact method's node points for its captures (up to NODE_POINTS of them
        # with their stack, as the budget allows; more nodes are captured in groups):
        # unaccounted before (2.4x a 100 kB budget on a small Adam path). With the
        # float64 point of the residuals' pass where it runs (``wide``, above).
        one = 2 * P * itemsize if method == "exact" else 0
        fixed = held + ((STEP_VECTORS * 8 * P + wide[0]) if method == "exact" else 0)
        given = chunk
        if route == "adjoint":
            # And the copies a step's pass over the adjoint makes beside it (of a chunk
            # of rows, or of all of them: not per query; measured, 1.5x the buffer on a
            # float32 Adam path, unaccounted before: 1.7x the budget at 4 MiB).
            spec = traj.solver_spec
            memory = traj.step_coefficients(direct=True)[1]
            # (SGD's preconditioner is None but for parameter groups' step sizes.)
            update = bool(memory) and (spec.name != "sgd" or traj._group_lrs is not None)
            decay = bool(spec.weight_decay) and spec.name != "adamw"
            coarse = method == "exact" and itemsize == 4

            def scratch(q_rows):
                return Adjoint.scratch_bytes(copies * q_rows * n_res, largest, dense, itemsize,
                                             cpu=X.device.type == "cpu", update=update,
                                             decay=decay)
        else:
            coarse = False

            def scratch(q_rows):
                return 0

        def sides(q_block):
            """The chunk, the block's queries (a multiple of it: see below) and a batch
            row's bytes of a query block of at most ``q_block`` rows."""
            # The queries of one node choice (a power of two: the blocks of a larger call
            # are cut at multiples of its chunk), or a whole block.
            chunk = min(given, _pow2_floor(q_block)) if adaptive else q_block
            # A batch row: its capture and its column of the pair products of a query
            # block ((Q C) x widest layer output, float64; only where the block has fewer
            # rows than the layer inputs), or its formed gradient of the largest
            # parameter (float64, _pairs.formed_contraction); and its column of the
            # block's float64 products with the adjoint and shares (up to three (Q C) x B
            # buffers: one adjoint for the whole block, not per chunk).
            b_bytes = (row + max(min(chunk, n_q) * n_res * width * itemsize, 8 * largest)
                       + 24 * copies * min(q_block, n_q) * n_res + wide[1])
            if coarse:
                # The check's rows contracted in float32 (Adjoint's coarse): the batch's
                # float32 formed gradients, and a chunk of rows' float32 products (at
                # most all rows, each up to the widest layer output).
                b_bytes += 4 * (largest + copies * min(q_block, n_q) * n_res * width)
            return chunk, max(chunk, q_block - q_block % chunk), b_bytes

        n_batch = (int(pool_sizes(traj).max(initial=0)) if weighting == "expected"
                   else int(np.diff(traj._batch_offsets).max(initial=0)))

        def fits(q_block):
            """Whether a query block of ``q_block`` rows leaves a batch row room, and
            takes at most half of the budget unless the whole batch fits beside it."""
            _, q_rows, b_bytes = sides(q_block)
            q_used = min(q_rows, n_q) * q_bytes + scratch(min(q_rows, n_q))
            return (q_used + b_bytes <= room and q_used
                    <= max(room // 2, room - n_batch * b_bytes))

        # Both sides share the budget: a query block sized from all of it left nothing
        # for the batch's rows, sized from all of it too (measured: 1.3x the budget). One
        # query and one batch row must fit: the least budget, refused below.
        least = q_bytes + scratch(1) + sides(1)[2]
        rows_per_block(memory_budget, least + fixed + one,
                       "The decomposition's adjoint buffers and per-sample loss gradients",
                       unit=f"one query and one batch row beside what the call holds for "
                            f"its {n_q:,} {'query' if n_q == 1 else 'queries'}")
        node_points = max(1, min(NODE_POINTS, (memory_budget - least - fixed) // max(one, 1)))
        points = fixed + node_points * one
        room = memory_budget - points
        q_block = rows_per_block(room, q_bytes, "The decomposition's adjoint buffers")
        if not fits(q_block):  # the largest block that does (fits is monotone)
            lo, hi = 1, q_block
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (mid, hi) if fits(mid) else (lo, mid)
            q_block = lo
        chunk, q_rows, b_bytes = sides(q_block)
        q_rows = min(q_rows, n_q)
        q_used = q_rows * q_bytes + scratch(q_rows) + points
    b_block = rows_per_block(memory_budget - q_used, b_bytes,
                             "The decomposition's per-sample loss gradients")
    # The captures made ahead and kept for later query blocks take what the two sides
    # leave (at most an eighth and a quarter of the budget, as before).
    if route != "dense":
        left = memory_budget - q_used - min(b_block, n_batch) * b_bytes
    ctx = _Context(module, traj, X_train, Y_train, loss, weighting=weighting,
                   budget=memory_budget, exclude=exclude, outputs=outputs, b_block=b_block,
                   ref=ref, weights=weights, intervals=intervals, row_bytes=row,
                   point_bytes=P * itemsize, left=None if route == "dense" else left,
                   node_points=NODE_POINTS if route == "dense" else node_points)
    ctx.hvp_block = hvp_block if route == "dense" else 0
    ctx.measure_roundoff(method == "exact" and itemsize != 8, residuals64, wide)
    # The second order's route, once for the call (not at every step): None, all outputs
    # in one pass; else the outputs, one at a time, after the double-backward check.
    ctx.hvp_outputs = (None if method != "second_order" or _all_outputs_in_one_pass(module, traj)
                       else _checked_outputs(module, traj, traj.parameters(0).to(X.device), X))
    contributions = np.zeros((n_q, N, n_res))
    regularization = np.zeros((n_q, n_res))
    # The exact method's check: the difference of the rule with a node more, and on a
    # float32 path the sums of the absolute shares (the scale of their round-off).
    # The dense route takes no rule with a node more in its walk (None: the check walks
    # again), only the sums.
    pair = ((None if route == "dense" else np.zeros((n_q, N, n_res)),
             None if route == "dense" else np.zeros((n_q, n_res)),
             None if traj.dtype == torch.float64 else np.zeros((n_q, N, n_res)))
            if method == "exact" else None)
    # An adaptive node choice per chunk of queries (the same chunks in a block of them on
    # a worker); a block of the memory budget walks the steps once for its chunks, and
    # the blocks read the same batch captures, kept while memory allows.
    q_block = max(chunk, q_block - q_block % chunk)
    ctx.keep_batches = n_q > q_block
    if route != "dense" and adaptive:
        # The queries' captures at a step's nodes were charged a few nodes' worth
        # (copies * 4 rows per query), but an adaptive step holds all of a try's nodes
        # (and the check's rule with a node more): up to 2 * MAX_NODES + 1 captures of
        # each query (a narrow ResNet's 24 nodes: 2.9x memory_budget). They take the
        # room the plan leaves beside everything else it holds (the batch captures
        # made ahead and kept, where they are), and the node counts a chunk tries stay
        # within it (:func:`_node_limit`).
        captures = (memory_budget - q_used + q_rows * copies * 4 * row
                    - min(b_block, n_batch) * b_bytes
                    - (ctx.ahead_bytes if ctx.stacked is not None else 0)
                    - (ctx.kept_bytes if ctx.keep_batches else 0))
        per_query = captures / max(q_rows, 1)
    for q0 in range(0, n_q, q_block):
        rows = slice(q0, min(n_q, q0 + q_block))
        chunks = [slice(c0, min(rows.stop, c0 + chunk)) for c0 in range(q0, rows.stop, chunk)]
        chunks = list(zip(chunks, quadrature(rows, chunks)))
        if route != "dense" and adaptive:
            for c_rows, quad in chunks:
                quad.limit = _node_limit(per_query * (c_rows.stop - c_rows.start),
                                         c_rows.stop - c_rows.start, *node, row, itemsize,
                                         pair=method == "exact")
        if route == "dense":
            parts = [_dense_block(ctx, X[c_rows], c_rows, quad, method=method)
                     for c_rows, quad in chunks]
            c, r = (torch.cat([p[i] for p in parts]) for i in (0, 1))
            if pair is not None and pair[2] is not None:
                pair[2][rows] = torch.cat([p[2] for p in parts]).cpu().numpy()
        else:
            c, r, size = _factored_block(ctx, X[rows], rows, chunks, method=method,
                                         route=route)
            if pair is not None:
                n = rows.stop - rows.start
                pair[0][rows], pair[1][rows] = c[n:].cpu().numpy(), r[n:].cpu().numpy()
                if size is not None:
                    pair[2][rows] = size.cpu().numpy()
                c, r = c[:n], r[:n]
        contributions[q0 : q0 + q_block] = c.cpu().numpy()
        regularization[q0 : q0 + q_block] = r.cpu().numpy()
    return contributions, regularization, pair


def _node_limit(room: float, rows: int, node: int, term: int, row: int, itemsize: int, *,
                pair: bool) -> int:
    """The most Gauss-Legendre nodes (at least 1, at most ``MAX_NODES``) whose
    captures of ``rows`` queries fit ``room`` bytes: a try at ``n`` holds ``n`` captures
    of ``node`` bytes per query (``2 n + 1`` with ``pair``, the rule with a node more),
    one capture in flight with its graph (``row``), and the float64 stack of the
    largest term's (``term`` bytes) nodes and its product with the step
    (:func:`_pairs.directional`, about twice the stack)."""
    # rows * (n * slope + held) <= room
    slope = (2 if pair else 1) * node + 2 * 8 / itemsize * term
    held = (node if pair else 0) + row
    fits = (room / max(rows, 1) - held) / max(slope, 1)
    return int(min(MAX_NODES, max(1, math.floor(fits)))) if math.isfinite(fits) else MAX_NODES


def _result(initial, prediction, contributions, regularization, method, weighting):
    result = Decomposition(
        initial=initial.cpu().numpy(),
        contributions=contributions,
        regularization=regularization,
        prediction=prediction.cpu().numpy(),
        error=0.0,
        method=method,
        weighting=weighting,
    )
    if len(result.prediction):
        result.error = float(np.max(np.abs(result.reconstruction - result.prediction)))
    return result
