"""The benchmark's ResNet and ViT rows and its process pinning.

The networks of ``benchmarks/_nets.py`` are what the Gram and path rows time: their
tangent kernel (trace over the outputs, divided by C) is checked against dense
per-sample Jacobians, in float64. The peers' own agreement (neural-tangents' stax
network, nngeometry) is checked inside every benchmark run, in the peers venv.
"""

import argparse
import os
import sys
import warnings

import numpy as np
import pytest
import torch
from _reference import jacobian_loop

from benchmarks import _nets
from benchmarks.__main__ import _failure_cell, _fastest_peer, _nets_arg, _plan, pinned_cores
from benchmarks._serve import Server
from skpathkernel._tangent import _gram, layer_routes, tangent_gram


def _check_trace(K, module, X):
    """K against the trace kernel of the dense per-sample Jacobians (float64)."""
    J = jacobian_loop(module, X)
    ref = torch.einsum("ncp,mcp->nm", J, J) / J.shape[1]
    np.testing.assert_allclose(K.numpy(), ref.numpy(), rtol=1e-10, atol=1e-10 * ref.abs().max())


def _double_problem(arch, n):
    """The network in float64 at seed 0, n inputs and its parameters."""
    torch.manual_seed(0)
    module = _nets.build(arch).double()
    X = _nets.inputs(arch, n, torch.float64)
    return module, X, {k: v.detach() for k, v in module.named_parameters()}


@pytest.mark.parametrize("arch", ["resnet", "vit"])
def test_new_rows_gram_matches_dense_jacobians(arch):
    module, X, params = _double_problem(arch, 5)
    # Both run on rules only (the ViT's class token and position embedding too): a
    # fallback would warn, and the rows would time another route than they name.
    assert {r.route for r in layer_routes(module, X, params=params)} == {"rule"}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        K = tangent_gram(module, params, X)
    _check_trace(K, module, X)


def test_vit_trace_in_output_groups_matches_dense_jacobians(monkeypatch):
    # The ViT row at N = 1024: its ten outputs' gradient blocks (3 GB) exceed the default
    # budget, and the trace is summed over groups of outputs. The same here at N = 40
    # with the smallest budget (in steps of 5%) that splits them.
    module, X, params = _double_problem("vit", 40)
    probe = _gram._prepare(module, params, X, "trace", 2**30)[3]
    budget = 2**24
    while len(_gram._output_groups(probe, 40, 40, "trace", None, True, budget, 8)) == 1:
        budget = int(budget * 1.05)
        assert budget < 2**31
    groups = []
    real = _gram._output_groups
    monkeypatch.setattr(_gram, "_output_groups", lambda *a: groups.append(real(*a)) or groups[-1])
    K = tangent_gram(module, params, X, memory_budget=budget)
    assert len(groups[0]) > 1 and sum(groups[0], []) == list(range(10))
    _check_trace(K, module, X)


def test_vit_row_shares_one_forward_pass_for_its_output_groups():
    # The ViT row (N = 1024, float32, default budget) is planned with one forward pass
    # per chunk kept for its ten one-output groups (_kept_forward_groups): the graphs of
    # its rows (632 KB per row) fit beside one output's blocks. The probe's estimate,
    # counted on copied sites, read 13% more once s47 counted the tensors alive after
    # the forward: the row fell back to four groups with a forward pass each, 1.23x the
    # CPU time, and no test saw it (benchmarks/results/vit_cuts_ab-s48.md). The plan
    # alone, on the probe's two rows: no Gram is computed.
    torch.manual_seed(0)
    module = _nets.build("vit")
    X = _nets.inputs("vit", 1024)
    params = {k: v.detach() for k, v in module.named_parameters()}
    budget = _gram.DEFAULT_MEMORY_BUDGET
    probe = _gram._prepare(module, params, X, "trace", budget)[3]
    kept = _gram._kept_forward_groups(probe, len(X), "trace", None, budget, X.element_size())
    assert kept == [[c] for c in range(10)]


