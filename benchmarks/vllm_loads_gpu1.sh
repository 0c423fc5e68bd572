#!/usr/bin/env bash
# vLLM's in-place load of a GPT-OSS version by every `rollout.vllm.prefetch` way, on one GPU, after `bash
# deploy/gpu/server.sh vllm install` on this machine (/tmp/vsite, /tmp/site). From the repository root:
#     bash benchmarks/vllm_loads_gpu1.sh OUT
# runs benchmarks/vllm_load.py once per stage of STAGES (default "direct stream device host"), one after another,
# each under `timeout` (LIMIT seconds each, default 200; SIGINT first, so the bench stops its server), with
# GPT-OSS-20B's attention shapes and 32 experts in 2 layers (SHAPE, default below; a 3.29 GB version) and VERSIONS
# loads of each way (default 2; version 0 warms up). Each run alternates vLLM reading the files (path) with the
# stage, so each log ends with its own path / stage ratio; OUT gets one log per stage, stdout the loads and tables.
set -u
OUT=$(realpath -m "${1:?usage: $0 OUT}")
mkdir -p "$OUT"
REPO=$(pwd)
LIMIT=${LIMIT:-200}
SHAPE=${SHAPE:---model gptoss --layers 2 --hidden 2880 --heads 64 --kv-heads 8 --experts 32}
for stage in ${STAGES:-direct stream device host}; do
    # shellcheck disable=SC2086  # SHAPE is a list of flags
    PYTHONPATH=$REPO:/tmp/site:/tmp/vsite PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 timeout -s INT -k 30 "$LIMIT" \
        python3 benchmarks/vllm_load.py $SHAPE --versions "${VERSIONS:-2}" --stage "$stage" > "$OUT/load-$stage.log" 2>&1
    echo "== $stage: exit $? (124 or 137: past $LIMIT s)" >> "$OUT/load-$stage.log"
    grep -E "^(version|\||==|model)" "$OUT/load-$stage.log"
    for p in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null); do kill -9 "$p"; done  # a server left
done
