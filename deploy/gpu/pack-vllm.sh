#!/usr/bin/env bash
# Pack vLLM 0.26.0 (CUDA 13, torch 2.11: the lent GPU machines' own torch) and the packages it needs beyond the GPU
# image's into parts small enough for a device call (docs/vllm.md "On the lent GPUs"). From the repository root:
#     bash deploy/gpu/pack-vllm.sh [PARTS_DIR=.gpu]
# 1. deploy/gpu/wheel_closure.py fetches vllm==0.26.0 and, by name, every requirement the image (gpu-image-pip.txt,
#    its `pip list --format=freeze`) lacks, for CPython 3.12 on manylinux x86_64; SKIP leaves out what no text model
#    on Hopper imports: video decoding (torchcodec, PyNvVideoCodec), the DeepSeek sparse-attention / MLA kernels
#    (tilelang, tokenspeed-mla), CuTe-DSL kernels for Blackwell (nvidia-cutlass-dsl, quack-kernels) and
#    humming-kernels; and the extras of vllm's fastapi[standard] (its CLI, e-mail validation, settings, fastar;
#    uvicorn's httptools, websockets, dotenv), which the closure did not follow before it followed extras: so the
#    same 76 wheels that ran on the H100;
# 2. installs them all (--no-deps) into one site directory (wheel_closure.py --site: PLATFORMS there is the one list
#    of the target's platform tags), then drops FlashAttention 2's library (305 MB: Hopper runs FA3), the Blackwell
#    FMHA sources and DeepGEMM's builds for Pythons other than 3.12;
# 3. deploy/gpu/pack-parts.sh: tar | zstd -19 --long=27 (168 MB), split into 56 MiB parts PARTS_DIR/vllm.part0.. (a
#    call carries 64 MiB with the repository), plus the zstandard wheel (the GPU image has no zstd binary).
#    deploy/gpu/vllm.sh (deploy/gpu/server.sh vllm) puts them together on the GPU machine.
set -eu
PARTS=${1:-.gpu}
SKIP=${SKIP:-torchcodec,pynvvideocodec,tilelang,tokenspeed-mla,nvidia-cutlass-dsl,quack-kernels,humming-kernels,\
fastapi-cli,email-validator,pydantic-settings,fastar,httptools,websockets,python-dotenv}
WORK=${WORK:-$(mktemp -d)}
HERE=$(cd "$(dirname "$0")" && pwd)
# vllm pins apache-tvm-ffi 0.1.10 and fastapi[standard] <0.137, but its xgrammar 0.2.8 and nvidia-cudnn-frontend ask
# apache-tvm-ffi >= 0.1.11: these are the versions that ran on the H100 (an older wheel_closure.py took whichever
# version came first, past those pins)
printf '%s\n' vllm==0.26.0 apache-tvm-ffi==0.1.15.post2 fastapi==0.165.0 > "$WORK/req.txt"
rm -rf "$WORK/site"
python3 "$HERE/wheel_closure.py" --have "$HERE/gpu-image-pip.txt" --req "$WORK/req.txt" --skip "$SKIP" \
    --dest "$WORK/wheels" --site "$WORK/site"
rm -f "$WORK/site/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so"
rm -rf "$WORK/site/vllm/third_party/fmha_sm100" "$WORK"/site/vllm/third_party/deep_gemm/_C.cpython-31[34]-*
bash "$HERE/pack-parts.sh" "$WORK/site" vllm "$PARTS"
