#!/usr/bin/env bash
# The one prepared command for a session that is lent a GPU: every CUDA test, then the
# A/B of the engine's launch-bound choices (benchmarks/bench_gpu_ab.py, estimated at
# 1-2 minutes, not yet run on a GPU), then the quick GPU benchmark
# (benchmarks/gpu.sh --quick) in the time left. Measured on the
# first GPU run (2026-12-04, one H200, commit daff637): the machine started in about
# 30 s, the CUDA tests took 29 s, and gpu.sh --quick's groups took gram_nets 280 s, gram
# 153 s, path 130 s, training 3 s, decomposition 2 s (mostly the case processes'
# start-up, a CUDA context each): about 10 minutes for all, more than one call should
# spend of the 15 minutes a session gets. So the groups run in the order
# DEVICE_CHECK_GROUPS names (default path,defaults,gram_nets,training,decomposition,gram:
# the path kernel first, whose launch-bound tiling no GPU has run; then the default
# estimators' fit against scikit-learn's MLPs, which device="auto" puts on the GPU and
# no run has timed there, about 32 s on the CPU's quick plan; then the image networks'
# Grams, measured once already; after bench_gpu_ab's 150 s at most, about 280 s are left
# for these, so the later groups run only when the earlier ones are quick) until the budget
# (DEVICE_CHECK_SECONDS, default 480) runs out; with the start that leaves about 6
# minutes, enough for a rerun (a fresh start needs 4). Name fewer groups to verify one
# change, e.g. DEVICE_CHECK_GROUPS=gram_nets. The second run (2026-12-04 18:32 UTC, commit
# 5f112a4): CUDA tests 31 s, bench_gpu_ab 33 s, path 95 s, defaults 20 s, gram_nets 252 s,
# training 2 s, decomposition 2 s; gram was not reached in the 480 s.
#
# Call it with the device tool's `run` (it runs in the repo root there; $OUT comes back):
#     run(command="bash benchmarks/device_check.sh", timeout_s=540)
# No `carry`: the tests it selects import nothing the device lacks (skops, dask, sybil and
# numpydoc are only imported by other test files, which it does not collect), and the
# package runs from the tree (PYTHONPATH=$PWD, set here). The call sends the checkout the
# session was started in: commit or keep there whatever should travel.
#
# What comes back, under the reply's files_at:
#     versions.txt     torch, CUDA, driver and GPU (nvidia-smi), Python, NumPy
#     cuda-tests.log   pytest -ra output of every CUDA test (tests/test_cuda.py,
#                      tests/test_cuda_rnn.py -- LSTM and GRU fits and analyses, never run
#                      on a GPU before, which cuDNN's RNN kernels would fail -- and the
#                      CUDA tests of test_rules.py, test_diagnostics.py, test_unrolled.py)
#     cuda-tests.xml   the same as JUnit XML (per-test durations)
#     gpu-ab.log       benchmarks/bench_gpu_ab.py's output (its gpu_ab.md / .json in
#                      results.tgz): the engine's launch-bound choices, ref vs tree
#     profile_gpu_gram.txt  operators by count and device time of the image networks'
#                      Grams at N = 128 (benchmarks/profile_gpu_gram.py)
#     gpu-bench.log    benchmarks/gpu.sh's output
#     results.tgz      benchmarks/results/*-quick-cuda.md / .json of every group that
#                      finished (groups are written as each one ends, so a run cut short at
#                      its time limit keeps the finished ones)
#     summary.txt      exit status and seconds of each stage
# After: read summary.txt and cuda-tests.log; a failed parity test is a bug to file with
# its log lines. Unpack the benchmark results into the checkout
# (tar -xzf results.tgz -C benchmarks/results), review them with git diff, commit them
# with the run's date and the GPU named in versions.txt, and give the machine back
# (give_back) unless rerunning at once.
#
# Exit status: 0 when the tests passed and the benchmark finished; else the tests' status,
# or else the benchmark's (124: stopped at its time limit). Without CUDA (a CPU run of this
# script) the tests are reported skipped and gpu.sh refuses ("no CUDA device"): status 1.
# Environment: OUT (default: a new temporary folder), PYTHON (default python3),
# DEVICE_CHECK_SECONDS (default 480: the whole script's budget), DEVICE_CHECK_AB_SECONDS
# (default 150: bench_gpu_ab's limit, inside the budget), DEVICE_CHECK_GROUPS
# (default path,defaults,gram_nets,training,decomposition,gram: the benchmark's groups,
# in order).
set -uo pipefail
cd "$(dirname "$0")/.." || exit
OUT=${OUT:-$(mktemp -d)}
PY=${PYTHON:-python3}
BUDGET=${DEVICE_CHECK_SECONDS:-480}
BENCH_GROUPS=${DEVICE_CHECK_GROUPS:-path,defaults,gram_nets,training,decomposition,gram}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
# The tests and the benchmark's case processes each set their own torch threads; this
# keeps the test workers' BLAS from spawning 16 threads each.
export OMP_NUM_THREADS=2
start=$SECONDS
summary() { echo "$1" | tee -a "$OUT/summary.txt"; }

