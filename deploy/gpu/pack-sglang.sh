#!/usr/bin/env bash
# Pack SGLang 0.5.14 (CUDA 13, pins torch 2.11: the lent GPU machines' own torch; 0.5.23 pins torch 2.14.1) and the
# packages it needs beyond the GPU image's into parts small enough for a device call (docs/sglang.md "On the lent
# GPUs"): 368 MB unpacked, 55 MiB packed, one part. From the repository root:
#     bash deploy/gpu/pack-sglang.sh [PARTS_DIR=.gpu]        # FA3=1 keeps FlashAttention 3 (see 3.)
# 1. deploy/gpu/wheel_closure.py fetches what REQ names and, by name, every requirement the image (gpu-image-pip.txt)
#    lacks, for CPython 3.12 on manylinux x86_64. REQ: sglang==0.5.14; jsonschema and dill, which sglang imports at
#    the top of modules every server loads (entrypoints/openai/serving_chat.py, sampling/custom_logit_processor.py)
#    without requiring them (mistral-common and datasets bring them, both left out below); transformers==5.8.1 and
#    tokenizers==0.22.2: sglang pins 5.8.1 and patches transformers' internals by version
#    (srt/utils/hf_transformers_patches.py), and the image's 5.17 lacks names sglang's Pixtral and Qwen2.5-VL code
#    imports. 5.8.1 travels in the site directory, so only processes with it on PYTHONPATH (the servers, in-process
#    engines) see it, with a tokenizers it accepts at import (<=0.23.0, not on PyPI: 0.22.2; the image's 0.23.2
#    would fail transformers' import-time version check).
# 2. SKIP leaves out what neither a server's imports on Hopper nor our models (a Llama; GPT-OSS in bf16 and MXFP4;
#    token ids in and out, skip_tokenizer_init) use, each checked in the 0.5.14 source (imported in a function, or
#    behind try / a find_spec check / an option we do not set):
#      torchcodec (video), tilelang + z3-solver and tokenspeed-mla + tokenspeed-triton (DeepSeek MLA / sparse
#      attention), flash-attn-4, nvidia-cutlass-dsl and quack-kernels (CuTe-DSL kernels: FA4 and Blackwell),
#      flashinfer-cubin (447 MB of prebuilt trtllm-gen cubins for sm100/sm103 and DeepGEMM's; flashinfer compiles
#      what Hopper needs with the image's nvcc), nvidia-cudnn-frontend (flashinfer's cuDNN attention, imported under
#      try), nvidia-mathdx (headers for the EP load balancer's solver), cuda-python (a metapackage: the image has
#      cuda-bindings), kernels (FA3 from the Hugging Face hub; sglang takes sgl-kernel's by default), torchao
#      (--torchao-config), datasets (benchmarks), modelscope (SGLANG_USE_MODELSCOPE), anthropic (the frontend
#      language's backend), mistral-common and blobfile (tokenizers), outlines and llguidance (grammar backends
#      other than the default xgrammar), smg-grpc-servicer (gRPC mode), jedi (IPython's completer imports it on
#      first use; sglang.utils imports IPython.display at the top, so IPython stays);
# 3. installs them all (--no-deps) into one site directory, then drops what Hopper never loads: from sglang-kernel
#    flash_ops.abi3.so (1.76 GB: FlashAttention 3, imported only by sgl_kernel.flash_attn, which sglang imports only
#    for --attention-backend fa3, Hopper's default: so launch with --attention-backend triton; FA3=1 keeps it, for
#    roughly 500 MB more packed: its wheel alone is 615 MB), flashmla_ops.abi3.so (DeepSeek FlashMLA) and
#    sm100/common_ops (sgl_kernel loads sm90/ on compute capability 9.0, sm100/ on any other); triton_kernels (the
#    MXFP4 MoE for GPT-OSS on Hopper) stays; and xgrammar's static library lib/libxgrammar.a (62 MB, for linking
#    C++ against it; Python loads its bindings);
# 4. deploy/gpu/pack-parts.sh: tar | zstd -19 --long=27, 56 MiB parts PARTS_DIR/sglang.part0.., sglang.sha256 and
#    the zstandard wheel. deploy/gpu/server.sh sglang stash | install | smoke puts them together on the GPU machine.
set -eu
PARTS=${1:-.gpu}
SKIP=${SKIP:-torchcodec,tilelang,tokenspeed-mla,flash-attn-4,nvidia-cutlass-dsl,quack-kernels,flashinfer-cubin,\
nvidia-cudnn-frontend,nvidia-mathdx,cuda-python,kernels,torchao,datasets,modelscope,anthropic,mistral-common,blobfile,\
outlines,llguidance,smg-grpc-servicer,jedi}
REQ="sglang==0.5.14 jsonschema dill transformers==5.8.1 tokenizers==0.22.2"
WORK=${WORK:-$(mktemp -d)}
HERE=$(cd "$(dirname "$0")" && pwd)
rm -rf "$WORK/site"
# shellcheck disable=SC2086
python3 "$HERE/wheel_closure.py" --have "$HERE/gpu-image-pip.txt" --skip "$SKIP" --dest "$WORK/wheels" \
    --site "$WORK/site" $REQ
K=$WORK/site/sgl_kernel
[[ ${FA3:-0} == 1 ]] || rm -f "$K/flash_ops.abi3.so"
rm -rf "$K/flashmla_ops.abi3.so" "$K/sm100" "$WORK/site/xgrammar/lib"
bash "$HERE/pack-parts.sh" "$WORK/site" sglang "$PARTS"
