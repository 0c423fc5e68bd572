#!/usr/bin/env bash
# The rollout engines' GPU tests against the real servers, on one GPU (issue 54), after `bash deploy/gpu/server.sh
# vllm install` and `bash deploy/gpu/server.sh sglang install` on this machine (/tmp/vsite, /tmp/ssite, /tmp/site).
# From the repository root:
#     bash benchmarks/servers_gpu1.sh OUT
# runs two pytest suites at once on the GPU, each under `timeout` (LIMIT, default 540 s; SIGINT first, so the tests'
# `finally` stops the servers they started), with -s (the tests print their figures), this checkout first on
# PYTHONPATH, then /tmp/site and the server's own site (never both sites: SGLang's transformers 5.8.1 would shadow
# the image's 5.17 under vLLM):
#   vllm    tests/gpu/test_vllm_gpu.py -k "$VLLM_K" (default "fp8 or mxfp4 or llama": fp8 and MXFP4 GPT-OSS versions
#           served natively, loaded and proven by fingerprint, and the tiny Llama's loads read `direct` on vLLM's V2
#           model runner; a fixed 1 GiB KV cache, so SGLang beside it moves nothing);
#   sglang  tests/gpu/test_sglang_gpu.py and tests/integration/test_sglang_real.py in SGLANG_TESTS' order, a pytest
#           process each (a dying SGLang scheduler SIGQUITs its parent; default: GPT-OSS bf16 loads proven by
#           fingerprint in process and over HTTP, GPT-OSS MXFP4 loaded in place, then by restarts, the fp8
#           attention SGLang holds in bf16 (why fp8 GPT-OSS versions are refused for it), native, then the tiny
#           Llama in process and over HTTP); mem_fraction_static 0.3.
# SHARDED=1 on a machine of 2 GPUs then runs the sharded in-place MXFP4 tests on both, one after the other (each its own
# LIMIT): vLLM's TP2 and TP2 x EP servers (`-k sharded_server`), SGLang's TP2 engine.
# OUT gets the pytest logs and servers-gpu1.tgz (the logs and the tests' tmp dirs: server logs, configs);
# the figures the tests printed and each suite's summary go to stdout.
set -u
OUT=$(realpath -m "${1:?usage: $0 OUT}")
mkdir -p "$OUT"
REPO=$(pwd)
LIMIT=${LIMIT:-540}
suite() {  # NAME SITE PYTEST-ARGS...
    local name=$1 site=$2; shift 2
    PYTHONPATH=$REPO:/tmp/site:$site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 timeout -s INT -k 30 "$LIMIT" python3 -m pytest -s \
        -p no:cacheprovider --basetemp="$OUT/tmp-$name" "$@" > "$OUT/$name.log" 2>&1
    echo "== $name: exit $? (124 or 137: past $LIMIT s)" >> "$OUT/$name.log"
}
each() {  # NAME SITE TEST...: one pytest process per test, one after another, within LIMIT altogether: a dying SGLang
    # scheduler SIGQUITs its parent process, which took the whole suite down with it on the GPU (exit 137)
    local name=$1 site=$2 t0=$SECONDS left; shift 2
    : > "$OUT/$name.log"; mkdir -p "$OUT/tmp-$name"
    for t in "$@"; do
        left=$((LIMIT - (SECONDS - t0)))
        (( left > 30 )) || { echo "== $name: $t not run (LIMIT $LIMIT s spent)" >> "$OUT/$name.log"; continue; }
        PYTHONPATH=$REPO:/tmp/site:$site PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 timeout -s INT -k 30 "$left" python3 -m pytest \
            -s -p no:cacheprovider --basetemp="$OUT/tmp-$name/$(basename "${t##*::}")" "$t" >> "$OUT/$name.log" 2>&1
        echo "== $name: $t exit $? (124 or 137: past its $left s, or killed)" >> "$OUT/$name.log"
    done
}
T=tests/integration/test_sglang_real.py G=tests/gpu/test_sglang_gpu.py L=tests/gpu/test_sglang_lowbit_gpu.py
SGLANG_TESTS=${SGLANG_TESTS:-"$G::test_gptoss_bf16_loads_in_process_are_proven_by_fingerprint \
$G::test_gptoss_bf16_loads_into_a_server_are_proven_by_fingerprint $T::test_gptoss_mxfp4_versions_load_in_place \
$T::test_gptoss_mxfp4_versions_each_start_a_new_engine \
$L::test_gptoss_fp8_attention_is_held_in_bf16 $T::test_gptoss_native_versions_update_in_place \
$T::test_in_process_engine_generates_swaps_and_refuses_a_broken_version $T::test_http_engine_drives_a_real_sglang_server"}
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
t0=$SECONDS
suite vllm /tmp/vsite tests/gpu/test_vllm_gpu.py -k "${VLLM_K:-fp8 or mxfp4 or llama}" &
# shellcheck disable=SC2086
each sglang /tmp/ssite $SGLANG_TESTS &
wait
echo "both suites done in $((SECONDS - t0)) s"
names="vllm sglang"
if [[ -n ${SHARDED:-} ]] && (( $(nvidia-smi -L | wc -l) >= 2 )); then  # the 2-GPU tests, one after the other
    t1=$SECONDS
    suite vllm-sharded /tmp/vsite tests/gpu/test_vllm_gpu.py -k sharded_server
    each sglang-sharded /tmp/ssite "$T::test_gptoss_mxfp4_versions_load_in_place_into_a_tp2_engine"
    echo "sharded tests done in $((SECONDS - t1)) s"
    names="$names vllm-sharded sglang-sharded"
fi
for name in $names; do
    echo "==== $name"
    grep -E "^(vLLM |SGLang |GPT-OSS loads|fp8 version|mxfp4 version|version [0-9]|(FAILED|ERROR|SKIPPED) |=+ .* in [0-9.]+s|== )" \
        "$OUT/$name.log" | tail -n 40
done
# shellcheck disable=SC2046
tar czf "$OUT/servers-gpu1.tgz" --exclude='*.safetensors' --exclude='vllm-cache*' -C "$OUT" \
    $(for n in $names; do echo "$n.log" "tmp-$n"; done) 2>/dev/null
for n in $names; do rm -rf "$OUT/tmp-$n"; done
ls -la "$OUT"
