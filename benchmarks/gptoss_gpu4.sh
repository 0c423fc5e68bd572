#!/usr/bin/env bash
# The GPT-OSS slice on one host with 4 GPUs (issues 32 and 37; docs/megatron.md "Four GPUs", docs/benchmarks.md
# "Sharded publish"). From the repository root:
#     bash benchmarks/gptoss_gpu4.sh OUT_DIR PART...
# Parts (each under `timeout`; LIMIT_<PART> overrides its seconds, RUN_TIMEOUT a pipeline run's):
#   layouts4  benchmarks/megatron_layouts.py --arch gptoss-slice (GPT-OSS-20B's shapes, 2 layers, 2.8B parameters)
#             as 1 GPU, EP4, TP2 x EP2, TP4 (sequence parallel), PP2 x EP2, with --publish 3: step-1 loss and grad
#             norm against 1 GPU, tokens/s, scaling, MFU, peak memory, ready s, the old gather, the sharded publish
#             (first and steady state, x host copy) and the learner's stall and step slowdown per version;
#   layouts2  the same for EP2 and TP2 on GPUs 0-1 (dp2ep2, tp2dp1), the 2-GPU rows of the publish table (LAYOUTS2
#             names others, e.g. "1 dp2ep2 tp2dp1" adds the 1-GPU row on the same machine);
#   dense     offpolicy bench pipeline, the 1.2B dense model of issue 32 (16 layers, hidden 2048, mlp 8192,
#             vocab 32000), Megatron learner on GPU 0, one rollout on GPU 1, staleness 0 and 1, 32 groups a step
#             (its generation takes ~2.1x its training: staleness 1 can give at most ~1.5x staleness 0);
#   dense-long the same with 640-token prompts, where training takes about as long as generating (256-token
#             prompts trained in 1.7 s against 3.2 s of generation: at most 1.67x);
#   slice11   the pipeline with the GPT-OSS slice, Megatron learner on GPU 0, one rollout on GPU 1 (GPUS_SLICE11),
#             staleness 0 and 1, 32 groups x 8 x 32 new tokens (SLICE11_NEW) a step after 500-token prompts
#             (SLICE11_PROMPT): training about as long as generating (with 128 new tokens generating took 2.2-2.3x
#             training after 150- and 500-token prompts; with 32 new tokens and 5-token prompts both took ~0.3 s,
#             below the 5.6 GB version's load);
# Pipeline runs leave out the first 2 x (weights.keep + 2) steps (the bench's --warmup auto: the versions
# before every recycled shard file is page-locked) and average 8 more.
#   engines11 the slice11 pipeline once per rollout engine in ENGINES (default "vllm torch"; also sglang: in-process
#             sglang.Engine from the slice saved once as a bf16 checkpoint, SLICE_DIR, after `bash deploy/gpu/server.sh
#             sglang install`; SGL_MEM, SGL_ARGS) and version format in
#             FORMATS (default "bf16 fp8 mxfp4"): bf16 at staleness 0 and 1, a low-bit format at 1; vLLM runs a server
#             per rollout, started once for the runs of a part (bench/servers.py; 0.26: `bash deploy/gpu/vllm.sh install` first, /tmp/vsite; it
#             starts from the slice converted into the versions' format and loads every version through its
#             reload API, proven by fingerprint: the table's `loads proven`; every Triton compile after its warm-up
#             logged, counted by kernel after each run: VLLM_JIT_VERBOSE=false stops that); VLLM_LEN, VLLM_MEM,
#             VLLM_ARGS;
#             SLICE11_STEPS (18) and SLICE11_WARMUP (auto) the steps of each run and those left out, SLICE11_STALENESS
#             the stalenesses of every run (default: 0 1 for bf16, 1 for the others);
#   slice22   the pipeline with the GPT-OSS slice: learner EP2 on GPUs 0-1, two rollouts on GPUs 2-3 (64 groups x 8
#             x 32 new tokens a step: its rollouts decode without a static cache, sliding layers), per rollout engine
#             in SLICE22_ENGINES (default torch; vllm and sglang as in engines11, a server or engine per rollout) and
#             format in FORMATS (default "bf16 fp8 mxfp4"): bf16 at staleness 0, 1 and 2 (a pipeline at staleness
#             k runs at most k + 1 times as fast as staleness 0: bench/pipeline.py `speedups`), a low-bit format at 1
#             (SLICE22_STALENESS overrides; publish and load seconds, logprob diff against bf16); SLICE22_STEPS (18)
#             and SLICE22_WARMUP (auto) the steps of each run and those left out; SLICE22_NEW (32) new tokens a
#             response and SLICE22_BATCH (64) groups a step (long responses, issue 48: SLICE22_NEW=1536 SLICE22_BATCH=16).
# GPUS_LAYOUTS2 / GPUS_DENSE / GPUS_SLICE11 (default 0,1) pick the GPUs of the 2-GPU parts (CUDA_VISIBLE_DEVICES), so other
# work can use the others. Installs this checkout plus .whl/'s pyzmq, msgspec and megatron-core into
# /tmp/site first (benchmarks/gpu2.sh; NO_INSTALL=1 skips it). Each pipeline run leaves two files in OUT_DIR:
# pipeline-NAME.log (the bench's output: its table) and runs-NAME.tgz (runs-NAME/pipeline.json and .md, every daemon's
# log and metrics, --trace's trace.json and timeline.png); the layouts parts their JSON, markdown and logs.
# The slice is a random model: its 201,088-token vocabulary almost never samples a digit, so every reward is 0, every
# advantage 0, and without more each version would hold the values of the one before (the table says so; SGLang's
# proof, which needs a version that differs, then proved 1 load of 7 on the H200). engines11 and slice22 train with
# the entropy bonus, --set algo.entropy_coef=ENTROPY_COEF (default 0.01; 0 for the workload of the rows before the
# fifteenth session), so that each step moves the weights as real training does. SGLang's engines start without
# prefill CUDA graphs (rollout.sglang.extra.disable_prefill_cuda_graph=true; SGL_ARGS may set it false): 0.5.14
# compiles 58 piecewise prefill graphs at start, over a minute beside the learner on one H200.
# CODE=DIR runs another checkout's offpolicy (its package directory first on PYTHONPATH, before /tmp/site's; this
# checkout's scripts): an A/B against an older commit in one call, e.g. `git archive REV | tar -x -C .ab` here, .ab in
# `.git/info/exclude` and in the device call's carry, then `CODE=.ab NO_INSTALL=1 bash benchmarks/gptoss_gpu4.sh OUT/old
# engines11; NO_INSTALL=1 bash benchmarks/gptoss_gpu4.sh OUT/new engines11`.
# PIPELINE_ARGS, VLLM_ARGS and SGL_ARGS are shell words, quoted as on a command line: a value with spaces stays one
# argument (SGL_ARGS='--set "rollout.sglang.extra={max_total_tokens: 65536}"'); LAYOUT_ARGS splits on spaces.
set -u
REPO=$(pwd)
OUT=$(realpath -m "${1:-runs/bench-gptoss-gpu4}")
shift
mkdir -p "$OUT"
if [[ -z ${NO_INSTALL:-} ]]; then
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/pyzmq-*.whl .whl/msgspec-*.whl .whl/megatron_core-*.whl . || exit 1
fi
FIRST=${CODE:+$(realpath "$CODE"):}  # CODE=DIR: that checkout's offpolicy before /tmp/site's (an A/B, below)
export PYTHONPATH=${FIRST}/tmp/site PYTHONUNBUFFERED=1
WORK=$(mktemp -d)
cd "$WORK" || exit 1
ARCH=${ARCH:-gptoss-slice}  # a CPU dry run: ARCH=tiny-gpt_oss NO_INSTALL=1 LAYOUT_ARGS="--cpu ..." PIPELINE_ARGS="--device cpu ..."
SLICE=$(python3 -c "import sys; sys.path.insert(0, '$REPO/benchmarks'); sys.argv = ['x']
from megatron_layouts import arch_config; import json; print(json.dumps(arch_config('$ARCH', [])))") || exit 1
BATCH=(--groups 16 --samples 8 --prompt 128 --response 384 --steps 4 --warmup 2 --max-tokens 16384 --publish 3)

layouts() {  # NAME GPUS SECONDS LAYOUTS...
    local name=$1 gpus=$2 t=$3; shift 3
    echo "== layouts $name: $* (limit $t s)"
    timeout "$t" python3 "$REPO/benchmarks/megatron_layouts.py" --arch "$ARCH" --gpus "$gpus" --layouts "$@" \
        "${BATCH[@]}" --layout-timeout 170 --out "$OUT" --name "gptoss-$name" ${LAYOUT_ARGS:-}
}
words() {  # VAR: the words of $VAR as the shell quotes them (VAR='--set "a.b={k: 1}"' keeps the braces one word)
    local -a w=(); eval "w=(${!1:-})" || { echo "$1: not shell words: ${!1}" >&2; exit 2; }
    (( ${#w[@]} )) && printf '%s\0' "${w[@]}"; return 0
}
pipeline() {  # NAME SECONDS ARGS...
    local name=$1 t=$2; shift 2
    local -a extra; mapfile -d '' extra < <(words PIPELINE_ARGS)
    echo "== pipeline $name (limit $t s): $* ${extra[*]}"
    timeout "$t" python3 -m offpolicy.services.cli bench pipeline --out "$OUT" --dir "$WORK/runs-$name" "$@" \
        "${extra[@]}" > "$OUT/pipeline-$name.log" 2>&1
    echo "   exit $?"; tail -n 16 "$OUT/pipeline-$name.log"
    jit_said "$name"
    maps_said "$name"
    # two files a run come back (the device tool brings 8 a call): its log, and runs-NAME.tgz with the bench's
    # pipeline.json and .md, and every daemon's log, metrics and --trace files of its runs (the weights live in
    # /dev/shm, not here); the trace's copies beside pipeline.json are in the runs' directories already
    local f
    mkdir -p "$WORK/runs-$name"
    for f in "$OUT/pipeline.json" "$OUT/pipeline.md"; do [[ -f $f ]] && mv "$f" "$WORK/runs-$name/"; done
    rm -f "$OUT"/pipeline-s*.trace.json "$OUT"/pipeline-s*.timeline.png
    tar czf "$OUT/runs-$name.tgz" --exclude=checkpoints --exclude='vllm-initial-model*' -C "$WORK" "runs-$name" 2>/dev/null
    return 0
}
jit_said() {  # NAME: the Triton kernels vLLM compiled after its warm-up in the run's servers (its jit_monitor, every
    # compile logged with rollout.vllm.extra.jit_monitor_verbose: engine_args), by kernel: each a latency spike of a
    # generate call (docs/vllm.md, "MXFP4 generation and Triton's JIT")
    local logs; logs=$(find "$WORK/runs-$1" -name 'vllm-*.log' 2>/dev/null)
    [[ -n $logs ]] || return 0
    # shellcheck disable=SC2086
    echo "   vLLM JIT compiles after warm-up: $(grep -h 'JIT compilation during inference: ' $logs | \
        sed -E 's/.*during inference: //; s/\. This causes.*//; s/ \(.*//; s/.*\.//' | sort | uniq -c | \
        awk '{printf "%s%s x%d", (n++ ? ", " : ""), $2, $1} END {if (!n) printf "none"}')"
}
maps_said() {  # NAME: of the versions the run's rollouts staged (vLLM, SGLang), how many were read out of registered
    # maps of the shard files (weights.register_maps, the log's "GB of it out of registered maps") and the staging rate
    local logs; logs=$(find "$WORK/runs-$1" -name 'rollout-*.log' 2>/dev/null)
    [[ -n $logs ]] || return 0
    # shellcheck disable=SC2086
    grep -ho 'from [0-9.]* GB staged in [^,]*' $logs | awk '
        { n++; m += index($0, "registered maps") > 0
          if (match($0, / in [0-9.]+ s/)) s = substr($0, RSTART + 4, RLENGTH - 6); else s = 0
          if (s > 0) { rate += $2 / s; r++ } }
        END { if (n) printf "   staged versions: %d, read out of registered maps: %d, staging %.1f GB/s (mean)\n",
              n, m, (r ? rate / r : 0) }'
}
slice_args() {  # the GPT-OSS slice's pipeline options: learner EP2 on 0-1, rollouts on 2 and 3
    echo --backend megatron --learner-gpus 0 1 --rollouts 2 --rollout-gpus 2 3 --batch "${SLICE22_BATCH:-64}" --n 8 \
        --new-tokens "${SLICE22_NEW:-32}"
}
engine_args() {  # ENGINE: sets ENGINE_ARGS, its options in the pipelines (vLLM: a server per rollout, started once for the
    # runs of a part; SGLang: sglang.Engine in each rollout daemon, triton attention: the pack has no FlashAttention 3)
    local -a extra=()
    case $1 in
        vllm) mapfile -d '' extra < <(words VLLM_ARGS)
              ENGINE_ARGS=(--set rollout.vllm.mode=http --set "rollout.vllm.max_model_len=${VLLM_LEN:-1024}"
                  --set "rollout.vllm.gpu_memory_utilization=${VLLM_MEM:-0.85}" --set rollout.vllm.startup_timeout_s=400
                  --set "rollout.vllm.extra.jit_monitor_verbose=${VLLM_JIT_VERBOSE:-true}" "${extra[@]}") ;;
        sglang) mapfile -d '' extra < <(words SGL_ARGS)
                ENGINE_ARGS=(--set rollout.sglang.mode=engine --set rollout.sglang.attention_backend=triton
                    --set "rollout.sglang.mem_fraction_static=${SGL_MEM:-0.8}"
                    --set rollout.sglang.extra.disable_prefill_cuda_graph=true "${extra[@]}") ;;
        *) ENGINE_ARGS=() ;;
    esac
}
engine_setup() {  # ENGINE: ENGINE_ARGS (engine_args), MODEL_ARGS (the slice's arch; SGLang starts from a directory) and
    # PYTHONPATH: vLLM 0.26 and SGLang 0.5.14 (deploy/gpu/server.sh NAME install) each their own site, never both
    engine_args "$1"
    MODEL_ARGS=(--set "model.arch=$SLICE")
    export PYTHONPATH=${FIRST}/tmp/site
    [[ $1 == vllm && -d /tmp/vsite ]] && export PYTHONPATH=${FIRST}/tmp/site:/tmp/vsite
    if [[ $1 == sglang ]]; then
        export PYTHONPATH=${FIRST}/tmp/site:/tmp/ssite
        MODEL_ARGS=(--set "model.path=$(slice_dir)")
    fi
    return 0
}
served() {  # ENGINE FMT: false (said) where the engine serves no such GPT-OSS version (weights/fp8_blocks.py `unserved`)
    [[ $1 == sglang && $2 == fp8 ]] || return 0
    echo "== $1 $2 not run: SGLang 0.5.14 builds GPT-OSS's attention without its quantization config (docs/sglang.md)"
    return 1
}
format_setup() {  # FMT STALENESS: STALE (bf16: 0 1 2, a low-bit format 1; STALENESS, if set, for every format) and
    # LOW_ARGS: a low-bit run publishes only its format, no bf16 version nobody reads (weights.native=checkpoints: on
    # one H200, 128 GB of host memory, the fp8 run's versions in both formats had the learner OOM-killed)
    STALE=(1); LOW_ARGS=()
    [[ $1 == bf16 ]] && STALE=(0 1 2)
    [[ -n $2 ]] && read -ra STALE <<< "$2"
    [[ $1 != bf16 ]] && LOW_ARGS=(--set "weights.formats=[$1]" --set "rollout.weights_format=$1"
                                  --set weights.native=checkpoints)
    return 0
}
slice_dir() {  # the slice saved once as an HF checkpoint in bf16 (SLICE_DIR), for engines that start from one
    local d=${SLICE_DIR:-/tmp/gptoss-slice-hf}
    [[ -f $d/config.json ]] || python3 - "$d" "$SLICE" <<'PY' >&2 || exit 1
import json, sys
import torch
from offpolicy.config import ModelConfig
from offpolicy.models.build import build_model
build_model(ModelConfig(arch=json.loads(sys.argv[2]), dtype="bfloat16"), torch.device("cpu")).save_pretrained(sys.argv[1])
PY
    echo "$d"
}

nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
for part in "$@"; do
    case $part in
        layouts4) layouts 4gpu 4 "${LIMIT_LAYOUTS4:-560}" 1 ep4 tp2ep2 tp4 pp2ep2 ;;
        layouts2) CUDA_VISIBLE_DEVICES=${GPUS_LAYOUTS2:-0,1} layouts 2gpu 2 "${LIMIT_LAYOUTS2:-300}" ${LAYOUTS2:-dp2ep2 tp2dp1} ;;
        dense|dense-long)  # dense-long: 256-token prompts, so that a step trains about as long as it generates
            long=(); [[ $part == dense-long ]] && long=(--set data.synthetic.length=640)
            CUDA_VISIBLE_DEVICES=${GPUS_DENSE:-0,1} pipeline "$part" "${LIMIT_DENSE:-700}" --backend megatron \
                   --learner-gpus 0 --rollout-gpus 1 --layers 16 --hidden 2048 --mlp 8192 --vocab 32000 \
                   --batch 32 --n 8 --new-tokens 256 --steps 18 --timeout "${RUN_TIMEOUT:-330}" \
                   --staleness 0 1 "${long[@]}" ;;
        slice11) CUDA_VISIBLE_DEVICES=${GPUS_SLICE11:-0,1} pipeline slice11 "${LIMIT_SLICE11:-580}" --backend megatron \
                     --learner-gpus 0 --rollout-gpus 1 --batch 32 --n 8 --new-tokens "${SLICE11_NEW:-32}" --steps 18 \
                     --set data.synthetic.length=${SLICE11_PROMPT:-500} --timeout "${RUN_TIMEOUT:-270}" --staleness 0 1 \
                     --set "model.arch=$SLICE" ;;
        engines11)  # the 1 + 1 slice pipeline per rollout engine and version format (ENGINES, FORMATS)
            for engine in ${ENGINES:-vllm torch}; do
                engine_setup "$engine"
                for fmt in ${FORMATS:-bf16 fp8 mxfp4}; do
                    served "$engine" "$fmt" || continue
                    format_setup "$fmt" "${SLICE11_STALENESS:-}"
                    CUDA_VISIBLE_DEVICES=${GPUS_SLICE11:-0,1} pipeline "e11-$engine-$fmt" "${LIMIT_ENGINES11:-400}" \
                        --backend megatron --learner-gpus 0 --rollout-gpus "${SLICE11_ROLLOUT_GPU:-1}" --batch 32 --n 8 \
                        --new-tokens "${SLICE11_NEW:-32}" --steps "${SLICE11_STEPS:-18}" \
                        --warmup "${SLICE11_WARMUP:-auto}" --set data.synthetic.length=${SLICE11_PROMPT:-500} \
                        --timeout "${RUN_TIMEOUT:-270}" --staleness "${STALE[@]}" "${MODEL_ARGS[@]}" \
                        --set "rollout.engine=$engine" --set "algo.entropy_coef=${ENTROPY_COEF:-0.01}" "${LOW_ARGS[@]}" \
                        "${ENGINE_ARGS[@]}"
                done
            done ;;
        slice22)  # the 2 + 2 slice pipeline per rollout engine (SLICE22_ENGINES, default torch) and format (FORMATS)
            for engine in ${SLICE22_ENGINES:-torch}; do
                engine_setup "$engine"
                for fmt in ${FORMATS:-bf16 fp8 mxfp4}; do
                    served "$engine" "$fmt" || continue
                    format_setup "$fmt" "${SLICE22_STALENESS:-}"
                    name=slice-$fmt; [[ $engine != torch ]] && name=slice-$engine-$fmt
                    # shellcheck disable=SC2046
                    pipeline "$name" "${LIMIT_SLICE:-330}" $(slice_args) --staleness "${STALE[@]}" "${MODEL_ARGS[@]}" \
                        --set learner.megatron.ep=2 --steps "${SLICE22_STEPS:-18}" --warmup "${SLICE22_WARMUP:-auto}" \
                        --timeout "${RUN_TIMEOUT:-300}" --set "rollout.engine=$engine" \
                        --set "algo.entropy_coef=${ENTROPY_COEF:-0.01}" "${LOW_ARGS[@]}" "${ENGINE_ARGS[@]}"
                done
            done ;;
        *) echo "unknown part $part (layouts4 layouts2 dense dense-long slice11 engines11 slice22)"; exit 2 ;;
    esac
done
