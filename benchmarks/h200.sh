#!/usr/bin/env bash
# One batched H200 session: environment facts, GPU tests, compute-sanitizer, benchmarks.
# Usage on the device machine (repo root): bash benchmarks/h200.sh [runner args...]
# Writes logs and results under $OUT (or ./h200-out).
# BASELINE_TREE=DIR (another checkout, e.g. `git archive OLD | tar -x -C .old`): first times that
# tree's kernels (customop column only) with the same runner args, then compares it with this
# tree's run (benchmarks/compare.py -> $OUT/compare.md). SKIP_TESTS=1 / SKIP_BENCH=1 skip a part;
# TEST_WORKERS, TEST_PATHS and TEST_TIMEOUT: see the tests step.
set -uo pipefail
out=${OUT:-h200-out}; mkdir -p "$out"; out=$(cd "$out" && pwd)
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
unset TRITON_INTERPRET
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
fi
if [ -n "${BASELINE_TREE:-}" ] && [ "${SKIP_BENCH:-0}" != 1 ]; then
  ( cd "$BASELINE_TREE" && python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 \
      && timeout 300 python3 -m customop.benchmarks.runner --impls customop --out "$out/baseline" "$@" \
         >"$out/baseline.log" 2>&1 ) || echo "baseline run failed: see $out/baseline.log"
fi
python3 -m pip install -q --no-deps --no-build-isolation -e . >"$out/install.log" 2>&1 || { cat "$out/install.log"; exit 1; }
{ nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
  git rev-parse --short HEAD 2>/dev/null; date -u; } | tee "$out/env.txt"
if [ "${SKIP_TESTS:-0}" != 1 ]; then
  # TEST_WORKERS=N: N pytest-xdist processes share the GPU, one test module each (the Triton
  # compiles, not the GPU, bound this tier); every failure is then reported, not only the first.
  # TEST_PATHS / TEST_TIMEOUT (seconds) widen the run; the whole log lands in gpu-tests.log.
  if [ "${TEST_WORKERS:-0}" -gt 0 ]; then mode=(-n "$TEST_WORKERS" --dist loadfile --durations=25); else mode=(-x); fi
  # shellcheck disable=SC2086
  timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -m cuda ${TEST_PATHS:-tests/gpu} -q "${mode[@]}" -p no:cacheprovider \
    >"$out/gpu-tests.log" 2>&1
  tail -60 "$out/gpu-tests.log" | tee "$out/gpu-tests.txt"
fi
if [ "${SKIP_BENCH:-0}" != 1 ]; then
  timeout 420 python3 -m customop.benchmarks.runner --out "$out" "$@" 2>&1 | tee "$out/bench.log" | tail -150
  if [ -f "$out/baseline/results.json" ]; then
    python3 -m customop.benchmarks.compare "$out/baseline/results.json" "$out/results.json" >"$out/compare.md"
    tail -3 "$out/compare.md"
  fi
fi