def test_part_of_the_networks_at_one_n():
    plan = _plan(True, "cpu", archs=("vit",), net_n=512)["gram_nets"]
    assert {(s["arch"], s["n"]) for group in plan for s in group} == {("vit", 512)}
    # The CNNs' one-output rows (nngeometry's) come only with their networks.
    assert {s.get("output", "trace") for group in plan for s in group} == {"trace"}
    assert len(_plan(True, "cpu", archs=("cnn8",))["gram_nets"]) == 2
    with pytest.raises(argparse.ArgumentTypeError, match="unknown network"):
        _nets_arg("vit,mlp")


def test_resnet_batchnorm_uses_running_statistics():
    torch.manual_seed(0)
    module = _nets.build("resnet")
    assert not module.training
    X = _nets.inputs("resnet", 3)
    # Eval mode: each sample's output does not depend on the others in its batch.
    together = module(X)
    alone = torch.cat([module(x[None]) for x in X])
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no CPU affinity here")
def test_case_processes_are_pinned_to_the_chosen_cores():
    own = sorted(os.sched_getaffinity(0))
    cores = pinned_cores(1)
    assert cores == own[:1]
    assert pinned_cores(None) is None
    report = ("import json, os; print(json.dumps({'ready': True, "
              "'cores': sorted(os.sched_getaffinity(0))}))")
    server = Server([sys.executable, "-c", report], cwd=os.getcwd(), cores=cores)
    try:
        assert server.info["cores"] == cores
    finally:
        server.kill()
    free = Server([sys.executable, "-c", report], cwd=os.getcwd())
    try:
        assert free.info["cores"] == own
    finally:
        free.kill()


def test_a_killed_case_reports_its_exit_status_on_one_line():
    # A peer killed for memory dies without a word on stdout and a chatty stderr.
    script = ("import os, signal, sys; sys.stderr.write('log line one\\nlog line two\\n'); "
              "sys.stderr.flush(); os.kill(os.getpid(), signal.SIGKILL)")
    with pytest.raises(RuntimeError) as err:
        Server([sys.executable, "-c", script], cwd=os.getcwd())
    message = str(err.value)
    assert "log line two" in message
    assert message.endswith("exit status -9")
    cell = _failure_cell(err.value)
    assert "\n" not in cell and cell.endswith("exit status -9")


def test_fastest_peer_ignores_our_rows_and_the_baseline():
    def row(method, times, **spec):
        return {"spec": {"method": method, **spec}, "times": times}

    group = [row("skpathkernel", [2.0, 2.0, 4.0]), row("skpathkernel_engine", [0.5]),
             row("skpathkernel", [0.1], baseline="/tree"), row("vmap_grad", [9.0, 7.0]),
             row("nngeometry", [3.0, 5.0]), {"spec": {"method": "neural_tangents"},
                                             "skipped": "no venv"}]
    # Medians: ours 2.0; torch.func 8.0, nngeometry 4.0: the fastest peer is nngeometry.
    assert _fastest_peer(group) == ("nngeometry", 2.0)
    assert _fastest_peer(group[:3]) is None


def _kink_problem():
    """A small ReLU / max-pool network in float32 and its K by per-sample autograd."""
    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Conv2d(1, 2, 3, padding=1), torch.nn.ReLU(),
                                 torch.nn.MaxPool2d(2), torch.nn.Flatten(),
                                 torch.nn.Linear(8, 1))
    X = torch.randn(6, 1, 4, 4)
    params = {k: v.detach() for k, v in module.named_parameters()}

    def loop_K(m, x):
        J = jacobian_loop(m, x)[:, 0]
        return (J @ J.T).double().numpy()

    return module, params, X, loop_K


