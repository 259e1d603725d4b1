#!/usr/bin/env bash
# The GPU tests on the device machine (about 4 minutes on an H200): every test marked
# `gpu` but not `slow`. The whole log goes to $OUT/gpu_tests.log (or /tmp); what is
# printed is the summary and, for each failure, its first error lines, so that a caller
# keeping only the tail of the output still sees why a test failed.
#
#   source benchmarks/device_setup.sh && bash benchmarks/gpu_tests.sh [extra pytest args]
set -u
log=${OUT:-/tmp}/gpu_tests.log
timeout "${GPU_TESTS_SECONDS:-300}" python -m pytest -q -rfE --tb=short -p no:cacheprovider \
    -W ignore::UserWarning -m "gpu and not slow" tests families plugins resolvers kernels \
    examples/third_party_plugin examples/custom_program --ignore=plugins/viewer "$@" >"$log" 2>&1
rc=$?
grep -E "^(FAILED|ERROR) " "$log" | head -20
grep -E "^E  " "$log" | head -30
tail -1 "$log"
exit $rc
