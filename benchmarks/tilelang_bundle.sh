#!/usr/bin/env bash
# Build .tilelang/site.tar.xz, the tilelang that fla 0.6 runs its gated delta rule's
# backward with on Hopper under the device image's Triton (fla's issue #640; without it fla
# raises at the first backward and kernels/torch registers no fla variant). Run here, on a
# machine with the package index; carry .tilelang to the device beside .whl, where
# benchmarks/device_setup.sh unpacks it into /tmp/site.
#
# The wheels themselves (tilelang alone is 50 MB) outgrow what one device call carries
# (64 MiB with the working tree), so they are unzipped into one folder, the sources
# tilelang's JIT does not read are left out (tvm's and cutlass's C++ sources and tools,
# the templates of non-CUDA backends, z3's command-line binary) and the folder is packed
# with xz: 35.7 MB for tilelang 0.1.15.
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
# tilelang's own requirements the device image lacks (its METADATA's Requires-Dist; the
# image has numpy, ml-dtypes, psutil, typing-extensions and torch)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 -d "$work/wheels" \
    tilelang==0.1.15 "apache-tvm-ffi>=0.1.11,<0.1.13" torch-c-dlpack-ext \
    "z3-solver>=4.13.0,<4.15.5" cloudpickle tqdm
mkdir "$work/site"
for wheel in "$work"/wheels/*.whl; do unzip -q -o "$wheel" -d "$work/site"; done
rm -rf "$work"/site/z3_solver-*.data "$work"/site/tilelang/3rdparty/tvm/src \
    "$work"/site/tilelang/3rdparty/cutlass/tools "$work"/site/tilelang/src/{ascend,rocm,metal}
mkdir -p .tilelang
tar cf - -C "$work/site" . | xz -9 -T0 > .tilelang/site.tar.xz
ls -l .tilelang/site.tar.xz
