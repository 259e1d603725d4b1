#!/usr/bin/env bash
# The GPU tests on the device machine: every test marked `gpu` but not `slow`. They take
# more than one device call (600 s): in session 12 the 43 tests outside kernels/ ran past
# 520 s (resolvers/torch's compiled-step tests are most of it), the ~500 kernel tests take
# about 1 s each (15 s on 6 processes in session 17). So the suite runs in parts, each
# within one call (steps took 157 s in session 17; steps and kernels fit one call):
#
#   source benchmarks/device_setup.sh && bash benchmarks/gpu_tests.sh steps          # tests, families, plugins, examples
#   source benchmarks/device_setup.sh && bash benchmarks/gpu_tests.sh resolvers      # resolvers/, dense families
#   source benchmarks/device_setup.sh && bash benchmarks/gpu_tests.sh resolvers-moe  # resolvers/, MoE families
#   source benchmarks/device_setup.sh && bash benchmarks/gpu_tests.sh kernels        # kernels/ only
#
# (no part, or `all`: every part at once; extra arguments go to pytest). The whole log goes to
# $OUT/gpu_tests_<part>.log (or /tmp), with the 25 slowest tests; what is printed is the
# summary and, for each failure, its first error lines, so that a caller keeping only the
# tail of the output still sees why a test failed.
set -u
part=${1:-all}
[ $# -gt 0 ] && shift
steps=(tests families plugins examples/third_party_plugin examples/custom_program)
moe=(-k "olmoe or qwen3_moe")
case $part in
steps) paths=("${steps[@]}") ;;
resolvers) paths=(resolvers -k "not olmoe and not qwen3_moe") ;;
# the compiled MoE steps (fp32 and bf16, olmoe and qwen3_moe): in session 17 the
# resolvers part ran past 390 s with 3 of its 6 tests done, the MoE ones still to come
resolvers-moe) paths=(resolvers "${moe[@]}") ;;
kernels)
    paths=(kernels)
    # the kernel tests are numerical and independent: with pytest-xdist (on the device
    # image) they run on GPU_TESTS_WORKERS processes sharing the GPU. The steps part stays
    # one process: its tests time tasks and links and check allocator peaks
    python -c "import xdist" 2>/dev/null && paths+=(-n "${GPU_TESTS_WORKERS:-4}") ;;
all) paths=("${steps[@]}" resolvers kernels) ;;
*) echo "gpu_tests.sh: unknown part '$part' (steps, resolvers, resolvers-moe, kernels or all)" >&2; exit 2 ;;
esac
log=${OUT:-/tmp}/gpu_tests_$part.log
# unbuffered, each test named as it ends: a part stopped by the timeout leaves in the log
# which tests passed and which one was running (session 17's resolvers log was empty)
PYTHONUNBUFFERED=1 timeout "${GPU_TESTS_SECONDS:-560}" python -m pytest -v -rfE --tb=short -p no:cacheprovider \
    -W ignore::UserWarning --durations=25 -m "gpu and not slow" "${paths[@]}" \
    --ignore=plugins/viewer "$@" >"$log" 2>&1
rc=$?
grep -E "^(FAILED|ERROR) " "$log" | head -20
grep -E "^E  " "$log" | head -30
tail -1 "$log"
[ $rc = 124 ] && echo "gpu_tests.sh: stopped at ${GPU_TESTS_SECONDS:-560} s (timeout); the log has how far it got"
exit $rc
