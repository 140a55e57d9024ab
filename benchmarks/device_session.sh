#!/usr/bin/env bash
# One device call: install the carried wheels, run the GPU tests and the demo on CUDA, then
# (optionally) the benchmark. Logs and results go to $OUT so they come back.
#   usage on the device: bash benchmarks/device_session.sh [tests] [demo] [bench:SCRIPT.py] ...
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  >"$OUT/pip.log" 2>&1 || { tail -5 "$OUT/pip.log"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv | tee "$OUT/gpu.txt"
status=0
for step in "$@"; do
  case "$step" in
    tests)
      python3 -m pytest -q -m gpu tests/test_engine_gpu.py 2>&1 | tee "$OUT/gpu_tests.log" | tail -25
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1 ;;
    demo)
      python3 dgls_train.py --config toml/demo.toml --verbose 2>&1 | grep -v "it/s\]" | tee "$OUT/demo_cuda.log" | tail -8
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1 ;;
    bench:*)
      script=${step#bench:}
      python3 "benchmarks/$script" 2>&1 | tee "$OUT/${script%.py}.log" | tail -40
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
      cp benchmarks/results/* "$OUT/" 2>/dev/null ;;
  esac
done
exit $status
