#!/usr/bin/env bash
# The fidelity grids on the device: each cell planned once and run for 5 steps (the first
# 2 dropped) beside its profiled prediction. One `dataflow measure` per sequence length
# and T_round, so a command stopped by its limit loses only its own cells:
#
#   bash benchmarks/fidelity.sh 1024        # T_round 16384, 65536, 32768 at seq 1024
#   bash benchmarks/fidelity.sh 4096
#   PRESET=l3_1b bash benchmarks/fidelity.sh 4096   # issue 15's: T_round 16384, 32768
#   python -m benchmarks.fidelity_merge [benchmarks/results/fidelity.json] OUT/fidelity_*.json
#
# gpt2_124m (issue 14's grid, the default): 524,288 tokens a step, budgets 16, 8, 4 and 2
# GiB, 16 GiB of pinned backing, round order. l3_1b (issue 15's): 131,072 tokens a step,
# budgets 4 and 8 GiB by layer (its throughput row's order and, with bf16 AdamW moments,
# its policy: with float32 ones the embedding's update alone needs 2.94 GiB and 4 GiB
# cannot be planned, session 22), 64 GiB of backing. T_ROUNDS, STATES,
# BUDGETS, ORDER and BACKING override them, CELL_SECONDS each command's limit (default
# 170 s; l3_1b's 280 s: its compiled tasks' setup took about 100 s in its throughput row),
# RESOLVER the resolver (default auto: torch-compiled on CUDA, what `dataflow train`
# runs; gpt2's rows of 2026-12-04 ran on the eager `torch` one, before measure had
# --resolver). The profile cache starts from results/profiles_<group>.tgz and is copied
# to $OUT. fidelity_merge.py given the committed results/fidelity.json first keeps its
# rows beside the new ones. SMOKE=1 runs the same commands on the CPU at the tiny presets
# (gpt2_tiny, llama3_tiny; seq 32, 4 MiB) into /tmp, so nothing fails on the device for a
# typo.
set -u
seq_len=${1:?usage: fidelity.sh SEQ_LEN}
preset=${PRESET:-gpt2_124m}
case $preset in
gpt2_124m)
    group=gpt2 rounds="16384 65536 32768" tokens=524288 budgets=16,8,4,2 order=round
    backing=16 seconds=170 prefix=fidelity states=fp32 ;;  # the file names of before
l3_1b)
    group=l3_1b rounds="16384 32768" tokens=131072 budgets=4,8 order=layer backing=64
    seconds=280 prefix=fidelity_l3_1b states=bf16 ;;
*) echo "fidelity.sh: PRESET '$preset': gpt2_124m or l3_1b" >&2; exit 2 ;;
esac
out=${OUT:-/tmp}
measured=$preset device=()
if [ "${SMOKE:-0}" = 1 ]; then
    measured=${preset/%_124m/_tiny} measured=${measured/#l3_1b/llama3_tiny}
    seq_len=32 rounds=64 tokens=256 budgets=0.004 backing=1 out=/tmp/fidelity_smoke
    device=(--device cpu) group=smoke_$group
    mkdir -p "$out"
fi
cache=/tmp/dataflow_profiles_fidelity_$group
mkdir -p "$cache"
saved=benchmarks/results/profiles_$group.tgz
[ "${SMOKE:-0}" != 1 ] && [ -f "$saved" ] && tar xzf "$saved" -C "$cache"
export DATAFLOW_PROFILE_CACHE=$cache PYTHONUNBUFFERED=1
for t_round in ${T_ROUNDS:-$rounds}; do
    name=${prefix}_${seq_len}_$t_round
    start=$(date +%s)
    timeout "${CELL_SECONDS:-$seconds}" dataflow measure --preset "$measured" --hw h200 \
        --t-round "$t_round" --tokens-step "$tokens" --budget "${BUDGETS:-$budgets}" \
        --seq-len "$seq_len" --order "${ORDER:-$order}" --backing "${BACKING:-$backing}" \
        --optimizer-states "${STATES:-$states}" \
        --steps 5 --warmup 2 --resolver "${RESOLVER:-auto}" "${device[@]}" \
        --json "$out/$name.json" >"$out/$name.log" 2>&1
    echo "$name: rc $? in $(($(date +%s) - start)) s"
    grep -E "^seq .*: [0-9.]+$|cannot|infeasible" "$out/$name.log" | head -8
done
tar czf "$out/profiles_fidelity_$group.tgz" -C "$cache" .