def test_k_check_explains_a_kink_by_float64_only():
    from benchmarks._peers_worker import _checked

    module, params, X, loop_K = _kink_problem()
    ref = loop_K(module, X)
    assert _checked("peer", ref, module, params, X)["rel_diff_vs_skpathkernel"] <= 1e-5
    # A peer whose float32 forward put sample 2 on a kink's other side: its row and
    # column differ by far more than rounding.
    K = ref.copy()
    K[2] += 1e-3 * np.abs(ref).max()
    K[:, 2] = K[2]
    with pytest.raises(RuntimeError, match="is not skpathkernel's"):
        _checked("peer", K, module, params, X)
    # Its float64 K (here the autograd loop's) is the same function's: the row stands,
    # naming the sample.
    seen = []

    def recheck(module64, x64):
        seen.append(x64)
        return loop_K(module64, x64)

    info = _checked("peer", K, module, params, X, recheck=recheck)
    assert seen[0].dtype == torch.float64 and len(seen[0]) == len(X)
    assert info["rel_diff_vs_skpathkernel"] > 1e-4
    assert info["float64_recheck"]["samples"] == [2]
    assert info["float64_recheck"]["rel_diff"] <= 1e-10
    # A float64 K that still differs is another function: the row fails.
    with pytest.raises(RuntimeError, match="in float64"):
        _checked("peer", K, module, params, X,
                 recheck=lambda m, x: 1.001 * loop_K(m, x))


def test_timed_calls_report_cpu_time_and_its_speedups():
    from benchmarks.__main__ import _group_rows, _peers_goal

    busy = ("from benchmarks._serve import serve; "
            "serve(lambda: sum(i * i for i in range(300000)), {}, lambda last: {})")
    server = Server([sys.executable, "-c", busy], cwd=os.getcwd())
    try:
        reply = server.ask("time")
        assert reply["cpu"] > 0 and reply["t"] > 0
    finally:
        server.kill()

    def row(method, times, cpu):
        return {"spec": {"method": method, "arch": "cnn8", "n": 8}, "times": times,
                "cpu_times": cpu, "peak_bytes": 0}

    # Medians: ours 2.0 s wall, 1.0 s CPU; torch.func 8.0 s wall, 3.0 s CPU.
    group = [row("skpathkernel", [2.0, 3.0, 1.0], [1.0, 1.5, 0.5]),
             row("vmap_grad", [8.0, 8.0], [2.0, 4.0])]
    lines = _group_rows(group)
    assert "; CPU 1 s |" in lines[0] and "| 4.00x (CPU 3.00x) |" in lines[1]
    assert _peers_goal(group, 1.5) == (">= 1.5x the fastest peer (vmap_grad): 4.00x "
                                       "(CPU 3.00x), met")


def test_one_output_rows_have_the_roofline_of_one_output():
    from benchmarks._worker import _structured_roofline

    # Every Gram row of the networks carries a roofline, the one-output rows too.
    plan = _plan(True, "cpu", archs=("cnn8",))["gram_nets"]
    assert {g[0].get("output", "trace") for g in plan} == {"trace", 0}
    assert all(g[0]["roofline"] for g in plan)
    torch.manual_seed(0)
    module = _nets.build("cnn8")
    # At n = 64 the engine forms every convolution's gradient blocks (position pairs
    # are cheaper only on a few samples).
    n = 64
    X = _nets.inputs("cnn8", n)
    params = {k: v.detach() for k, v in module.named_parameters()}
    # The full products written out for conv32-conv64-Linear10 on 8 x 8: both
    # convolutions' weights and biases as gradient blocks (2 n^2 C numel), the head
    # rank-one with its bias (2 n^2 (q + C p) + 3 n^2, q = 64 * 8 * 8, p = 10).
    convs = 32 * 9 + 32 + 64 * 32 * 9 + 64
    for output, C in (("trace", 10), (0, 1)):
        rf = _structured_roofline(module, params, X, output)
        expected = 2 * n * n * C * convs + 2 * n * n * (4096 + C * 10) + 3 * n * n
        assert rf["flops"] == expected
        assert rf["width"] == C * 64 * 32 * 9
        assert rf["probe_width"] == min(C * 64 * 32 * 9, 2**16)


