#!/usr/bin/env bash
# The one-GPU runs behind docs/benchmarks.md "MoE learner speed" (issue 24). From this checkout's root:
#     bash benchmarks/moe_speed.sh OUT [parts...]
# Installs this checkout with the wheels in .whl/ (or ../.whl/: pyzmq, msgspec, megatron-core), then runs each
# part under `timeout`; JSON lines land in OUT/results.jsonl, profiler tables in OUT/prof.*.txt, the log in
# OUT/moe.log. Each benchmark part runs the same model twice, before (learner.megatron.experts=sequential:
# megatron-core's SequentialMLP, the module of every earlier figure) and after (grouped, the default).
# Parts: gputests gptoss-body gptoss-slice qwen3-body.
set -u
OUT=$(realpath -m "${1:-runs/moe}")
shift
WANT=" ${*:-gputests gptoss-body gptoss-slice qwen3-body} "
mkdir -p "$OUT"
WHL=$(ls -d .whl ../.whl 2>/dev/null | head -1)
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$WHL"/*.whl . || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
ARGS=${ARGS:---groups 16 --n 8 --prompt 64:256 --response 64:1536 --warmup 1 --steps 2 --max-tokens auto}
pair() {  # LIMIT NAME ARGS...: the before and the after row of one model
    local limit=$1 name=$2
    shift 2
    for experts in sequential grouped; do
        echo "== $name $experts at ${SECONDS}s: $*"
        timeout "$limit" python3 benchmarks/megatron_learner.py $ARGS --label "$name-$experts" \
            --out "$OUT/results.jsonl" --set learner.megatron.experts=$experts "$@"
    done
}
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c 'import torch; print(torch.__version__, hasattr(torch, "_grouped_mm"))'
    if [[ $WANT == *" gputests "* ]]; then
        # the installed offpolicy first: subprocesses need offpolicy.services, which the checkout folder lacks
        PYTHONPATH=/tmp/site:. timeout 240 python3 -m pytest -q -s -p no:cacheprovider \
            tests/gpu/test_megatron_experts_gpu.py tests/gpu/test_megatron_gpu.py -k "experts or grouped or tp1_step"
    fi
    [[ $WANT == *" gptoss-body "* ]] && pair 200 gptoss-body --arch gptoss-slice --layers 2 --body --profile "$OUT/prof"
    [[ $WANT == *" gptoss-slice "* ]] && pair 200 gptoss-slice --arch gptoss-slice --layers 2
    [[ $WANT == *" qwen3-body "* ]] && pair 200 qwen3-body --arch qwen3moe-slice --layers 2 --body
    cat "$OUT/results.jsonl" 2>/dev/null
} 2>&1 | tee "$OUT/moe.log"
