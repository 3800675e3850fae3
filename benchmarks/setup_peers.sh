#!/usr/bin/env bash
# Make .venv-peers: JAX / neural-tangents / nngeometry / skorch / dattri for the benchmark peers, kept out of
# the main environment (they need numpy < 2; see requirements-peers.txt). torch is the same
# 2.13.0 CPU build as the main environment's, installed from the file on this machine's disk
# first, so that no other torch build (in particular no multi-GB CUDA wheel) is downloaded
# and the venv works whether or not the interpreter that made it has torch
# (--system-site-packages sees only the base interpreter's packages, not another venv's).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="${1:-$root/.venv-peers}"
python -m venv --system-site-packages "$venv"
"$venv/bin/pip" install "torch==2.13.0"
"$venv/bin/pip" install -r "$root/benchmarks/requirements-peers.txt"
# ExPLAIND (bench_explaind.py): its 0.1.0 wheel is pure Python and declares Python >= 3.12
# and heavy extras (plotly, tensorboard, umap, pandas pins), but runs on 3.11 with only
# torch and tqdm at run time: installed without its declared dependencies.
"$venv/bin/pip" install --no-deps --ignore-requires-python explaind==0.1.0
# nngeometry (the Gram groups' PyTorch-hooks peer): pure Python, needs only torch at run
# time; its declared torchvision is never imported and would pull another torch build.
"$venv/bin/pip" install --no-deps nngeometry==0.4
"$venv/bin/python" -c "import jax, neural_tangents, nngeometry, skorch, torch, \
explaind.epk_model, dattri.algorithm, trak; from importlib.metadata import version; \
print('peers venv:', 'jax', jax.__version__, 'neural-tangents', neural_tangents.__version__, \
'nngeometry', version('nngeometry'), \
'skorch', skorch.__version__, 'dattri', version('dattri'), 'traker', version('traker'), \
'explaind 0.1.0', 'torch', torch.__version__)"
