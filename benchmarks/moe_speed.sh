#!/usr/bin/env bash
# The one-GPU runs behind docs/benchmarks.md "MoE learner speed" (issues 24, 35). From this checkout's root:
#     bash benchmarks/moe_speed.sh OUT [parts...]
# Installs this checkout with the wheels in .whl/ (or ../.whl/: pyzmq, msgspec, megatron-core), then runs each
# part under `timeout`; JSON lines land in OUT/results.jsonl, profiler tables in OUT/prof.*.txt, the log in
# OUT/moe.log, and a table of every row's step time and MFU closes the log. Each benchmark part runs the same
# model twice, before and after:
#   gptoss-body gptoss-slice qwen3-body       learner.megatron.experts=sequential (megatron-core's SequentialMLP,
#                                              the module of every earlier figure), then grouped (the default)
#   permute-gptoss permute-qwen3               learner.megatron.moe_permute=megatron (megatron-core's unfused
#                                              permutation), then gather (the default; issue 35), body-only,
#                                              each with a profiler table
#   adam-gptoss                                learner.megatron.fused_adam=false (torch AdamW's foreach path), then
#                                              true (its fused kernel, the default), GPT-OSS body-only, profiled
#   kernels                                    benchmarks/moe_kernels.py: the experts' GLU and the permutation's sums, compiled vs Triton, at
#                                              GPT-OSS's and Qwen3's shapes, against the bytes' time (OUT/kernels.jsonl)
#   base-gptoss base-qwen3 base-slice          the offpolicy package in $BASE (a baseline checkout's `offpolicy`
#                                              folder, e.g. `git archive COMMIT offpolicy | tar -x -C .before`),
#                                              then this checkout's, same script and options: GPT-OSS and Qwen3
#                                              body-only (profiled), the GPT-OSS slice with its real vocabulary
#   base-llama                                 the same before / after for the dense Llama-3.2-1B shape, packed with the
#                                              auto budget (`--variants packed:auto`, profiled; issue 50)
# Parts: gputests kernels gptoss-body gptoss-slice qwen3-body permute-gptoss permute-qwen3 adam-gptoss base-gptoss base-qwen3
# base-slice base-llama (default: the first four). TRACE=DIR: base-gptoss, base-qwen3 and base-llama also write each row's
# chrome trace there (gzipped).
# KERNEL_ARGS: more arguments for the kernels part (e.g. "--shapes= --sums=" for the RMSNorm rows only).
# DRY=1 prints the commands instead of running them (no GPU needed); NO_INSTALL=1 skips the install (done already).
set -u
OUT=$(realpath -m "${1:-runs/moe}")
shift
WANT=" ${*:-gputests gptoss-body gptoss-slice qwen3-body} "
RUN=${DRY:+echo}
mkdir -p "$OUT"
WHL=$(ls -d .whl ../.whl 2>/dev/null | head -1)
[[ -n ${NO_INSTALL:-} ]] || $RUN python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "$WHL"/*.whl . || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
ARGS=${ARGS:---groups 16 --n 8 --prompt 64:256 --response 64:1536 --warmup 1 --steps 2 --max-tokens auto}
pair() {  # KEY "BEFORE AFTER" LIMIT NAME ARGS...: the before and the after row of one model (learner.megatron.KEY)
    local key=$1 values=$2 limit=$3 name=$4
    shift 4
    for v in $values; do
        echo "== $name $key=$v at ${SECONDS}s: $*"
        $RUN timeout "$limit" python3 benchmarks/megatron_learner.py $ARGS --label "$name-$v" \
            --out "$OUT/results.jsonl" --set learner.megatron.$key=$v "$@"
    done
}
base() {  # LIMIT NAME ARGS...: the model with $BASE's offpolicy (before), then with this checkout's (after)
    local limit=$1 name=$2
    shift 2
    [[ -d ${BASE:-}/offpolicy ]] || { echo "== $name: BASE (a folder holding a baseline's offpolicy) is not set"; return; }
    echo "== $name before ($BASE) at ${SECONDS}s: $*"
    PYTHONPATH=$BASE:$PYTHONPATH $RUN timeout "$limit" python3 benchmarks/megatron_learner.py $ARGS --label "$name-before" \
        --out "$OUT/results.jsonl" "$@"
    echo "== $name after at ${SECONDS}s: $*"
    $RUN timeout "$limit" python3 benchmarks/megatron_learner.py $ARGS --label "$name-after" --out "$OUT/results.jsonl" "$@"
}
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c 'import torch; print(torch.__version__, hasattr(torch, "_grouped_mm"))'
    if [[ $WANT == *" gputests "* ]]; then
        # the installed offpolicy first: subprocesses need offpolicy.services, which the checkout folder lacks
        PYTHONPATH=/tmp/site:. $RUN timeout 300 python3 -m pytest -q -s -p no:cacheprovider \
            tests/gpu/test_megatron_experts_gpu.py tests/gpu/test_megatron_gpu.py tests/gpu/test_megatron_permutation_gpu.py \
            tests/gpu/test_megatron_packing_gpu.py tests/gpu/test_megatron_norms_gpu.py tests/gpu/test_megatron_qkv_gpu.py \
            -k "experts or grouped or glu or accum or tp1_step or permutation or host_sync or padded or varlen or norm or qkv or packed_micro_batch"
    fi
    [[ $WANT == *" kernels "* ]] && $RUN timeout 240 python3 benchmarks/moe_kernels.py ${KERNEL_ARGS:-} --out "$OUT/kernels.jsonl"
    [[ $WANT == *" gptoss-body "* ]] && pair experts "sequential grouped" 200 gptoss-body --arch gptoss-slice --layers 2 --body --profile "$OUT/prof"
    [[ $WANT == *" gptoss-slice "* ]] && pair experts "sequential grouped" 200 gptoss-slice --arch gptoss-slice --layers 2
    [[ $WANT == *" qwen3-body "* ]] && pair experts "sequential grouped" 200 qwen3-body --arch qwen3moe-slice --layers 2 --body
    [[ $WANT == *" permute-gptoss "* ]] && pair moe_permute "megatron gather" 140 permute-gptoss --arch gptoss-slice \
        --layers 2 --body --profile "$OUT/prof"
    [[ $WANT == *" permute-qwen3 "* ]] && pair moe_permute "megatron gather" 140 permute-qwen3 --arch qwen3moe-slice \
        --layers 2 --body --profile "$OUT/prof"
    [[ $WANT == *" adam-gptoss "* ]] && pair fused_adam "false true" 140 adam-gptoss --arch gptoss-slice \
        --layers 2 --body --profile "$OUT/prof"
    [[ $WANT == *" base-gptoss "* ]] && base 140 base-gptoss --arch gptoss-slice --layers 2 --body --profile "$OUT/prof" \
        ${TRACE:+--trace "$TRACE/trace"}
    [[ $WANT == *" base-qwen3 "* ]] && base 140 base-qwen3 --arch qwen3moe-slice --layers 2 --body --profile "$OUT/prof" \
        ${TRACE:+--trace "$TRACE/trace"}
    [[ $WANT == *" base-slice "* ]] && base 200 base-slice --arch gptoss-slice --layers 2
    [[ $WANT == *" base-llama "* ]] && base 200 base-llama --arch llama-1b --variants packed:auto --profile "$OUT/prof" \
        ${TRACE:+--trace "$TRACE/trace"}
    cat "$OUT/results.jsonl" 2>/dev/null
    [[ -s $OUT/results.jsonl ]] && python3 -c 'import json, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if "mfu" in r:
        print("%-28s step %7.3f s  MFU %5.1f %%  %8d tokens/s" % (r["label"], r["step_s"], 100 * r["mfu"], r["tokens_per_s"]))' "$OUT/results.jsonl"
} 2>&1 | tee "$OUT/moe.log"
