"""What the structured Gram executes, by phase (issue 31's roofline on the image rows).

For each network of :mod:`benchmarks._nets` named on the command line, ``tangent_gram``
(the engine under ``TangentKernel(net)(X)``, trace over the outputs, float32, one torch
thread) is run with the engine's phases wrapped:

- *prepare*: ``_gram._prepare`` (the probe capture, the routes);
- *forward*: the captures' forward passes (``functional_call`` inside ``capture``);
- *backward*: the backward passes to the rule layers' sites (``_backprops``, one per
  output);
- *forming (in capture)*: per-sample gradients a layer hands on formed
  (``_layers.formed_terms``: a convolution's weight by oneDNN's grouped backward);
- *capture (other)*: the rest of the captures (factors such as a convolution's patches,
  the use-watch, bias sums);
- *forming*: ``_gram._formed`` (per-sample gradient blocks from the factors, one GEMM per
  sample, written into the block);
- *products*: ``_gram._syrk_block`` / ``_symmetric_panels`` (the Gram's SYRKs and GEMMs;
  ``_add_upper``, the rank-one and position-pair terms, inside it);
- *other*: the call's remainder.

CPU time (``time.process_time``) per phase is taken on calls without the FLOP counter, the
median over ``--rounds`` calls; FLOPs per phase on one more call under
``torch.utils.flop_counter.FlopCounterMode`` with what it cannot see added by hand
(:mod:`benchmarks._flops`: SciPy's SYRK, CPU attention, grouped convolutions' weight
gradients). Element-wise work counts no FLOPs (as in a roofline of GEMMs). The GEMM probe
of the benchmark's roofline (:func:`benchmarks._worker._gemm_probe`, N x width x N) is
timed before each call for the rate.

*Necessary* FLOPs, a cost model of the least the trace needs by this contraction: one
forward pass of the N samples (counted on ``module(X)``), the C backward passes to the
rule layers' sites (one vector-Jacobian product per output and sample: the executed
backward FLOPs, which are the data gradients alone), forming the gradient blocks where the
engine's route takes them (``2 N S C numel``, cheaper than the position pairs' ``N^2 S^2
(q + C p)`` there: :func:`skpathkernel._tangent._contract.gram_route`), and the products
of the upper triangle (the symmetric Gram's); both from
:func:`benchmarks._worker._structured_roofline`'s "performed".

Run: ``taskset -c 1 env OMP_NUM_THREADS=1 PYTHONPATH=. python -m benchmarks.profile_gram_phases
cifar resnet vit``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch

from benchmarks import _nets
from benchmarks._flops import counting, executed_flops
from benchmarks._worker import _gemm_probe, _structured_roofline
from skpathkernel._tangent import _capture, _cnn, _gram
from skpathkernel._tangent._gram import tangent_gram

PHASES = ["prepare", "forward", "backward", "forming (in capture)", "capture (other)",
          "forming", "products", "other"]


class _Phases:
    """A stack of phases: time and FLOPs go to the innermost one (prepare keeps all of
    its own, whatever it calls)."""

    def __init__(self):
        self.time = defaultdict(float)
        self.flops = defaultdict(float)
        self.stack = []
        self.counter = None  # the FlopCounterMode of a counting call

    def _flops_now(self):
        return self.counter.get_total_flops() if self.counter is not None else 0

    def wrap(self, name, fn):
        def wrapped(*args, **kwargs):
            if self.stack and self.stack[-1][0] == "prepare":
                return fn(*args, **kwargs)
            self.stack.append([name, time.process_time(), self._flops_now(), 0.0, 0.0])
            try:
                return fn(*args, **kwargs)
            finally:
                _, t0, f0, child_t, child_f = self.stack.pop()
                dt, df = time.process_time() - t0, self._flops_now() - f0
                self.time[name] += dt - child_t
                self.flops[name] += df - child_f
                if self.stack:
                    self.stack[-1][3] += dt
                    self.stack[-1][4] += df

        return wrapped

    def add_flops(self, flops):
        """FLOPs the counter cannot see, to the current phase."""
        self.flops[self.stack[-1][0] if self.stack else "other"] += flops


def _install(ph: _Phases):
    """Wrap the engine's phases (the module globals the engine calls through)."""
    _gram._prepare = ph.wrap("prepare", _gram._prepare)
    _capture.functional_call = ph.wrap("forward", _capture.functional_call)
    _capture._backprops = ph.wrap("backward", _capture._backprops)
    # A plain CNN's captures (:mod:`skpathkernel._tangent._cnn`): its hand-made passes.
    _cnn._forward = ph.wrap("forward", _cnn._forward)
    _cnn._backward = ph.wrap("backward", _cnn._backward)
    _capture.formed_terms = ph.wrap("forming (in capture)", _capture.formed_terms)
    # A convolution with the eval BatchNorm folded into it (s49): its weight's gradients
    # formed in the capture, with BatchNorm's sums.
    _capture._folded_terms = ph.wrap("forming (in capture)", _capture._folded_terms)
    _gram._Blocks._capture = ph.wrap("capture (other)", _gram._Blocks._capture)
    _gram._formed = ph.wrap("forming", _gram._formed)
    _gram._syrk_block = ph.wrap("products", _gram._syrk_block)
    _gram._symmetric_panels = ph.wrap("products", _gram._symmetric_panels)
    _gram._gram_into = ph.wrap("products", _gram._gram_into)


