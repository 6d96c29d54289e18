#!/usr/bin/env bash
# The xpu CI tier (docs/xpu.md): the IPEX wrappers of backends/xpu run on CPU tensors
# against the native spec, plus the XPU dispatch chain, with IPEX actually importable. It needs
# its own venv because IPEX 2.8.0 (retired; the last release) refuses any torch but 2.8.*
# (it calls exit(127) at import), while the main tier uses torch 2.13. No Intel GPU is involved:
# PyPI's IPEX is the CPU build (2.8.0+cpu); its llm.functional kernels take CPU tensors.
#
# Usage: bash .ci/xpu.sh [extra pytest args]. Env: CUSTOMOP_XPU_VENV (default .venv-xpu),
# PYTHON (default python3), CUSTOMOP_TIER_CLEANUP=1 (remove the venv afterwards),
# CUSTOMOP_TIER_PREPARE=1 (build the venv, run no test). A venv that
# already holds the pinned set is reused; without one, a machine short of disk skips the tier.
set -uo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=.ci/lib.sh
. .ci/lib.sh

venv=${CUSTOMOP_XPU_VENV:-.venv-xpu}
python=${PYTHON:-python3}
# The `xpu` extra's pins. torch 2.8.0 from PyPI is the CUDA build (2.8.0+cu128, about 3 GB of
# nvidia-* wheels, 6.8 GB installed; this machine's local CPU wheel is 2.13 only); IPEX's own
# metadata does not pin torch, so the pair is named here explicitly.
pins=(torch==2.8.0 intel-extension-for-pytorch==2.8.0)
test_deps=(pytest pytest-timeout numpy)

t0=$SECONDS
if ! "$venv/bin/python" - <<'EOF' 2>/dev/null
import importlib.metadata as md
import pytest  # noqa: F401
assert md.version("torch").startswith("2.8.0")
assert md.version("intel-extension-for-pytorch").startswith("2.8.0")
EOF
then
    skip_without_disk xpu 8
    echo "xpu tier: building $venv (torch 2.8.0 + IPEX 2.8.0)"
    rm -rf "$venv"
    "$python" -m venv "$venv" || exit 1
    install_one_by_one "$venv" "${pins[@]}" "${test_deps[@]}" || exit 1
fi
# CI builds the venv ahead, while the main tier's tests run (.ci/run); the editable install of
# the checkout and the tests come when the tier's turn comes.
if [[ ${CUSTOMOP_TIER_PREPARE:-0} == 1 ]]; then echo "xpu tier: venv ready in $((SECONDS - t0)) s"; exit 0; fi
if ! "$venv/bin/pip" install -q --no-cache-dir --no-deps -e . >/dev/null 2>&1; then
    echo "xpu tier: the editable install of customop failed"
    exit 1
fi
echo "xpu tier: environment ready in $((SECONDS - t0)) s"
"$venv/bin/python" -c 'import torch
from customop.backends.xpu.probe import probe
env = probe()
print("xpu tier: torch", env.torch_version, "| IPEX", env.ipex_version, "| XPU device:", env.xpu_device)'

t1=$SECONDS
"$venv/bin/python" -m pytest tests/backends/xpu -q -p no:cacheprovider "$@"
status=$?
if [ "$status" -eq 5 ]; then
    echo "xpu tier: pytest collected no tests: failing"
    status=1
fi
echo "xpu tier: tests took $((SECONDS - t1)) s (exit $status)"
# CI sets this so that the disk is handed back.
if [[ ${CUSTOMOP_TIER_CLEANUP:-0} == 1 ]]; then rm -rf "$venv"; fi
exit "$status"