{
    date -u
    echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)"
    nvidia-smi 2>&1 || echo "nvidia-smi: not available"
    "$PY" - <<'EOF'
import platform, numpy, torch
print("python", platform.python_version(), "| numpy", numpy.__version__,
      "| torch", torch.__version__, "| torch CUDA", torch.version.cuda,
      "| cuDNN", torch.backends.cudnn.version())
if torch.cuda.is_available():
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        print(f"cuda:{i}", p.name, f"{p.total_memory / 2**30:.0f} GiB",
              f"capability {p.major}.{p.minor}")
else:
    print("torch sees no CUDA device")
EOF
} 2>&1 | tee "$OUT/versions.txt"

# ---- CUDA tests: -k cuda selects test_cuda.py whole and the other files' CUDA tests.
timeout_opt=()
if "$PY" -c "import pytest_timeout" 2>/dev/null; then
    timeout_opt=(--timeout=120)
fi
workers=()
if "$PY" -c "import xdist" 2>/dev/null; then
    workers=(-n 8)  # one worker per parity test file part; more only adds CUDA contexts
fi
t0=$SECONDS
timeout --kill-after=10 150 "$PY" -m pytest -ra -p no:cacheprovider "${workers[@]}" \
    "${timeout_opt[@]}" --junitxml="$OUT/cuda-tests.xml" -k cuda \
    tests/test_cuda.py tests/test_cuda_rnn.py tests/test_rules.py tests/test_diagnostics.py \
    tests/test_unrolled.py \
    tests/test_unrolled_normalize_y.py \
    2>&1 | tee "$OUT/cuda-tests.log"
tests_rc=${PIPESTATUS[0]}
summary "cuda tests: exit $tests_rc in $((SECONDS - t0)) s"

bench=$(mktemp -d)
# ---- The A/B of the engine's launch-bound choices (benchmarks/bench_gpu_ab.py): first,
# since it decides what the engine takes on a GPU.
t0=$SECONDS
timeout --kill-after=10 "${DEVICE_CHECK_AB_SECONDS:-150}" "$PY" -m benchmarks.bench_gpu_ab \
    --out "$bench/gpu_ab" 2>&1 | tee "$OUT/gpu-ab.log"
summary "bench_gpu_ab: exit ${PIPESTATUS[0]} in $((SECONDS - t0)) s"

# ---- Where the Grams' calls go on the GPU (benchmarks/profile_gpu_gram.py, ~20 s): the
# engine is launch-bound there, and the operator counts per phase say where to cut.
t0=$SECONDS
timeout --kill-after=10 60 "$PY" -m benchmarks.profile_gpu_gram --out "$OUT" 2>&1 \
    | grep -E "^##|wrote|Error"
summary "profile_gpu_gram: exit ${PIPESTATUS[0]} in $((SECONDS - t0)) s"

# ---- Quick GPU benchmark, in whatever time is left (20 s kept for the archive).
left=$((BUDGET - (SECONDS - start) - 20))
if ((left < 30)); then
    bench_rc=124
    summary "gpu.sh: not started, ${left} s left"
else
    t0=$SECONDS
    # timeout signals its whole process group: gpu.sh, python and the case processes.
    PYTHON="$PY" timeout --kill-after=10 "$left" bash benchmarks/gpu.sh --quick --out "$bench" \
        --only "$BENCH_GROUPS" \
        2>&1 | tee "$OUT/gpu-bench.log"
    bench_rc=${PIPESTATUS[0]}
    summary "gpu.sh --quick: exit $bench_rc in $((SECONDS - t0)) s (limit ${left} s)"
fi
tar -czf "$OUT/results.tgz" -C "$bench" .
summary "results.tgz: $(tar -tzf "$OUT/results.tgz" | grep -c '\.md$') result files; \
total $((SECONDS - start)) s"
if ((tests_rc != 0)); then exit "$tests_rc"; fi
exit "$bench_rc"
