#!/usr/bin/env bash
# The GPU runbook of docs/benchmarks.md ("GPU"), in device calls of under 10 minutes each, run
# from the repository root on the lent machine (device tool `run`, one part per call):
#   bash scripts/gpu_runbook.sh tests   # pytest --gpu: kernels through Triton, scheduler, engine
#   bash scripts/gpu_runbook.sh bench   # Qwen3-0.6B shape, 256 sequences, vs transformers (>= 10x?)
#   bash scripts/gpu_runbook.sh extra   # async scheduling off, host overhead on/off, attention
#   bash scripts/gpu_runbook.sh lease   # one ~9-minute call for a 15-minute lease: the decode
#                                       # step probe (each step fix turned off in turn, a profiler
#                                       # trace), the bench (engine alone), tests, attention
# Packages the device image lacks travel as wheels in .whl (git-ignored; `lease` installs them):
# llguidance, e.g. `pip download --no-deps --only-binary=:all: --python-version 3.12
# --platform manylinux_2_31_x86_64 -d .whl llguidance==1.9.1`, and the call carries ".whl".
# Each part writes its log (and JSON where the script has it) to $OUT, the folder the device tool
# brings back (default /tmp/gpu_runbook); every step has its own time limit, so a hang costs only
# that step. `MINIVLLM_RUNBOOK_SCALE=small` shrinks every workload (a CPU smoke run of this file).
# Exit status: 0 when every step exited 0, 1 when any failed or ran out of time, 2 for usage.
set -uo pipefail

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the device image has the packages, not this one
export PYTHONUNBUFFERED=1  # a step killed at its time limit still leaves its output in the log
py=${PYTHON:-python3}      # the image's interpreter is python3 (device KINDS.md); PYTHON overrides
out=${OUT:-/tmp/gpu_runbook}
mkdir -p "$out"
small=${MINIVLLM_RUNBOOK_SCALE:-}
failed=0

step() {  # step SECONDS LOG CMD...: run CMD under a time limit, its output appended to $out/LOG
    local limit=$1 log=$2
    shift 2
    echo "== $(date -u +%H:%M:%S) $*" | tee -a "$out/$log"
    timeout "$limit" "$@" >>"$out/$log" 2>&1
    local rc=$?
    echo "== rc=$rc" | tee -a "$out/$log"
    tail -n 15 "$out/$log"
    (( rc == 0 )) || failed=$((failed + 1))
}

if [[ -n $small ]]; then
    qwen=(--model llama-tiny --num-seqs 4 --input-len 8 24 --output-len 4 6 --dtype float32)
    tiny=(--model llama-tiny --num-seqs 8 --max-num-seqs 8 --input-len 8 16 --output-len 4 4
          --dtype float32 --max-num-batched-tokens 64 --repeat 1)
    attention=(--small --iters 1)
    lease_bench=("${qwen[@]}")
    probe=(--model llama-tiny --dtype float32 --num-seqs 8 --input-len 32 --steps 3 --variants all)
else
    qwen=(--model qwen3-0.6b --dtype bfloat16 --num-seqs 256 --input-len 100 1024
          --output-len 100 1024)
    tiny=(--model llama-tiny --num-seqs 256 --max-num-seqs 256 --input-len 16 48 --output-len 64 64
          --dtype float32 --max-num-batched-tokens 2048 --repeat 3)
    attention=()
    # the lease's bench: the target's workload, the engine alone (transformers' half never
    # finished inside a lease; the probe takes its time first)
    lease_bench=("${qwen[@]}")
    probe=(--model qwen3-0.6b --dtype bfloat16 --num-seqs 128 --input-len 512 --variants all)
fi

case "${1:-}" in
    tests)
        "$py" -c "import jax; print(jax.__version__, jax.devices())" | tee "$out/tests.log"
        step 540 tests.log "$py" -m pytest -q -rfEs --gpu tests/kernels tests/scheduler tests/engine \
            tests/sampling tests/worker tests/structured_output tests/parallel tests/aot tests/spec \
            tests/cli tests/scripts tests/docs
        ;;
    bench)
        step 570 bench.log "$py" scripts/bench.py "${qwen[@]}" --compare-hf --async-scheduling on \
            --json "$out/gpu.json"
        ;;
    extra)
        step 200 extra.log "$py" scripts/bench.py "${qwen[@]}" --async-scheduling off --json "$out/gpu.json"
        for mode in off on; do
            step 90 extra.log "$py" scripts/bench.py "${tiny[@]}" --async-scheduling "$mode" \
                --json "$out/host.json"
        done
        step 150 extra.log "$py" scripts/bench_attention.py "${attention[@]}" --json "$out/attention.json"
        ;;
    lease)
        if compgen -G ".whl/*.whl" >/dev/null; then
            "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
                --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
        fi
        { nvidia-smi -L; "$py" -c "import jax, transformers, torch; print('jax', jax.__version__, \
          jax.devices(), 'transformers', transformers.__version__, 'torch', torch.__version__)"; } \
          2>&1 | tee "$out/lease.log"
        # where a steady decode step's time goes (program calls and copies, launch vs device),
        # and which fix it depends on: a fresh engine per variant (all fixes off, then each alone),
        # the device's busy share from a profiler trace of `fixed` (and `all-off`) in $out/trace;
        # --time-budget skips the variants that would not end inside the step's limit
        step 240 lease.log "$py" scripts/step_probe.py "${probe[@]}" --trace "$out/trace" \
            --time-budget 215
        # the engine alone on the target's workload (>= 10,000 output tok/s on an H100/H200?)
        step 150 lease.log "$py" scripts/bench.py "${lease_bench[@]}" --async-scheduling on \
            --json "$out/gpu.json"
        # tests in 4 processes on the one GPU: each takes GPU memory as it needs it
        XLA_PYTHON_CLIENT_PREALLOCATE=false step 100 lease.log "$py" -m pytest -v -rfEs --gpu \
            -p no:cacheprovider -n 4 tests/kernels/test_ragged_paged_attention.py \
            tests/kernels/test_validation.py tests/engine/test_llm.py \
            tests/engine/test_engine_mechanics.py tests/sampling/test_sampler.py \
            tests/sampling/test_rejection_sampler.py tests/scheduler
        step 50 lease.log "$py" scripts/bench_attention.py "${attention[@]}" --json "$out/attention.json"
        ;;
    *)
        echo "usage: bash scripts/gpu_runbook.sh tests|bench|extra|lease" >&2
        exit 2
        ;;
esac
if (( failed )); then
    echo "== $failed step(s) failed" >&2
    exit 1
fi
