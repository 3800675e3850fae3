#!/usr/bin/env bash
# Rows 1-4 of the benchmark (tangent Gram with its peers and roofline, the image and
# token networks' Gram rows -- CNNs, transformer, ResNet and ViT -- and the CNN's, the
# ResNet's and the ViT's path kernels, training with recording, decomposition) on a CUDA
# device, written per group to
# benchmarks/results/<group>[-quick]-cuda.md / .json. Peers that cannot use the GPU are listed as skipped
# (neural-tangents and nngeometry: the peers venv holds a CPU-only jaxlib and torch, so
# both are measured on the CPU run; skorch and MLPRegressor are in
# the CPU-only peers_training table, not run here). The full plan takes minutes on the
# CPU of a 2-core machine; on a GPU its cost is mostly the ~45 case processes' start-up
# (torch + CUDA context, a few seconds each) and the N = 20000 CNN Gram, estimated at 5-7
# minutes before the ResNet and ViT rows were added (not estimated since; every parameter
# of both, the ViT's class token and position embedding included, now has a rule: see
# skpathkernel._tangent._routes.layer_routes); pass --quick to halve it. On a device
# session, run benchmarks/device_check.sh instead: it runs every CUDA test first, then
# this with --quick under a time limit, and archives what finished. Each group's files are
# written as the group ends, so a run stopped by a timeout keeps the groups before it.
# First run on a GPU on 2026-12-04 (one H200; results/*-quick-cuda.md): the quick plan's
# groups took about ten minutes together (benchmarks/device_check.sh gives each group's).
# Usage: bash benchmarks/gpu.sh [--quick] [extra python -m benchmarks options]
# Environment: PYTHON, the interpreter (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
"${PYTHON:-python3}" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else \
'gpu.sh: torch sees no CUDA device')"
"${PYTHON:-python3}" -m benchmarks --device cuda --only gram,gram_nets,path,training,decomposition "$@"
