#!/usr/bin/env bash
# Make .venv-ood: pytorch-ood's detectors for benchmarks/bench_ood.py, kept out of the
# package's dependencies and of the main environment (see requirements-ood-peers.txt).
# bench_ood finds it at $root/.venv-ood or at $SKPATHKERNEL_OOD_PEERS_PYTHON.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="${1:-$root/.venv-ood}"
python3 -m venv "$venv"
"$venv/bin/pip" install -r "$root/benchmarks/requirements-ood-peers.txt"
"$venv/bin/python" -c "import torch, torchvision, pytorch_ood; from pytorch_ood.detector \
import ViM, Mahalanobis, KNN, EnergyBased, MaxLogit, ReAct; print('ood peers venv: torch', \
torch.__version__, 'torchvision', torchvision.__version__, 'pytorch-ood', pytorch_ood.__version__)"
