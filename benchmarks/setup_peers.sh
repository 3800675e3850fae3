#!/usr/bin/env bash
# Make .venv-peers: JAX / neural-tangents / skorch for the benchmark peers, kept out of
# the main environment (they need numpy < 2; see requirements-peers.txt). The venv sees
# the main environment's torch through --system-site-packages, so no other torch build
# (in particular no CUDA wheel) is downloaded.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
venv="${1:-$root/.venv-peers}"
python -m venv --system-site-packages "$venv"
"$venv/bin/pip" install -r "$root/benchmarks/requirements-peers.txt"
"$venv/bin/python" -c "import jax, neural_tangents, skorch, torch; print('peers venv:', \
'jax', jax.__version__, 'neural-tangents', neural_tangents.__version__, \
'skorch', skorch.__version__, 'torch', torch.__version__)"
