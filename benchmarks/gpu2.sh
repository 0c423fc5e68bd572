#!/usr/bin/env bash
# The two-GPU run behind docs/benchmarks.md "Four-GPU runs (issue 10)", in its 2-GPU variant. From the
# repository root, on one host with 2 GPUs:
#     bash benchmarks/gpu2.sh OUT_DIR [layouts pipeline pipeline-megatron]   (default: all three)
# GPUS=4 runs the 4-GPU variants on a host with 4 GPUs: layouts 1, TP4, TP2 x EP2, EP4, DP4; the Megatron
# learner as TP2 on GPUs 0-1 with two rollout daemons on GPUs 2 and 3 (pipeline-megatron), and the torch
# learner on GPU 0 with the same two rollouts (pipeline).
# Installs this checkout (no dependencies: torch, transformers, safetensors, uvloop and prometheus-client
# come with the machine) plus the pyzmq, msgspec and megatron-core wheels in .whl/ into /tmp/site, then
#   layouts:  benchmarks/megatron_layouts.py, the Megatron learner as 1 GPU, EP2, DP2 and TP2 on the small
#             Qwen3-MoE config (QWEN3_MOE_SMALL; tp > 1 runs with sequence parallelism); when a MoE
#             layout fails (the log says which and why) the dense qwen3 config of the same shape
#             (qwen3-dense-small) runs as 1 GPU, TP2, DP2 too;
#   pipeline: offpolicy bench pipeline, learner (torch backend) on GPU 0, one rollout daemon on GPU 1,
#             max_staleness 0 and 1;
#   pipeline-megatron: the same with the Megatron learner (one rank on GPU 0).
# JSON, markdown and logs land in OUT_DIR (OUT_DIR/gpu2.log is everything). Every part runs under
# `timeout`, and a part is skipped when less than half its limit is left of BUDGET seconds (default
# 480). LAYOUT_ARGS / PIPELINE_ARGS are appended to every megatron_layouts.py / pipeline command and
# NO_INSTALL=1 skips the pip install (a CPU dry run: LAYOUT_ARGS="--cpu --groups 2 ..." ).
set -u
REPO=$(pwd)
OUT=$(realpath -m "${1:-runs/bench-gpu2}")
shift
WANT=" ${*:-layouts pipeline pipeline-megatron} "
BUDGET=${BUDGET:-480}
GPUS=${GPUS:-2}
if (( GPUS == 4 )); then
    MOE_LAYOUTS="1 tp4 tp2ep2 ep4 dp4" DENSE_LAYOUTS="1 tp4 dp4" LAYOUT_S=300
    PIPE_TORCH=(--learner-gpus 0 --rollouts 2 --rollout-gpus 2 3)
    PIPE_MEGATRON=(--backend megatron --tp 2 --learner-gpus 0 1 --rollouts 2 --rollout-gpus 2 3)
else
    MOE_LAYOUTS="1 ep2 dp2 tp2" DENSE_LAYOUTS="1 tp2 dp2" LAYOUT_S=200
    PIPE_TORCH=(--learner-gpus 0 --rollout-gpus 1)
    PIPE_MEGATRON=(--backend megatron --learner-gpus 0 --rollout-gpus 1)
fi
mkdir -p "$OUT"
WORK=$(mktemp -d)
if [[ -z ${NO_INSTALL:-} ]]; then
    python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/pyzmq-*.whl .whl/msgspec-*.whl .whl/megatron_core-*.whl . || exit 1
    export PYTHONPATH=/tmp/site
