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
# PUBLISH_GPUS (2) and PUBLISH_LAYOUTS ("1 ep2 tp2") pick the layouts (one GPU: PUBLISH_GPUS=1 PUBLISH_LAYOUTS=1);
# FORMATS ("native") runs them once per version format (fp8, mxfp4: weights.formats=[FMT], each rank quantizing its
# own shards; fp8 in FP8_BLOCK blocks, [64,64], what vLLM serves for GPT-OSS); BASE (a folder holding an older
# checkout's `offpolicy`, e.g. `git archive COMMIT offpolicy | tar -x -C .before`) adds a "before" run of the native
# format with that package, same script and batch.
set -u
REPO=$(pwd)
OUT=$(realpath -m "${1:-runs/bench-publish}")
mkdir -p "$OUT"
BASE=${BASE:+$(realpath "$BASE")}
if [[ -z ${NO_INSTALL:-} ]]; then
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/pyzmq-*.whl .whl/msgspec-*.whl .whl/megatron_core-*.whl . || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1
cd "$(mktemp -d)" || exit 1
{
    nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
    layouts() {  # NAME ARGS...: the layouts once
        local name=$1; shift
        echo "== $name at ${SECONDS}s: $*"
        timeout "${LIMIT:-560}" python3 "$REPO/benchmarks/megatron_layouts.py" --arch gptoss-slice --gpus "${PUBLISH_GPUS:-2}" \
            --layouts ${PUBLISH_LAYOUTS:-1 ep2 tp2} --groups 16 --samples 8 --prompt 128 --response 384 --steps 5 \
            --warmup 2 --max-tokens 16384 --layout-timeout 180 --publish 3 --out "$OUT" --name "$name" "$@" ${LAYOUT_ARGS:-}
    }
    if [[ -n ${BASE:-} ]]; then
        PYTHONPATH=$BASE:${PYTHONPATH:-} layouts gptoss-slice-publish-before
    fi
    for fmt in ${FORMATS:-native}; do
        case $fmt in
            native) layouts gptoss-slice-publish ;;
            fp8) layouts gptoss-slice-publish-fp8 --set "weights.formats=[fp8]" --set "weights.fp8_block_size=${FP8_BLOCK:-[64,64]}" ;;
            *) layouts "gptoss-slice-publish-$fmt" --set "weights.formats=[$fmt]" ;;
        esac
    done
} 2>&1 | tee "$OUT/publish.log"
