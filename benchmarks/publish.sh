#!/usr/bin/env bash
# The sharded publish on the GPT-OSS slice (issue 32; docs/benchmarks.md "Sharded publish"). From the
# repository root, on one host with 2 GPUs:
#     bash benchmarks/publish.sh OUT_DIR
# Installs this checkout plus the pyzmq, msgspec and megatron-core wheels in .whl/ into /tmp/site (as
# benchmarks/gpu2.sh; NO_INSTALL=1 skips it), then runs benchmarks/megatron_layouts.py --publish 3 on
# --arch gptoss-slice (GPT-OSS-20B's shapes, 2 layers, 2.8B parameters, 5.6 GB bf16) as 1 GPU, EP2 and TP2:
# per layout the train step, today's gathered path to rank 0 (gather s: the "before"), the sharded
# publish alone (the first versions into fresh shared memory, then the steady state once the store recycles
# registered files: publish s, GB/s, and that against a host memory copy measured in the same run) and the
# learner's stall per version with publishing overlapped (stall %, of the train step) and how much slower
# a step runs while a version is written (step slowdown %). Markdown + JSON land in OUT_DIR (OUT_DIR/publish.log
# is everything). LAYOUT_ARGS is appended to the command. On 4 GPUs: benchmarks/gptoss_gpu4.sh.
set -u
REPO=$(pwd)
OUT=$(realpath -m "${1:-runs/bench-publish}")
mkdir -p "$OUT"
if [[ -z ${NO_INSTALL:-} ]]; then
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/pyzmq-*.whl .whl/msgspec-*.whl .whl/megatron_core-*.whl . || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1
cd "$(mktemp -d)" || exit 1
{
    nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
    timeout "${LIMIT:-560}" python3 "$REPO/benchmarks/megatron_layouts.py" --arch gptoss-slice --gpus 2 \
        --layouts 1 ep2 tp2 --groups 16 --samples 8 --prompt 128 --response 384 --steps 5 --warmup 2 \
        --max-tokens 16384 --layout-timeout 180 --publish 3 --out "$OUT" --name gptoss-slice-publish ${LAYOUT_ARGS:-}
} 2>&1 | tee "$OUT/publish.log"