def test_roofline_times_its_probe_beside_every_call_and_divides_like_for_like():
    from benchmarks.__main__ import _run_group, roofline_ratios

    # A real row's process: the MLP's roofline case times its GEMM probe (n x 512 x n)
    # just before and just after each of its calls, by wall and CPU time.
    spec = dict(kind="gram", method="skpathkernel", sizes=[4, 512, 1], n=64,
                dtype="float32", repeats=3, roofline=True, device="cpu")
    (r,) = _run_group([spec], 1)
    assert len(r["times"]) == len(r["cpu_times"]) == 3
    assert len(r["probe_times"]) == len(r["probe_cpu_times"]) == 6
    assert r["roofline"]["probe_flops"] == 2 * 64 * 64 * 512
    # The ratios written out from the definition: the bound at the probe's median rate
    # over the call's median, CPU time with CPU time and wall time with wall time.
    r.update(times=[3.0, 1.0, 2.0], cpu_times=[1.0, 0.5, 0.75],
             probe_times=[0.4, 0.1, 0.2, 0.3, 0.9, 0.25], probe_cpu_times=[0.1] * 6,
             roofline={"flops": 10.0, "performed_flops": 6.0, "probe_flops": 5.0})
    ratios = roofline_ratios(r)
    assert ratios["cpu"]["rate"] == pytest.approx(50.0)
    assert ratios["cpu"]["full"] == pytest.approx(10.0 / 50.0 / 0.75)
    assert ratios["cpu"]["performed"] == pytest.approx(6.0 / 50.0 / 0.75)
    assert ratios["wall"]["rate"] == pytest.approx(5.0 / 0.275)
    assert ratios["wall"]["full"] == pytest.approx(10.0 * 0.275 / 5.0 / 2.0)
    # On CUDA the host's CPU time says nothing of the device's work: wall time only.
    r["spec"] = {**spec, "device": "cuda"}
    assert set(roofline_ratios(r)) == {"wall"}


def test_chunked_captures_reuse_their_buffers_and_match_dense_jacobians(monkeypatch):
    # A block of formed gradients captured in chunks of 3 rows (3, 3 and a last one of
    # 1): every chunk's backprops are written into the same buffers, which must hold
    # nothing of an earlier chunk once its terms are copied into the block.
    module, X, params = _double_problem("resnet", 7)
    real_shares = _gram._dense_shares
    monkeypatch.setattr(_gram, "_dense_shares", lambda *a: (3, real_shares(*a)[1]))
    # The chunk set here, not what the kept blocks leave (the CPU's wide chunks).
    monkeypatch.setattr(_gram, "_wide_chunks", lambda device: False)
    calls = []
    real_capture = _gram.capture

    def spy(*args, scratch=None, **kw):
        calls.append((args[2].shape[0], None if scratch is None else id(scratch)))
        return real_capture(*args, scratch=scratch, **kw)

    monkeypatch.setattr(_gram, "capture", spy)
    K = tangent_gram(module, params, X)
    chunked = [c for c in calls if c[1] is not None]
    assert [n for n, _ in chunked] == [3, 3, 1] and len({s for _, s in chunked}) == 1
    _check_trace(K, module, X)


