#!/usr/bin/env bash
# The GPU runbook of docs/benchmarks.md ("GPU"), in device calls of under 10 minutes each, run
# from the repository root on the lent machine (device tool `run`, one part per call):
#   bash scripts/gpu_runbook.sh tests   # pytest --gpu: kernels through Triton, scheduler, engine
#   bash scripts/gpu_runbook.sh bench   # Qwen3-0.6B shape, 256 sequences, vs transformers (>= 10x?)
#   bash scripts/gpu_runbook.sh extra   # async scheduling off, host overhead on/off, attention
# Each part writes its log (and JSON where the script has it) to $OUT, the folder the device tool
# brings back (default /tmp/gpu_runbook); every step has its own time limit, so a hang costs only
# that step. `MINIVLLM_RUNBOOK_SCALE=small` shrinks every workload (a CPU smoke run of this file).
set -uo pipefail

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"  # the device image has the packages, not this one
out=${OUT:-/tmp/gpu_runbook}
mkdir -p "$out"
small=${MINIVLLM_RUNBOOK_SCALE:-}

step() {  # step SECONDS LOG CMD...: run CMD under a time limit, its output appended to $out/LOG
    local limit=$1 log=$2
    shift 2
    echo "== $(date -u +%H:%M:%S) $*" | tee -a "$out/$log"
    timeout "$limit" "$@" >>"$out/$log" 2>&1
    local rc=$?
    echo "== rc=$rc" | tee -a "$out/$log"
    tail -n 15 "$out/$log"
}

if [[ -n $small ]]; then
    qwen=(--model llama-tiny --num-seqs 4 --input-len 8 24 --output-len 4 6 --dtype float32)
    tiny=(--model llama-tiny --num-seqs 8 --max-num-seqs 8 --input-len 8 16 --output-len 4 4
          --dtype float32 --max-num-batched-tokens 64 --repeat 1)
    attention=(--small --iters 1)
else
    qwen=(--model qwen3-0.6b --dtype bfloat16 --num-seqs 256 --input-len 100 1024
          --output-len 100 1024)
    tiny=(--model llama-tiny --num-seqs 256 --max-num-seqs 256 --input-len 16 48 --output-len 64 64
          --dtype float32 --max-num-batched-tokens 2048 --repeat 3)
    attention=()
fi

case "${1:-}" in
    tests)
        python -c "import jax; print(jax.__version__, jax.devices())" | tee "$out/tests.log"
        step 540 tests.log python -m pytest -q -rfEs --gpu tests/kernels tests/scheduler tests/engine
        ;;
    bench)
        step 570 bench.log python scripts/bench.py "${qwen[@]}" --compare-hf --async-scheduling on \
            --json "$out/gpu.json"
        ;;
    extra)
        step 200 extra.log python scripts/bench.py "${qwen[@]}" --async-scheduling off --json "$out/gpu.json"
        for mode in off on; do
            step 90 extra.log python scripts/bench.py "${tiny[@]}" --async-scheduling "$mode" \
                --json "$out/host.json"
        done
        step 150 extra.log python scripts/bench_attention.py "${attention[@]}" --json "$out/attention.json"
        ;;
    *)
        echo "usage: bash scripts/gpu_runbook.sh tests|bench|extra" >&2
        exit 2
        ;;
esac
