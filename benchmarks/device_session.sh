#!/usr/bin/env bash
# One device call: install the carried wheels, run the GPU tests and the demo on CUDA, then
# (optionally) benchmarks. Logs and results go to $OUT so they come back.
#   usage on the device: bash benchmarks/device_session.sh [tests] [shard:N:FILE[:FILE...]] [pytest:FILE[:FILE...]]
#     [fulltests[:PYTEST_K]] [fulldemo] [dptests[:PYTEST_K]] [launch] [demo] [bench:SCRIPT.py[:ARG...]] [pack] ...
#   e.g. bench:bench_models.py:--model=flux   bench:bench_models.py:--model=wan:--steps=10   bench:bench_fp8.py
#   shard:8:tests/test_units_gpu.py:tests/test_host_training_gpu.py  runs those files' (or FILE::TEST node ids')
#   non-slow tests in 8 pytest processes at once (fewer on a host with less than 40 GiB of RAM each), spread
#   over the machine's GPUs (each test's state is its own; the delay-injection tests check order, not time), so
#   a call holds every GPU test file.
# A bench writes its results and the results index (README.md) to benchmarks/results/; what it wrote is copied to $OUT.
# `pack` (last) puts everything under $OUT into one archive: a call brings back at most 8 files.
# DGLS_SKIP_INSTALL=1 skips the wheels' install (a second session script started beside a first one).
# A diffusion-pipe checkout carried as .dp (git-ignored) becomes DGLS_DIFFUSION_PIPE unless that is set.
# A bitsandbytes package carried as .bnb/ (git-ignored; its wheel's CUDA libraries are too large to carry,
# so only libbitsandbytes_cpu.so and the one for the image's CUDA are kept) goes on the path.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
if [ -z "${DGLS_SKIP_INSTALL:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >"$OUT/pip.log" 2>&1 || { tail -5 "$OUT/pip.log"; exit 1; }
fi
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 PATH=/tmp/site/bin:$PATH  # the wheels' scripts (deepspeed)
export DGLS_BENCH_LOGS=$OUT/logs  # benchmarks that start processes keep each one's log there (bench_scaling.py)
[ -d .bnb/bitsandbytes ] && export PYTHONPATH=$PYTHONPATH:$PWD/.bnb
if [ -z "${DGLS_DIFFUSION_PIPE:-}" ] && [ -f .dp/utils/offloading.py ]; then
  export DGLS_DIFFUSION_PIPE=$PWD/.dp
fi
nvidia-smi --query-gpu=name,memory.total,pcie.link.gen.current,pcie.link.width.current --format=csv | tee "$OUT/gpu.txt"
status=0
for step in "$@"; do
  case "$step" in
    tests)
      # every GPU test file but full fine-tuning's (real widths against a CPU AdamW reference, about 15 minutes:
      # more than one call holds), which `fulltests[:PYTEST_K]` runs in parts
      python3 -m pytest -q -m gpu tests/test_engine_gpu.py tests/test_precision_gpu.py tests/test_profiler.py \
        tests/test_ordering_gpu.py tests/test_peers.py \
        tests/test_activation_offload_gpu.py tests/test_units_gpu.py 2>&1 |
        tee "$OUT/gpu_tests.log" | tail -25
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1 ;;
    shard:*)
      spec=${step#shard:}
      IFS=: read -r -a parts <<<"${spec//::/@@}"  # FILE::TEST node ids as pytest: takes them
      parts=("${parts[@]//@@/::}")
      n=${parts[0]}
      ngpu=$(nvidia-smi -L 2>/dev/null | wc -l); [ "$ngpu" -ge 1 ] || ngpu=1
      # a full fine-tuning test holds up to about 30 GiB of host RAM (pinned): of 8 processes on a 128 GiB host,
      # 3 printed nothing (most likely killed for memory); on a 256 GiB host, 5 tests of 8 processes were refused by
      # the RAM check (6 to 11 GiB free); so a process per 40 GiB at most
      ram=$(awk '/MemTotal/ {print int($2 / 1048576)}' /proc/meminfo); fit=$((ram / 40)); [ "$fit" -ge 1 ] || fit=1
      [ "$n" -le "$fit" ] || { echo "shard: $n processes cut to $fit ($ram GiB of RAM)"; n=$fit; }
      python3 -m pytest -q --collect-only -m "not slow" "${parts[@]:1}" 2>/dev/null | grep '::' >/tmp/nodes.txt
      echo "$(wc -l </tmp/nodes.txt) tests in $n processes on $ngpu GPUs"
      pids=()
      for ((i = 0; i < n; i++)); do
        awk -v n="$n" -v i="$i" 'NR % n == i' /tmp/nodes.txt >"/tmp/shard_$i.txt"
        CUDA_VISIBLE_DEVICES=$((i % ngpu)) xargs -a "/tmp/shard_$i.txt" -d '\n' \
          python3 -m pytest -q -m "not slow" -p no:cacheprovider --durations=5 >"/tmp/shard_$i.log" 2>&1 &
        pids+=($!)
      done
      for ((i = 0; i < n; i++)); do
        wait "${pids[$i]}"; rc=$?; [ $rc -eq 0 ] || status=1
        # a process killed from outside (rc 137: the kernel's OOM killer) prints no summary: the tests it had say so
        { echo "=== shard $i (exit $rc)"; cat "/tmp/shard_$i.log"; } >>"$OUT/shard_tests.log"
        grep -E "^(FAILED|ERROR)|passed|failed" "/tmp/shard_$i.log" | tail -8
        [ $rc -le 128 ] || echo "shard $i killed (exit $rc) with no summary; its tests: $(tr '\n' ' ' <"/tmp/shard_$i.txt")"
      done ;;
    pytest:*)
      # some GPU test files or tests, verbose with durations: pytest:tests/a.py:tests/b.py::test_name
      spec=${step#pytest:}
      IFS=: read -r -a files <<<"${spec//::/@@}"
      files=("${files[@]//@@/::}")
      python3 -m pytest -v -m gpu --durations=15 "${files[@]}" 2>&1 | tee "$OUT/pytest.log" | grep -v PASSED | tail -40
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1 ;;
    fulltests*)
      # full fine-tuning only: the GPU tests of host training (optionally narrowed with a pytest -k expression)
      k=${step#fulltests}; k=${k#:}
      python3 -m pytest -q -m gpu tests/test_host_training_gpu.py ${k:+-k "$k"} 2>&1 | tee "$OUT/full_tests.log" |
        tail -15
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1 ;;
    fulldemo)
      # the full-fine-tune demo on CUDA in bf16, with the AdamW steps split (the default), on the CPU and on the GPU
      sed 's/^dtype = "float32"/dtype = "bfloat16"/' toml/demo_full.toml >"$OUT/demo_full_bf16.toml"
      for adam in auto torch_fused device; do
        python3 dgls_train.py --config "$OUT/demo_full_bf16.toml" --host_adam $adam --verbose 2>&1 |
          grep -v "it/s\]" | tee "$OUT/demo_full_cuda_$adam.log" | tail -6
        [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
      done ;;
    dptests*)
      # the real diffusion-pipe train.py (bf16 on the GPU), optionally narrowed with a pytest -k expression
      k=${step#dptests}; k=${k#:}
      python3 -m pytest -q -m slow tests/test_diffusion_pipe_real.py tests/test_diffusion_pipe_models_real.py \
        ${k:+-k "$k"} 2>&1 | tee "$OUT/dp_tests.log" | tail -25
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1 ;;
    launch)
      # the README's launch lines as users type them: no torch.distributed variables in the environment
      clean="env -u RANK -u WORLD_SIZE -u LOCAL_RANK -u MASTER_ADDR -u MASTER_PORT"
      { $clean python3 dgls_train.py --config toml/demo.toml &&
        $clean deepspeed --num_gpus=1 dgls_train.py --deepspeed --config toml/demo.toml; } 2>&1 |
        grep -v "it/s\]" | tee "$OUT/launch.log" | grep -E "^DGLS demo finished|error" | tail -4
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1 ;;
    demo)
      python3 dgls_train.py --config toml/demo.toml --verbose 2>&1 | grep -v "it/s\]" | tee "$OUT/demo_cuda.log" | tail -8
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1 ;;
    bench:*)
      spec=${step#bench:}
      IFS=: read -r -a parts <<<"$spec"
      script=${parts[0]}
      args=("${parts[@]:1}")
      log=$(printf '%s' "${script%.py}${args[*]:+_${args[*]}}" | tr -c 'A-Za-z0-9_.\n' '_')
      stamp=$(mktemp)
      python3 "benchmarks/$script" ${args[@]+"${args[@]}"} 2>&1 | tee "$OUT/$log.log" | tail -40
      [ "${PIPESTATUS[0]}" -eq 0 ] || status=1
      # only what this bench wrote: copying every result file once ran into the call's time limit; not the
      # index (README.md, regenerated locally by report.py): a call brings back a limited number of files
      find benchmarks/results -maxdepth 1 -type f -newer "$stamp" ! -name README.md -exec cp {} "$OUT/" \; ;;
    pack)
      (cd "$OUT" && tar czf ../dgls_out.tgz . && find . -mindepth 1 -delete && mv ../dgls_out.tgz .) ;;
  esac
done
exit $status
