#!/usr/bin/env bash
# Learner start-up on 1 and 2 GPUs (docs/megatron.md "Start-up"). From the repository root, on one host with
# 2 GPUs:
#     bash benchmarks/startup_gpu.sh OUT_DIR [after] [mxfp4] [before]     (default: after mxfp4)
#   after:  benchmarks/megatron_layouts.py --arch gptoss-slice, layouts 1, EP2 and TP2 (`ready s`: build and load);
#   mxfp4:  benchmarks/startup.py --make a 12-layer GPT-OSS-20B-shaped MXFP4 checkpoint (random weights) in
#           /tmp, the learner started from it by 2 ranks with EP2, then `offpolicy verify --ep 2` of it;
#   before: the same layouts (1 and EP2) with the code in .before/ (an older checkout: `git archive REV
#           offpolicy services benchmarks tests | tar -x -C .before`), for the before/after table.
# Installs this checkout and the pyzmq, msgspec and megatron-core wheels in .whl/ into /tmp/site (as gpu2.sh).
# Every part runs under `timeout`; logs and JSON land in OUT_DIR (OUT_DIR/startup.log is everything).
set -u
REPO=$(pwd)
OUT=$(realpath -m "${1:-runs/startup-gpu}")
shift
WANT=" ${*:-after mxfp4} "
mkdir -p "$OUT"
if [[ ! -d /tmp/site/offpolicy ]]; then
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/pyzmq-*.whl .whl/msgspec-*.whl .whl/megatron_core-*.whl . || exit 1
fi
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
LAYOUT=(--arch gptoss-slice --gpus 2 --groups 8 --samples 8 --prompt 128 --response 384 --steps 3 --warmup 1
        --max-tokens 16384)
{
    nvidia-smi --query-gpu=index,name,memory.total --format=csv; nproc; free -g | head -2
    python3 -c 'import torch, transformers, megatron.core as m; print(torch.__version__, transformers.__version__, m.__version__)'
    if [[ $WANT == *" after "* ]]; then
        echo "== after: layouts 1 ep2 tp2"
        timeout 300 python3 benchmarks/megatron_layouts.py "${LAYOUT[@]}" --layouts 1 ep2 tp2 --layout-timeout 140 \
            --out "$OUT" --name startup_after
        echo "== after: exit $?"
    fi
    if [[ $WANT == *" mxfp4 "* ]]; then
        echo "== mxfp4: make a 12-layer GPT-OSS-20B-shaped checkpoint"
        timeout 200 python3 benchmarks/startup.py --make /tmp/gptoss12 --layers 12 | tee "$OUT/make.json"
        du -sh /tmp/gptoss12
        echo "== mxfp4: learner start-up, 2 ranks, EP2"
        timeout 150 python3 -m torch.distributed.run --standalone --nproc-per-node 2 benchmarks/startup.py \
            --model /tmp/gptoss12 --ep 2 2>&1 | grep -v -i warn | tee "$OUT/mxfp4_ep2.log"
        echo "== mxfp4: offpolicy verify --ep 2"
        timeout 240 python3 -m torch.distributed.run --standalone --nproc-per-node 2 -m offpolicy.services.cli verify \
            --model /tmp/gptoss12 --ep 2 --dtype bfloat16 2>&1 | grep -v -i warn | tee "$OUT/mxfp4_verify.log"
    fi
    if [[ $WANT == *" before "* ]]; then
        echo "== before (.before/): layouts 1 ep2"
        (cd .before && PYTHONPATH=$REPO/.before:/tmp/site timeout 300 python3 benchmarks/megatron_layouts.py \
            "${LAYOUT[@]}" --no-gather --layouts 1 ep2 --layout-timeout 145 --out "$OUT" --name startup_before)
        echo "== before: exit $?"
    fi
    echo "== done in $SECONDS s"
} 2>&1 | tee "$OUT/startup.log"
