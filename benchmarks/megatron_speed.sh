#!/usr/bin/env bash
# The one-GPU runs behind docs/benchmarks.md "Megatron learner speed" (issue 17). From this checkout's root:
#     bash benchmarks/megatron_speed.sh OUT [BEFORE_CHECKOUT] [parts...]
# Installs this checkout (and BEFORE_CHECKOUT, an older offpolicy, into /tmp/before) with the wheels in
# .whl/ (or ../.whl/), then runs each part under `timeout`; JSON lines land in OUT/results.jsonl, the
# profiler tables in OUT/prof_*.txt, everything in OUT/speed.log. Parts: probe before after attention
# gputests pipeline.
set -u
OUT=$(realpath -m "${1:-runs/speed}")
BEFORE=${2:-}
shift 2 2>/dev/null || shift $#
WANT=" ${*:-probe before after attention gputests pipeline} "
mkdir -p "$OUT"
WHL=$(ls -d .whl ../.whl 2>/dev/null | head -1)
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$WHL"/*.whl . || exit 1
if [[ -n $BEFORE ]]; then
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --upgrade \
        --target /tmp/before "$BEFORE" || exit 1
fi
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
ARGS=${ARGS:---arch llama-1b --groups 16 --n 8 --prompt 64:256 --response 64:1536 --warmup 1 --steps 2}
run() {  # LIMIT LABEL ARGS...: one benchmark row
    local limit=$1 label=$2
    shift 2
    echo "== $label: $*"
    timeout "$limit" python3 benchmarks/megatron_learner.py $ARGS --label "$label" --out "$OUT/results.jsonl" "$@"
}
{
    if [[ $WANT == *" probe "* ]]; then
        nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
        python3 -c 'import torch; print(torch.__version__); print(torch.ops.aten._flash_attention_forward.default._schema); print(torch.ops.aten._flash_attention_backward.default._schema)'
    fi
    if [[ $WANT == *" after "* ]]; then  # one backend, three layouts: setup and compilation paid once
        run 240 after --variants packed:16384,padded:16384,packed:auto --profile "$OUT/prof"
    fi
    if [[ $WANT == *" before "* ]]; then
        # main's learner fits 4096 tokens a micro-batch on an 80 GB H100 (8192 runs out of memory)
        PYTHONPATH=/tmp/before:/tmp/site run 200 before --variants padded:4096 --warmup 1 --steps 1 \
            --profile "$OUT/prof"
    fi
    if [[ $WANT == *" attention "* ]]; then
        timeout 120 python3 benchmarks/attention_kernels.py
    fi
    if [[ $WANT == *" gputests "* ]]; then
        # the installed offpolicy first: subprocesses need offpolicy.services, which the checkout folder lacks
        PYTHONPATH=/tmp/site:. timeout 150 python3 -m pytest -q -s -p no:cacheprovider tests/gpu/test_megatron_packing_gpu.py \
            tests/gpu/test_megatron_gpu.py -k "packed or flash or compiled or tp1_step or kl_reference"
    fi
    if [[ $WANT == *" pipeline "* ]]; then
        echo "== pipeline at ${SECONDS}s"
        # from outside the checkout: its offpolicy/ source folder would shadow the installed offpolicy.services
        (mkdir -p /tmp/pipe && cd /tmp/pipe && timeout $((${DEADLINE:-585} - SECONDS)) python3 -m offpolicy.services.cli \
            bench pipeline --backend megatron --steps 12 --dir /tmp/pipe/runs --out /tmp/pipe/out) \
            && cp /tmp/pipe/out/pipeline.json "$OUT/pipeline.json"
    fi
    cat "$OUT/results.jsonl" 2>/dev/null
} 2>&1 | tee "$OUT/speed.log"
