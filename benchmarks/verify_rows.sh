#!/usr/bin/env bash
# Issue 15's `dataflow verify` on the device: Llama 3.2 1B (l3_1b) and Qwen 3 0.6B
# (qwen3_0_6b) in bf16 on CUDA, ops, tasks and whole steps against each family's plain
# autograd reference (tiny presets run on the CPU in CI). One call:
#
#   source benchmarks/device_setup.sh && bash benchmarks/verify_rows.sh
#
# Each report goes to $OUT/verify_<preset>_bf16_cuda.txt (or /tmp), every check with its
# yardstick to verify_<preset>_bf16_cuda_checks.json beside it; commit them under
# benchmarks/results/ beside gpt2_124m's. VERIFY_ONLY=PRESET runs one preset;
# DATAFLOW_KERNELS (docs/kernel_registry.md) pins kernel variants, e.g.
# DATAFLOW_KERNELS=attention_fwd=torch,attention_bwd=torch for the flash pair. Each preset has
# VERIFY_SECONDS (default 240) before it is stopped; the exit status is the first failing
# preset's. ATTENTION_PAIRS=torch,reference then verifies each preset's whole steps again
# (--levels step) with each named attention pair pinned (attention_fwd=P,attention_bwd=P),
# into verify_<preset>_bf16_<device>_attention-<P>.txt and its _checks.json: which pair
# loses the gradients' precision, in the same call. VERIFY_RESOLVER=auto runs the step
# level's engine as `dataflow train` does on the device (torch-compiled; default: torch,
# eager), its reports named ..._auto.txt. VERIFY_STEPS=N compares N steps (default 3).
# SMOKE=1 runs the tiny presets on the CPU instead, so a typo fails here first.
set -u
out=${OUT:-/tmp}
ATTENTION_PAIRS=${ATTENTION_PAIRS:-}
resolver=${VERIFY_RESOLVER:-torch}
suffix=""
[ "$resolver" != torch ] && suffix=_$resolver
# VERIFY_SET=qwen3_5: issue 46's cut presets (qwen3_5_cut, qwen3_5_moe_cut) instead
if [ "${SMOKE:-0}" = 1 ] && [ "${VERIFY_SET:-}" = qwen3_5 ]; then
    runs=("qwen3_5 qwen3_5_tiny cpu" "qwen3_5_moe qwen3_5_moe_tiny cpu")
elif [ "${SMOKE:-0}" = 1 ]; then
    runs=("llama3 llama3_tiny cpu" "qwen3 qwen3_tiny cpu")
elif [ "${VERIFY_SET:-}" = qwen3_5 ]; then
    # the step level's float64 reference (weights, gradients, AdamW moments and each
    # step's returned gradients and weights: 48 bytes a parameter at least, on the host)
    # of the dense cut's 2.9B parameters is 139 GB, of the MoE cut's 4.38B 210 GB, more
    # than the device machine's 128 GiB host (verify refuses it; session 41's dense run
    # was killed after 4 minutes): their ops and tasks alone (VERIFY_CUT_LEVELS)
    # their tiny presets run the whole ladder on CUDA beside them: whole steps through
    # the device's kernels (fla's gated delta rule, grouped GEMMs) against float64
    levels=${VERIFY_CUT_LEVELS:-op,task}
    runs=("qwen3_5 qwen3_5_cut cuda $levels" "qwen3_5_moe qwen3_5_moe_cut cuda $levels"
        "qwen3_5 qwen3_5_tiny cuda" "qwen3_5_moe qwen3_5_moe_tiny cuda")
else
    runs=("llama3 l3_1b cuda" "qwen3 qwen3_0_6b cuda")
fi
# verify REPORT WHAT ARGS...: one `dataflow verify` of $family/$preset into REPORT (and its
# _checks.json), its summary printed; its exit status is the command's
verify() {
    local report=$1 what=$2 started=$SECONDS rc
    shift 2
    timeout "${VERIFY_SECONDS:-240}" dataflow verify --family "$family" --preset "$preset" \
        --device "$device" --dtype bf16 --resolver "$resolver" \
        --json "${report%.txt}_checks.json" ${VERIFY_STEPS:+--steps "$VERIFY_STEPS"} "$@" \
        >"$report" 2>&1
    rc=$?
    echo "verify $preset bf16 on $device$what: exit $rc in $((SECONDS - started)) s ($report)"
    grep -E "checks, .* passed|FAIL|fail" "$report" | head -8
    [ $rc = 124 ] && echo "verify_rows.sh: $preset stopped at ${VERIFY_SECONDS:-240} s"
    return $rc
}
status=0
for run in "${runs[@]}"; do
    read -r family preset device levels <<<"$run"
    # VERIFY_ONLY=PRESET runs that preset alone
    [ -n "${VERIFY_ONLY:-}" ] && [ "$preset" != "$VERIFY_ONLY" ] && continue
    report=$out/verify_${preset}_bf16_$device$suffix.txt
    verify "$report" "" ${levels:+--levels "$levels"}
    rc=$?
    [ $status = 0 ] && status=$rc
    for pair in ${ATTENTION_PAIRS//,/ }; do
        DATAFLOW_KERNELS=attention_fwd=$pair,attention_bwd=$pair \
            verify "${report%.txt}_attention-$pair.txt" ", attention $pair" --levels step
    done
done
exit $status
