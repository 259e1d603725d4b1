#!/usr/bin/env bash
# Install this checkout on the GPU device machine (no network): the packages the image
# lacks come as wheels in .whl/ (carried), the project editable without dependencies.
# .whl/ holds flash-linear-attention and fla-core 0.6.0 and einops (the gated delta rule's
# fla variant, registered only where all three and triton import: `pip download
# flash-linear-attention==0.6.0 fla-core==0.6.0 einops --no-deps -d .whl`) and cattrs, which
# the image lacks (KINDS.md's package list; without it nothing of dataflow imports: `pip
# download cattrs --no-deps -d .whl`, session 42; attrs the image has); --no-deps keeps a
# wheel whose other dependencies the image lacks from failing the install. torchao is not
# carried: --lora-base needs none of it (docs/finetuning.md says why its kernels do not fit).
# .whl/optional/ is not installed here: cut_cross_entropy (`pip download cut-cross-entropy
# --no-deps -d .whl/optional`), which model_rows.sh's `large` group installs for its stock
# long-context rows under LONG_CCE=1 alone (not yet run on the device; with it installed
# every stock row's `--stock-ce auto` would take it).
# .tilelang/site.tar.xz (optional, carried only for the Gated DeltaNet rows: fla 0.6 runs its
# gated backward on Hopper with tilelang, under the image's Triton) is built here by
# `bash benchmarks/tilelang_bundle.sh` (tilelang and what it imports, unzipped and packed).
# Sourced (`source benchmarks/device_setup.sh && ...`) for its PYTHONPATH; the install
# runs in a subshell with `set -euo pipefail`, so those options do not leak into the
# caller's command (where a failing test piped into `tail` would end all that follows).
_dataflow_device_setup() (
    set -euo pipefail
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    # tilelang (carried as .tilelang/site.tar.xz, unpacked wheels: the wheels themselves
    # outgrow the carry's 64 MiB) is what fla 0.6 runs its gated backward with on Hopper
    # under the image's Triton (fla's issue #640; kernels/torch's _fla_runs)
    if [ -f .tilelang/site.tar.xz ]; then tar xJf .tilelang/site.tar.xz -C /tmp/site; fi
    export PYTHONPATH=/tmp/site
    args=(-e .)
    for p in families/* resolvers/* kernels/* plugins/* examples/third_party_plugin examples/custom_program examples/rl_training; do [ -f "$p/pyproject.toml" ] && args+=(-e "$p"); done
    python3 -m pip install -q --no-deps --no-build-isolation --no-index "${args[@]}"
    python3 -c "import dataflow, dataflow_training, torch; print('dataflow on', torch.cuda.get_device_name())"
)
_dataflow_device_setup && export PYTHONPATH=/tmp/site