fi
export PYTHONUNBUFFERED=1
cd "$WORK" || exit 1
left() { echo $((BUDGET - SECONDS)); }
limit() {  # SECONDS: the part's limit, or 0 (skip) when the budget has less left
    local l; l=$(left)
    if (( l < $1 / 2 )); then echo 0; elif (( l < $1 )); then echo "$l"; else echo "$1"; fi
}
layouts() {  # ARCH NAME SECONDS LAYOUTS...: one megatron_layouts.py driver run
    local arch=$1 name=$2 t; t=$(limit "$3"); shift 3
    if (( t == 0 )); then echo "== skipped layouts $arch: $(left) s of the budget left"; return 3; fi
    echo "== megatron layouts $arch: $* (limit $t s, $(left) s of the budget left)"
    timeout "$t" python3 "$REPO/benchmarks/megatron_layouts.py" --arch "$arch" --gpus "$GPUS" --layouts "$@" \
        --groups 16 --samples 8 --prompt 128 --response 384 --steps 5 --warmup 2 --max-tokens 16384 \
        --layout-timeout 90 --out "$OUT" --name "$name" ${LAYOUT_ARGS:-}
}
pipeline() {  # NAME SECONDS ARGS...: one offpolicy bench pipeline run
    local name=$1 t; t=$(limit "$2"); shift 2
    if (( t == 0 )); then echo "== skipped $name: $(left) s of the budget left"; return 0; fi
    echo "== offpolicy bench pipeline $* (limit $t s)"
    # per-GPU utilisation and memory once a second: where the daemons ran and how they overlapped
    nvidia-smi --query-gpu=timestamp,index,utilization.gpu,memory.used --format=csv -l 1 > "$OUT/$name.nvsmi.csv" &
    local smi=$!
    timeout "$t" python3 -m offpolicy.services.cli bench pipeline "$@" ${PIPELINE_ARGS:-} --timeout $(((t - 10) / 2)) \
        --dir "$WORK/runs-$name" --out "$WORK/$name" && cp "$WORK/$name/pipeline.json" "$OUT/$name.json" \
        && cp "$WORK/$name/pipeline.md" "$OUT/$name.md"
    local rc=$?
    kill "$smi"
    echo "-- peak memory.used per GPU during $name (MiB):"
    awk -F', ' 'NR > 1 { m = $4 + 0; if (m > peak[$2]) peak[$2] = m } END { for (g in peak) print "GPU " g ": " peak[g] }' \
        "$OUT/$name.nvsmi.csv"
    if (( rc != 0 )); then  # the daemons' logs say why
        for f in "$WORK/runs-$name"/*/logs/*.log; do [[ -f $f ]] && { echo "-- $f"; tail -n 30 "$f"; }; done
    fi
    return $rc
}
{
    nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv
    nproc; free -g; df -h /dev/shm
    python3 -c 'import torch, transformers, megatron.core as m; print(torch.__version__, transformers.__version__, m.__version__, torch.cuda.device_count(), "GPUs")'
    if [[ $WANT == *" layouts "* ]]; then
        # shellcheck disable=SC2086
        layouts qwen3-moe-small megatron_layouts_moe "$LAYOUT_S" $MOE_LAYOUTS
        rc=$?
        if (( rc == 0 )); then
            echo "== MoE layouts: all ran and the step-1 losses agree"
        elif (( rc == 3 )); then
            echo "== MoE layouts: all ran but the step-1 losses DISAGREE beyond the tolerance (see the table)"
        else
            echo "== MoE layouts: exit $rc (2 = a layout failed: the reason is above, the log in" \
                 "$OUT/megatron_layouts_moe_*.log; 124 = timeout; 1 = the driver failed);" \
                 "now the dense qwen3 config of the same shape"
            # shellcheck disable=SC2086
            layouts qwen3-dense-small megatron_layouts_dense 150 $DENSE_LAYOUTS
            echo "== dense layouts: exit $?"
        fi
    fi
    [[ $WANT == *" pipeline-megatron "* ]] && pipeline pipeline_split_megatron 130 "${PIPE_MEGATRON[@]}" --staleness 0 1
    [[ $WANT == *" pipeline "* ]] && pipeline pipeline_split 130 "${PIPE_TORCH[@]}" --staleness 0 1
    echo "== done in $SECONDS s; files in $OUT:"; ls -l "$OUT"
} 2>&1 | tee "$OUT/gpu2.log"
