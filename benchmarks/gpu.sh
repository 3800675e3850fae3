#!/usr/bin/env bash
# Rows 1-4 of the benchmark (tangent Gram with its peers and roofline, path kernel,
# training with recording, decomposition) on a CUDA device, written to
# benchmarks/results_gpu.md / .json. Peers that cannot use the GPU are listed as skipped
# (neural-tangents: the peers venv holds a CPU-only jaxlib; skorch and MLPRegressor are in
# the CPU-only peers_training table, not run here). The full plan takes minutes on the
# CPU of a 2-core machine; on a GPU its cost is mostly the ~30 case processes' start-up
# (torch + CUDA context, a few seconds each), estimated at 3-5 minutes, under the 8-minute
# budget; pass --quick to halve it. Not yet run on a GPU: no device was available when it
# was written. No timeout kill: a run cut short would write nothing.
# Usage: bash benchmarks/gpu.sh [--quick] [extra python -m benchmarks options]
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else \
'gpu.sh: torch sees no CUDA device')"
python -m benchmarks --device cuda --only gram,path,training,decomposition \
    --stem results_gpu "$@"
