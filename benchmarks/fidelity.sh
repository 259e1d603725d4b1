#!/usr/bin/env bash
# Issue 14's fidelity grid on the device: gpt2_124m, 524,288 tokens a step, budgets 16, 8,
# 4 and 2 GiB, 16 GiB of pinned backing, each cell planned once and run for 5 steps (the
# first 2 dropped) beside its profiled prediction. One `dataflow measure` per sequence
# length and T_round, so a command stopped by its limit loses only its own cells:
#
#   bash benchmarks/fidelity.sh 1024        # T_round 16384, 65536, 32768 at seq 1024
#   bash benchmarks/fidelity.sh 4096
#   python benchmarks/fidelity_merge.py OUT/fidelity_*.json   # -> results/fidelity.json
#
# T_ROUNDS overrides the T_rounds, CELL_SECONDS each command's limit (default 170 s),
# RESOLVER the resolver (default auto: torch-compiled on CUDA, what `dataflow train` runs;
# the rows of 2026-12-04 ran on the eager `torch` one, before measure had --resolver).
# The profile cache starts from results/profiles_gpt2.tgz and is copied to $OUT.
set -u
seq_len=${1:?usage: fidelity.sh SEQ_LEN}
out=${OUT:-/tmp}
cache=/tmp/dataflow_profiles_fidelity
mkdir -p "$cache"
[ -f benchmarks/results/profiles_gpt2.tgz ] && tar xzf benchmarks/results/profiles_gpt2.tgz -C "$cache"
export DATAFLOW_PROFILE_CACHE=$cache PYTHONUNBUFFERED=1
for t_round in ${T_ROUNDS:-16384 65536 32768}; do
    name=fidelity_${seq_len}_$t_round
    start=$(date +%s)
    timeout "${CELL_SECONDS:-170}" dataflow measure --preset gpt2_124m --hw h200 \
        --t-round "$t_round" --tokens-step 524288 --budget 16,8,4,2 --seq-len "$seq_len" \
        --backing 16 --steps 5 --warmup 2 --resolver "${RESOLVER:-auto}" \
        --json "$out/$name.json" >"$out/$name.log" 2>&1
    echo "$name: rc $? in $(($(date +%s) - start)) s"
    grep -E "^seq .*: [0-9.]+$|cannot|infeasible" "$out/$name.log" | head -8
done
tar czf "$out/profiles_fidelity.tgz" -C "$cache" .