def test_output_groups_form_their_blocks_in_the_same_memory(monkeypatch):
    # The trace summed over groups of outputs (4, 3 and 3 of the ten), each group's
    # blocks formed in chunks: a later group's blocks overwrite the earlier group's, which
    # are summed by then; the trace must still be the dense Jacobians' one.
    module, X, params = _double_problem("resnet", 5)
    real_shares = _gram._dense_shares
    monkeypatch.setattr(_gram, "_dense_shares", lambda *a: (2, real_shares(*a)[1]))
    # The chunk set here, not what the kept blocks leave (the CPU's wide chunks).
    monkeypatch.setattr(_gram, "_wide_chunks", lambda device: False)
    monkeypatch.setattr(_gram, "_output_groups",
                        lambda *a: [[0, 1, 2, 3], [4, 5, 6], [7, 8, 9]])
    formed = []
    real_formed = _gram._formed

    def spy(terms, dense, into=None, start=0, order="flat"):
        if into is not None and start == 0:
            formed.append(into[0].delta.data_ptr())
        return real_formed(terms, dense, into, start, order)

    monkeypatch.setattr(_gram, "_formed", spy)
    K = tangent_gram(module, params, X)
    assert len(formed) == 3 and len(set(formed)) == 1
    _check_trace(K, module, X)


def test_executed_flops_add_what_the_counter_cannot_see(monkeypatch):
    from benchmarks._flops import counted_syrk, executed_flops

    # A convolution grouped by sample (the engine's per-sample weight gradients): the
    # counter alone counts it as if ungrouped, n times the closed form 2 n c_out c_in k^2 HW.
    n, c_in, c_out, side = 4, 16, 8, 10
    a = torch.randn(1, n * c_in, side, side)
    d = torch.randn(1, n * c_out, side, side)
    _, flops = executed_flops(lambda: torch.nn.grad.conv2d_weight(
        a, (n * c_out, c_in, 3, 3), d, 1, 1, 1, n))
    assert flops == 2 * n * c_out * c_in * 9 * side * side
    # CPU attention, forward and backward: 4 B H S S d and 8 B H S S d (two and four
    # products of S x d by d x S or S x S by S x d).
    B, H, S, dh = 2, 4, 65, 16
    q = torch.randn(B, H, S, dh, requires_grad=True)

    def attention():
        out = torch.nn.functional.scaled_dot_product_attention(q, q, q)
        return torch.autograd.grad(out.sum(), q)

    _, flops = executed_flops(attention)
    assert flops == 12 * B * H * S * S * dh
    # SciPy's SYRK, outside torch: the n (n + 1) / 2 dot products of the upper triangle.
    monkeypatch.setattr(_gram, "_syrk", lambda acc: lambda g, alpha=1.0: None)
    seen = []
    with counted_syrk(seen.append):
        _gram._syrk(torch.zeros(5, 5))(torch.zeros(5, 7))
    assert seen == [5 * 6 * 7]


def test_gram_nets_rows_report_their_executed_work_beside_the_roofline():
    from benchmarks.__main__ import _executed_cells, _run_group, roofline_ratios

    spec = {**_plan(True, "cpu", archs=("cnn8",))["gram_nets"][0][0], "n": 64, "repeats": 2}
    (r,) = _run_group([spec], 1)
    executed, rf = r["roofline"]["executed_flops"], r["roofline"]
    # At least what the engine must run: the products it performs (the upper triangle
    # and forming, counted apart from the call by _structured_roofline) and the forward
    # pass of the 64 images through conv32 and conv64 (3 x 3, 8 x 8, padding 1).
    forward = 2 * 64 * 64 * (32 * 9 + 64 * 32 * 9)
    assert executed >= rf["performed_flops"] + forward
    # The cells written out from the definition: executed FLOPs over the call's median
    # CPU time at the probe's median CPU rate; the roofline's own ratios unchanged.
    r.update(cpu_times=[1.0, 0.5, 0.75], probe_cpu_times=[0.1] * 4,
             roofline={**rf, "flops": 10.0, "performed_flops": 6.0, "probe_flops": 5.0,
                       "executed_flops": 30e9})
    assert _executed_cells(r) == ["30.00", f"{30e9 / 50.0 / 0.75:.2f}"]
    assert roofline_ratios(r)["cpu"]["full"] == pytest.approx(10.0 / 50.0 / 0.75)
    del r["roofline"]["executed_flops"]
    assert _executed_cells(r) == ["-", "-"]
