#!/usr/bin/env bash
# One GPU session's checks, as docs/cuda.md records them: the CUDA tier (`make test-cuda`'s
# pytest line, spread over xdist workers, each test named in the log) and then the CUDA bench
# (`attnkit bench --device cuda`'s default rows, in four invocations so that one slow group
# cannot take the others' results). The tier runs first and alone: beside it, its test
# processes share the GPU with the bench's timed calls (docs/cuda.md, the first GPU run).
#
# For a machine whose python3 already has a CUDA build of torch (a device machine of this
# workplace: no registry, so no venv; attnkit runs from src/). Everything goes to $OUT:
#   machine.txt   the GPU, torch, triton, transformers, `attnkit doctor`
#   test-cuda.log the tier's pytest output (durations, skips with reasons), its exit status
#   bench.log     the bench's tables as printed; bench.md, bench.jsonl what it wrote
# Each part has its own time limit (TEST_S, BENCH_S seconds), so the whole ends on time; the
# tier's compiles take longer than one 15-minute device session allows, so pick a part with
# CUDA_ARGS (e.g. CUDA_ARGS='-k torch.bfloat16'); NO_BENCH=1 leaves the bench out.
set -u
OUT=${OUT:-/tmp/attnkit-cuda}
PY=${PY:-python3}
JOBS=${JOBS-12}  # xdist workers (the device image has pytest-xdist); empty: none
mkdir -p "$OUT"
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src" PYTHONUNBUFFERED=1

{
    date -u
    nvidia-smi -L
    $PY -c 'import torch, triton, transformers, sys; print(sys.version.split()[0], "torch",
torch.__version__, "cuda", torch.version.cuda, "triton", triton.__version__, "transformers",
transformers.__version__, torch.cuda.get_device_name(), torch.cuda.get_device_capability())'
    $PY -m attnkit doctor
} >"$OUT/machine.txt" 2>&1

timeout "${TEST_S:-300}" $PY -m pytest -v -rs -rfE --tb=short --durations=25 -p no:benchmark \
    -m cuda tests/cuda ${JOBS:+-n "$JOBS"} ${CUDA_ARGS:-} >"$OUT/test-cuda.log" 2>&1
echo "exit status $?" >>"$OUT/test-cuda.log"

deadline=$(($(date +%s) + ${BENCH_S:-300}))
bench() {  # one invocation of the bench over some of its default rows, within the deadline
    left=$((deadline - $(date +%s)))
    if [ "$left" -le 10 ]; then echo "not run, no time left: $*" >>"$OUT/bench.log"; return; fi
    timeout "$left" $PY -m attnkit bench --device cuda "$@" \
        --json "$OUT/part.json" --markdown "$OUT/part.md" >>"$OUT/bench.log" 2>&1
    echo "exit status $? ($*)" >>"$OUT/bench.log"
    if [ -f "$OUT/part.json" ]; then tr -d '\n' <"$OUT/part.json" >>"$OUT/bench.jsonl"; echo >>"$OUT/bench.jsonl"; fi
    if [ -f "$OUT/part.md" ]; then cat "$OUT/part.md" >>"$OUT/bench.md"; fi
    rm -f "$OUT/part.json" "$OUT/part.md"
}
if [ -z "${NO_BENCH:-}" ]; then
    start=$(date +%s)
    $PY -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' || echo "no GPU" >>"$OUT/bench.log"
    bench -w gqa -L 16384 --dtype bfloat16 --dtype float32 --mode fwd
    bench -w causal -L 16384 --dtype bfloat16 --mode fwd --mode fwd+bwd
    bench -w dense -L 16384 --dtype bfloat16 --mode fwd
    bench -w window -w document -L 16384 -L 32768 --dtype bfloat16 --mode fwd --mode fwd+bwd
    echo "bench took $(($(date +%s) - start)) s" >>"$OUT/bench.log"
fi
