#!/usr/bin/env bash
# The one-GPU runs behind docs/benchmarks.md "Megatron learner speed" (issue 17). From this checkout's root:
#     bash benchmarks/megatron_speed.sh OUT [BEFORE_CHECKOUT] [parts...]
# Installs this checkout (and BEFORE_CHECKOUT, an older offpolicy, into /tmp/before) with the wheels in
# .whl/ (or ../.whl/), then runs each part under `timeout`; JSON lines land in OUT/results.jsonl, the
# profiler tables in OUT/prof_*.txt, everything in OUT/speed.log. Parts: probe before after attention.
set -u
OUT=$(realpath -m "${1:-runs/speed}")
BEFORE=${2:-}
shift 2 2>/dev/null || shift $#
WANT=" ${*:-probe before after attention} "
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
    if [[ $WANT == *" before "* ]]; then
        PYTHONPATH=/tmp/before:/tmp/site run 200 before-padded-8192 --max-tokens 8192 --profile "$OUT/prof_before.txt"
    fi
    if [[ $WANT == *" after "* ]]; then
        run 150 after-packed-16384 --max-tokens 16384 --profile "$OUT/prof_packed.txt"
        run 120 after-padded-16384 --max-tokens 16384 --set learner.megatron.packing=false
        run 120 after-packed-32768 --max-tokens 32768
    fi
    if [[ $WANT == *" attention "* ]]; then
        timeout 120 python3 benchmarks/attention_kernels.py
    fi
    cat "$OUT/results.jsonl" 2>/dev/null
} 2>&1 | tee "$OUT/speed.log"
