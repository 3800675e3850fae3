"""The GPU session's prepared benchmarks, run small on the CPU: a device session has
minutes, and a script that breaks there loses them (benchmarks/device_check.sh)."""

import pytest
import torch

from benchmarks import bench_gpu_ab, profile_gpu_gram


def test_backprop_routes_agree_with_the_loop():
    # The replicated-batch prototype and the batched pass give every output's backprop
    # to every site as the loop of one backward pass per output does.
    rows = []
    bench_gpu_ab.backprop_route_rows("cpu", 3, 1, lambda: None, rows.append)
    assert len(rows) == 8
    for row in rows:
        assert row["max_rel_diff"] <= 1e-6, row["case"]


def test_replicated_backprops_match_autograd_per_sample():
    # Independent of the routes: output c's backprop to the network's output layer is
    # the one-hot of c on every row.
    module, _, X = bench_gpu_ab._worker.gram_problem(
        {"arch": "cnn8", "n": 3, "dtype": "float64"})
    grads = bench_gpu_ab._backprops_by("replicated", module, X)
    head = grads[-1]
    assert head.shape == (3, 10, 10)
    torch.testing.assert_close(head, torch.eye(10, dtype=head.dtype).expand(3, 10, 10))


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_profile_writes_every_network(tmp_path):
    profile_gpu_gram.main(["--device", "cpu", "--out", str(tmp_path), "--n", "2"])
    text = (tmp_path / "profile_gpu_gram.txt").read_text()
    for arch in ("cnn8", "cifar", "resnet", "vit"):
        assert f"## {arch}, N = 2" in text


def test_precision_rows_hold_float32_error_on_the_cpu():
    # The TF32 switch changes nothing on the CPU: both sides' float32 K sit within float32
    # rounding of the engine's float64 K, which a float32 slip into the reference (or a
    # wrong reference network) would break.
    rows = []
    bench_gpu_ab.precision_rows("cpu", 3, 1, lambda: None, rows.append)
    assert len(rows) == 8
    for row in rows:
        errors = [float(e) for e in row["error"].split(" / ")]
        assert max(errors) <= 1e-4, row["case"]  # TF32 leaves ~1e-3
        assert row["max_rel_diff"] <= 1e-6, row["case"]
