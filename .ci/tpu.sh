#!/usr/bin/env bash
# The tpu CI tier (DESIGN.md section 5): forward_tpu end to end on the XLA CPU device, Pallas
# kernels in interpret mode, and their TPU lowering. It needs its own venv because torch_xla 2.9.0
# needs exactly torch 2.9.0 (research/tpu-path.md), while the main tier uses torch 2.13.
#
# Usage: bash .ci/tpu.sh [extra pytest args]. Env: CUSTOMOP_TPU_VENV (default .venv-tpu),
# PYTHON (default python3). The venv is reused when it already holds the pinned set.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=${CUSTOMOP_TPU_VENV:-.venv-tpu}
python=${PYTHON:-python3}
# The tested set (research/tpu-path.md): the [pallas] extra pins jax/jaxlib 0.7.1, and call_jax
# needs torchax, which torch_xla does not declare. torch 2.9.0 is the PyPI CUDA build (several GB).
pins=(torch==2.9.0 'torch_xla[pallas]==2.9.0' torchax==0.0.13)
test_deps=(pytest pytest-timeout numpy)

t0=$SECONDS
if ! "$venv/bin/python" -c 'import torch, torch_xla, torchax, jax, pytest
assert torch.__version__.startswith("2.9.0") and jax.__version__ == "0.7.1"' 2>/dev/null; then
    echo "tpu tier: building $venv"
    rm -rf "$venv"
    "$python" -m venv "$venv"
    "$venv/bin/pip" install -q "${pins[@]}" "${test_deps[@]}"
fi
"$venv/bin/pip" install -q -e . --no-deps
echo "tpu tier: environment ready in $((SECONDS - t0)) s"

t1=$SECONDS
status=0
PJRT_DEVICE=CPU CUSTOMOP_PALLAS_INTERPRET=1 JAX_PLATFORMS=cpu \
    "$venv/bin/python" -m pytest tests/backends/tpu -q -p no:cacheprovider "$@" || status=$?
echo "tpu tier: tests took $((SECONDS - t1)) s (exit $status)"
exit "$status"
