#!/usr/bin/env bash
# The GPU checks in one run, sized for about 8 minutes on one GPU; writes a report folder.
#
#   scripts/gpu_check.sh [OUT]          (default OUT: docs/bench/<date>-gpu)
#
# 1. the exactness and sampling tests with their services on the GPU;
# 2. `batchspec serve --device cuda` in float32 and in bfloat16, each answering held-out
#    prompts beside the target alone (scripts/serve_check.py): float32 must be exact; in
#    bfloat16 a batch rounds apart from one request alone, so its count is for reading;
# 3. `batchspec bench --overhead` on the GPU (a step's fixed cost, stage by stage: plain, drafted
#    one round a command and four, plain steps);
# 4. the default server against `--draft-model none` at 1, 8 and 32 closed-loop clients.
#
# Every part has its own time limit and runs whatever the one before it gave; the summary
# says what passed. GPU_CHECK_DEVICE=cpu GPU_CHECK_QUICK=1 rehearses the script on a CPU (a
# few prompts, one client count), which is how it is checked where no GPU is.
set -uo pipefail
cd "$(dirname "$0")/.."
DEVICE=${GPU_CHECK_DEVICE:-cuda}
OUT=${1:-docs/bench/$(date -u +%F)-gpu}
if [ -n "${GPU_CHECK_QUICK:-}" ]; then
    PROMPTS=4 CLIENTS=1 TOKENS=32 TESTS=tests/test_exactness.py
else
    PROMPTS=32 CLIENTS=1,8,32 TOKENS=48
    TESTS="tests/test_exactness.py tests/test_feature_draft.py tests/test_sampling_e2e.py tests/test_sampling_kinds.py"
fi
mkdir -p "$OUT"
SUMMARY="$OUT/summary.md"
: > "$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }
# run NAME LIMIT_S COMMAND...: the command's output in OUT/NAME.txt, its outcome in the summary
run() {
    local name=$1 limit=$2
    shift 2
    local started=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
    local rc=$?
    say "- $name: $([ $rc -eq 0 ] && echo passed || echo "FAILED (exit $rc)") in $((SECONDS - started)) s; \`$*\`"
    return $rc
}

say "# GPU check ($(date -u +%FT%TZ), device $DEVICE)"
say ""
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null \
    || echo "no nvidia-smi"; lscpu | grep -m1 "Model name"; nproc; \
  python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"; } \
    > "$OUT/machine.txt" 2>&1
say "machine: $(tr '\n' ';' < "$OUT/machine.txt")"
say ""

run tests 240 env BATCHSPEC_TEST_DEVICE="$DEVICE" python3 -m pytest -q -x -p no:cacheprovider $TESTS

for dtype in float32 bfloat16; do
    port=$(python3 -c "from batchspec_tools.processes import free_port; print(free_port())")
    batchspec serve --device "$DEVICE" --dtype "$dtype" --port "$port" > "$OUT/serve-$dtype.log" 2>&1 &
    server=$!
    if [ "$dtype" = float32 ]; then  # must be exact
        run "serve-$dtype" 180 python3 scripts/serve_check.py --port "$port" \
            --device "$DEVICE" --dtype "$dtype" --num-prompts 16
    else  # a batch rounds apart from one request alone: a count, passed when it is one
        run "serve-$dtype" 180 bash -c \
            'python3 scripts/serve_check.py "$@" | tee /dev/stderr | grep -q "^exact:"' _ \
            --port "$port" --device "$DEVICE" --dtype "$dtype" --num-prompts 8
    fi
    say "  $(grep -h "^exact:" "$OUT/serve-$dtype.txt" || echo "no answer")"
    kill -TERM "$server" 2>/dev/null
    wait "$server" 2>/dev/null
done

run overhead 150 batchspec bench --overhead --device "$DEVICE" --out "$OUT/overhead"

run served 300 batchspec bench --device "$DEVICE" --prompts docs/bench/heldout_prompts.jsonl \
    --num-prompts "$PROMPTS" --max-new-tokens "$TOKENS" --methods grpc_router,grpc_target_only \
    --concurrency "$CLIENTS" --out "$OUT/served"

say ""
for report in "$OUT/overhead/results.md" "$OUT/served/results.md"; do
    # the overhead table, and the closed-loop table of the served sweep (each to its blank line)
    [ -f "$report" ] && { awk '/^\| (step|method) \| clients \| (tokens a step|tok\/s)/ {on = 1}
        on && /^$/ {on = 0} on' "$report" >> "$SUMMARY"; say ""; }
done
echo "report: $OUT"
