#!/usr/bin/env bash
# Pack vLLM 0.26.0 (CUDA 13, torch 2.11: the lent GPU machines' own torch) and the packages it needs beyond the GPU
# image's into parts small enough for a device call (docs/vllm.md "On the lent GPUs"). From the repository root:
#     bash deploy/gpu/pack-vllm.sh [PARTS_DIR=.gpu]
# 1. deploy/gpu/wheel_closure.py fetches vllm==0.26.0 and, by name, every requirement the image (gpu-image-pip.txt,
#    its `pip list --format=freeze`) lacks, for CPython 3.12 on manylinux x86_64; SKIP leaves out what no text model
#    on Hopper imports: video decoding (torchcodec, PyNvVideoCodec), the DeepSeek sparse-attention / MLA kernels
#    (tilelang, tokenspeed-mla), CuTe-DSL kernels for Blackwell (nvidia-cutlass-dsl, quack-kernels) and
#    humming-kernels;
# 2. pip installs them all (--no-deps) into one site directory, then drops FlashAttention 2's library (305 MB:
#    Hopper runs FA3), the Blackwell FMHA sources and DeepGEMM's builds for Pythons other than 3.12;
# 3. tar | zstd -19 --long=27 (168 MB), split into 56 MiB parts PARTS_DIR/vllm.part0.. (a call carries 64 MiB with
#    the repository), plus the zstandard wheel (the GPU image has no zstd binary). deploy/gpu/vllm.sh puts them together on the GPU machine.
set -eu
PARTS=${1:-.gpu}
SKIP=${SKIP:-torchcodec,pynvvideocodec,tilelang,tokenspeed-mla,nvidia-cutlass-dsl,quack-kernels,humming-kernels}
WORK=${WORK:-$(mktemp -d)}
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$WORK/wheels" "$PARTS"
echo "vllm==0.26.0" > "$WORK/req.txt"
python3 "$HERE/wheel_closure.py" --have "$HERE/gpu-image-pip.txt" --req "$WORK/req.txt" --skip "$SKIP" \
    --dest "$WORK/wheels"
rm -rf "$WORK/site"
python3 -m pip install -q --no-deps --no-compile --target "$WORK/site" --python-version 3.12 --implementation cp \
    --only-binary=:all: --abi cp312 --abi abi3 --abi none $(for p in manylinux_2_34_x86_64 manylinux_2_31_x86_64 \
    manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
    manylinux2014_x86_64 manylinux1_x86_64 any; do echo --platform $p; done) "$WORK"/wheels/*.whl
rm -f "$WORK/site/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so"
rm -rf "$WORK/site/vllm/third_party/fmha_sm100" "$WORK"/site/vllm/third_party/deep_gemm/_C.cpython-31[34]-*
echo "site: $(du -sh "$WORK/site" | cut -f1)"
rm -f "$PARTS"/vllm.part*
tar -C "$WORK/site" -cf - . | zstd -T0 -19 --long=27 -q -o "$WORK/vllm-site.tar.zst"
split -b 56M -d -a 1 "$WORK/vllm-site.tar.zst" "$PARTS/vllm.part"
sha256sum "$WORK/vllm-site.tar.zst" | cut -d' ' -f1 > "$PARTS/vllm.sha256"
# the GPU image has no zstd binary: its Python decompresses with this wheel (carry it with the last part)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
    --platform manylinux2014_x86_64 -d "$PARTS" zstandard
ls -l "$PARTS"/vllm.*
