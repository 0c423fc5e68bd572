#!/usr/bin/env bash
# `offpolicy eval` on one GPU (issue 16): pass@k at k = 1, 10, 20, 50 (n = 50 samples per prompt) and
# generation throughput in samples/s. No network is needed: both models are built here. From the repo root:
#     bash benchmarks/eval_gpu.sh OUT_DIR [trained random random-static]   (default: all three)
#   trained        the quickstart trained on this GPU (300 steps), then its last version evaluated on 512
#                  held-out copy prompts (eval.data seed 1; training uses seed 0): pass@k that means something
#   random         a Qwen3-0.5B-shaped model (28 layers, hidden 1024, bf16) built from its config, random
#                  weights, on 128 digit prompts, 64 new tokens: throughput at a realistic size (pass@k ~ 0)
#   random-static  the same with rollout.static_cache=true (the decode step replayed as a CUDA graph)
# Installs this checkout like benchmarks/gpu.sh; each evaluation's report.json/report.md land in OUT_DIR/NAME/,
# the log in OUT_DIR/eval_gpu.log.
set -u
OUT=$(realpath -m "${1:-runs/bench-eval-gpu}")
shift
WANT=" ${*:-trained random random-static} "
mkdir -p "$OUT"
REPO=$(pwd)
WORK=$(mktemp -d)
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/pyzmq-*.whl .whl/msgspec-*.whl . || exit 1
export PYTHONPATH=/tmp/site PYTHONUNBUFFERED=1
cd "$WORK" || exit 1
Q=$REPO/configs/quickstart.yaml
K=(eval.n_samples=50 "eval.k=[1, 10, 20, 50]" eval.device=cuda rollout.device=cuda)
QWEN='{model_type: qwen3, vocab_size: 16, hidden_size: 1024, intermediate_size: 3072, num_hidden_layers: 28,
       num_attention_heads: 16, num_key_value_heads: 8, head_dim: 128, max_position_embeddings: 256,
       tie_word_embeddings: true, bos_token_id: 11, eos_token_id: 13, pad_token_id: 10}'
ev() {  # NAME SECONDS ARGS...: one `offpolicy eval`, its report to OUT/NAME
    local name=$1 limit=$2
    shift 2
    [[ $WANT == *" $name "* ]] || return 0
    echo "== offpolicy eval ($name) $*"
    timeout "$limit" python3 -m offpolicy.services.cli eval "$@" --out "$WORK/$name" &&
        mkdir -p "$OUT/$name" && cp "$WORK/$name"/report.{json,md} "$OUT/$name/"
}
{
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c 'import torch, transformers; print(torch.__version__, transformers.__version__)'
    if [[ $WANT == *" trained "* ]]; then
        echo "== offpolicy run (quickstart on the GPU, 300 steps)"
        timeout 420 python3 -m offpolicy.services.cli run "$Q" run.dir="$WORK/runs" weights.root=/dev/shm/evalbench \
            rollout.device=cuda learner.device=cuda metrics.port=0 | tail -12
    fi
    ev trained 300 --config "$Q" run.dir="$WORK/runs" weights.root=/dev/shm/evalbench --version latest "${K[@]}" \
        "eval.data.synthetic={task: copy, length: 4, num_prompts: 512, seed: 1}" eval.batch_prompts=64
    for mode in random random-static; do
        static=false
        [[ $mode == random-static ]] && static=true
        ev "$mode" 300 --config "$Q" "model.arch=$QWEN" model.dtype=bfloat16 "${K[@]}" eval.max_new_tokens=64 \
            "eval.data.synthetic={task: copy, length: 8, num_prompts: 128, seed: 1}" eval.batch_prompts=32 \
            rollout.static_cache=$static
    done
    rm -rf /dev/shm/evalbench
} 2>&1 | tee "$OUT/eval_gpu.log"
