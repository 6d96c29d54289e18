#!/usr/bin/env bash
# The tpu CI tier (docs/design.md, CI tiers): the xla kernels of the customop:: ops and forward_tpu
# end to end on the XLA CPU device, the Pallas kernels in interpret mode, and their TPU lowering.
# It needs its own venv because torch_xla 2.9.0 requires exactly torch 2.9.0, while the main tier
# uses torch 2.13.
#
# Usage: bash .ci/tpu.sh [extra pytest args]. Env: CUSTOMOP_TPU_VENV (default .venv-tpu),
# PYTHON (default python3), CUSTOMOP_TIER_CLEANUP=1 (remove the venv afterwards),
# CUSTOMOP_TIER_PREPARE=1 (build the venv, run no test). A venv that
# already holds the pinned set is reused; without one, a machine short of disk skips the tier.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=.ci/lib.sh
. .ci/lib.sh

venv=${CUSTOMOP_TPU_VENV:-.venv-tpu}
python=${PYTHON:-python3}
# The tested set: the [pallas] extra pins jax/jaxlib 0.7.1, and call_jax
# needs torchax, which torch_xla does not declare; torchax 0.0.13 imports flax at import time
# (torchax/checkpoint.py) without declaring it either, and flax 0.12.0 is what pip resolves next
# to jax 0.7.1. torch 2.9.0 is the PyPI CUDA build (7.7 GB installed; the machine's pip cap is
# <=2.14.1).
pins=(torch==2.9.0 'torch_xla[pallas]==2.9.0' torchax==0.0.13 flax==0.12.0)
test_deps=(pytest pytest-timeout numpy)

t0=$SECONDS
if ! "$venv/bin/python" - <<'EOF' 2>/dev/null; then
import torch, torch_xla, torchax, jax, pytest
assert torch.__version__.startswith("2.9.0") and torch_xla.__version__.startswith("2.9.0")
assert jax.__version__ == "0.7.1"
EOF
    skip_without_disk tpu 9
    echo "tpu tier: installing ${pins[*]} into $venv"
    rm -rf "$venv"
    "$python" -m venv "$venv"
    install_one_by_one "$venv" "${pins[@]}" "${test_deps[@]}"
fi
# CI builds the venv ahead, while the main tier's tests run (.ci/run); the editable install of
# the checkout and the tests come when the tier's turn comes.
if [[ ${CUSTOMOP_TIER_PREPARE:-0} == 1 ]]; then echo "tpu tier: venv ready in $((SECONDS - t0)) s"; exit 0; fi
# The editable install of this checkout (skipped when the venv already points here).
if ! "$venv/bin/python" -c 'import customop, os, sys; sys.exit(not os.path.samefile(customop.__path__[0], "customop"))' 2>/dev/null; then
    "$venv/bin/pip" install -q --no-cache-dir --no-deps -e . >/dev/null 2>&1 \
        || { echo "tpu tier: the editable install of customop failed"; exit 1; }
fi
echo "tpu tier: environment ready in $((SECONDS - t0)) s"

t1=$SECONDS
status=0
PJRT_DEVICE=CPU CUSTOMOP_PALLAS_INTERPRET=1 JAX_PLATFORMS=cpu \
    "$venv/bin/python" -m pytest tests/backends/tpu -q -p no:cacheprovider "$@" || status=$?
echo "tpu tier: tests took $((SECONDS - t1)) s (exit $status)"
# CI sets this so that the next tier gets the disk back.
if [[ ${CUSTOMOP_TIER_CLEANUP:-0} == 1 ]]; then rm -rf "$venv"; fi
exit "$status"
