#!/usr/bin/env bash
# Issue 44's zero-config cells on the device, one call each (under nine minutes):
#
#   bash benchmarks/zero_config.sh gpt2        # gpt2_124m at 16, 4, 1 GiB (H100 or H200)
#   bash benchmarks/zero_config.sh llama3_8b   # llama3_8b at 16, 8 GiB (an H200: stock needs 87 GiB)
#   SMOKE=1 bash benchmarks/zero_config.sh gpt2  # the same pieces on the CPU (gpt2_tiny)
#   bash benchmarks/zero_config.sh gpt2 --budgets 16GiB,4GiB   # some of the cells (a call each)
#
# Each cell runs the plain command, then compare.py's stock and dataflow rows, in the same
# run (benchmarks/zero_config.py). The committed profile archive of the group fills the
# profile cache first, so the search and compare.py time tasks only once; with $OUT set,
# the results and the cache (profiles_zero_config_<group>.tgz) are copied there.
set -u
group=${1:?usage: zero_config.sh gpt2|llama3_8b}
cache=/tmp/dataflow_profiles_zero_$group
export DATAFLOW_PROFILE_CACHE=$cache PYTHONUNBUFFERED=1
saved=benchmarks/results/profiles_$group.tgz
[ -f "$saved" ] && mkdir -p "$cache" && tar xzf "$saved" -C "$cache"
python -m benchmarks.zero_config --cells "$group" "${@:2}" 2>&1 | tee /tmp/zero_config_$group.log
status=${PIPESTATUS[0]}
if [ -n "${OUT:-}" ]; then
    cp benchmarks/results/zero_config.json benchmarks/results/zero_config.md /tmp/zero_config_$group.log "$OUT"/
    # the profiles alone (not the searches/ kept beside them)
    [ -d "$cache" ] && tar czf "$OUT/profiles_zero_config_$group.tgz" -C "$cache" --exclude=./searches .
fi
exit "$status"