def profile(arch, n, rounds):
    torch.manual_seed(0)
    module = _nets.build(arch)
    params = {k: v.detach() for k, v in module.named_parameters()}
    X = _nets.inputs(arch, n)
    bound = _structured_roofline(module, params, X, "trace")
    probe, probe_flops = _gemm_probe(n, bound["probe_width"], X)
    ph = _Phases()
    _install(ph)
    call = ph.wrap("other", lambda: tangent_gram(module, params, X, output="trace"))
    call()  # warm-up (first-touch of the buffers, the routes' caches)
    times, probes, per_phase = [], [], defaultdict(list)
    for _ in range(rounds):
        t0 = time.process_time()
        probe()
        probes.append(time.process_time() - t0)
        ph.time.clear()
        t0 = time.process_time()
        call()
        times.append(time.process_time() - t0)
        for k in PHASES:
            per_phase[k].append(ph.time[k])
    t0 = time.process_time()
    probe()
    probes.append(time.process_time() - t0)
    ph.flops.clear()
    with counting(ph.add_flops) as counter:
        ph.counter = counter
        call()
    ph.counter = None
    rate = probe_flops / statistics.median(probes)
    # nn.TransformerEncoderLayer's fast path (one fused op, which the counter cannot see)
    # is off for a forward with gradients, as in the engine's captures.
    fastpath = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with torch.no_grad():
            _, forward = executed_flops(lambda: module(X))
    finally:
        torch.backends.mha.set_fastpath_enabled(fastpath)
    necessary = forward + ph.flops["backward"] + bound["performed_flops"]
    return dict(arch=arch, n=n, P=sum(p.numel() for p in params.values()),
                time=statistics.median(times), rate=rate, bound=bound, necessary=necessary,
                forward=forward,
                phase_time={k: statistics.median(v) for k, v in per_phase.items()},
                phase_flops=dict(ph.flops))


def table(r):
    lines = [f"### {r['arch']}, N = {r['n']}, P = {r['P']}", "",
             f"Call (median CPU time): {r['time']:.3f} s; GEMM probe rate "
             f"{r['rate'] / 1e9:.1f} GFLOP/s; full products {r['bound']['flops'] / 1e9:.1f} GFLOP "
             f"(roofline ratio {r['bound']['flops'] / r['rate'] / r['time']:.2f}), performed "
             f"{r['bound']['performed_flops'] / 1e9:.1f} GFLOP.", "",
             "| phase | CPU time | share | GFLOP executed | rate | rate / probe |",
             "|---|---|---|---|---|---|"]
    total_f = 0.0
    for k in PHASES:
        t, f = r["phase_time"][k], r["phase_flops"].get(k, 0.0)
        total_f += f
        rate = f / t if t > 0 and f > 0 else 0.0
        cells = f"{rate / 1e9:.1f} GFLOP/s | {rate / r['rate']:.2f} |" if rate else "- | - |"
        lines.append(f"| {k} | {t:.3f} s | {t / r['time']:.0%} | {f / 1e9:.1f} | " + cells)
    lines.append(f"| total | {r['time']:.3f} s | 100% | {total_f / 1e9:.1f} | "
                 f"{total_f / r['time'] / 1e9:.1f} GFLOP/s | "
                 f"{total_f / r['time'] / r['rate']:.2f} |")
    full = r["bound"]["flops"]
    lines += ["", f"One forward pass: {r['forward'] / 1e9:.1f} GFLOP (executed: "
              f"{r['phase_flops'].get('forward', 0) / r['forward']:.2f} passes). Necessary "
              f"(forward + backward + performed): {r['necessary'] / 1e9:.1f} GFLOP; executed / "
              f"necessary {total_f / r['necessary']:.2f}. Executed-work efficiency (executed "
              f"FLOPs / (time x probe rate)): {total_f / r['time'] / r['rate']:.2f}. The "
              f"roofline ratio if every necessary FLOP ran at the probe's rate (full products "
              f"/ necessary): {full / r['necessary']:.2f}; the time to 0.8 of the roofline: "
              f"{full / r['rate'] / 0.8:.2f} s."]
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("nets", nargs="+")
    parser.add_argument("--n", type=int, default=1024)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    for arch in args.nets:
        print(table(profile(arch, args.n, args.rounds)), "\n", flush=True)


if __name__ == "__main__":
    main()
