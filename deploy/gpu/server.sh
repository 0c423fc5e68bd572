#!/usr/bin/env bash
# An inference server packed in parts for a lent GPU machine: vLLM 0.26 (deploy/gpu/pack-vllm.sh) or SGLang 0.5.14
# (deploy/gpu/pack-sglang.sh) made them in .gpu/. From the repository root on the GPU machine, one call per part while
# the machine stays held (/tmp stays):
#     bash deploy/gpu/server.sh NAME stash                 # keep the NAME parts this call carried in /tmp/NAME-parts
#     bash deploy/gpu/server.sh NAME install               # all parts there: check, unpack into NAME's site; this
#                                                          # checkout and .whl/ (pyzmq, msgspec, megatron-core) into
#                                                          # /tmp/site
#     bash deploy/gpu/server.sh NAME smoke OUT [MODEL_DIR] # import NAME; a server per model: one generation
#     bash deploy/gpu/server.sh NAME env                   # prints the PYTHONPATH line the rest uses
# NAME vllm: site /tmp/vsite, PYTHONPATH=/tmp/site:/tmp/vsite (deploy/gpu/vllm.sh is `server.sh vllm`); NAME sglang:
# site /tmp/ssite, PYTHONPATH=/tmp/site:/tmp/ssite (its transformers 5.8.1 then shadows the image's 5.17).
# The sha256 and the zstandard wheel (the image has no zstd binary) may come with any call up to install's.
# smoke builds the tiny Llama of configs/quickstart-vllm.yaml in bf16 and starts the server on it, then on MODEL_DIR
# if given (GPT-OSS-20B's MXFP4 checkpoint from benchmarks/startup.py --make: served natively in MXFP4), with token-id
# prompts (skip_tokenizer_init): vLLM's OpenAI server answers POST /v1/completions, SGLang's launch_server POST
# /generate (input_ids, return_logprob; --attention-backend triton: the pack has no FlashAttention 3). SMOKE_ARGS are
# added to the server's flags (later flags win). Logs and answers in OUT.
set -u -o pipefail
NAME=${1:-}; cmd=${2:-}; shift 2 || true
R=${GPU_ROOT:-/tmp}  # another root only to try the steps elsewhere (tests on a CPU machine)
case $NAME in
    vllm) SITE=$R/vsite ;;
    sglang) SITE=$R/ssite ;;
    *) echo "usage: $0 vllm|sglang stash | install | smoke OUT [MODEL_DIR] | env"; exit 2 ;;
esac
PARTS=$R/$NAME-parts OURS=$R/site
export PYTHONPATH=$OURS:$SITE PYTHONUNBUFFERED=1
case $cmd in
    stash)
        mkdir -p "$PARTS" && cp -v .gpu/"$NAME".* .gpu/zstandard-*.whl "$PARTS"/ 2>/dev/null; ls "$PARTS" ;;
    install)
        mkdir -p "$PARTS"
        [[ -f $PARTS/$NAME.sha256 ]] || cp .gpu/"$NAME".sha256 "$PARTS"/ 2>/dev/null
        compgen -G "$PARTS/zstandard-*.whl" > /dev/null || cp .gpu/zstandard-*.whl "$PARTS"/ 2>/dev/null
        want=$(cat "$PARTS/$NAME.sha256" 2>/dev/null) got=$(cat "$PARTS/$NAME".part* | sha256sum | cut -d' ' -f1)
        [[ $want == "$got" ]] || {
            echo "parts incomplete or damaged: sha256 $got, want ${want:-?} ($(ls "$PARTS"))"; exit 1; }
        unzst() { zstd -d --long=27 -q; }
        if ! command -v zstd > /dev/null; then  # the GPU image has none: the zstandard wheel pack-parts.sh put in .gpu/
            python3 -m pip install -q --no-deps --target "$R/zsite" "$PARTS"/zstandard-*.whl || exit 1
            unzst() { PYTHONPATH=$R/zsite python3 -c "import sys, zstandard
zstandard.ZstdDecompressor(max_window_size=2**27).copy_stream(sys.stdin.buffer, sys.stdout.buffer)"; }
        fi
        rm -rf "$SITE" && mkdir -p "$SITE" && cat "$PARTS/$NAME".part* | unzst | tar -C "$SITE" -xf - || exit 1
        python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --upgrade \
            --target "$OURS" .whl/pyzmq-*.whl .whl/msgspec-*.whl .whl/megatron_core-*.whl . || exit 1
        python3 -c "import $NAME, torch, transformers
print('$NAME', $NAME.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)" ;;
    smoke)
        out=$(realpath -m "${1:?OUT}"); model=${2:-}; mkdir -p "$out"
        python3 -c "import $NAME; print('import $NAME', $NAME.__version__)" || exit 1
        tiny=$(mktemp -d)/tiny
        python3 - "$tiny" <<'PY' || exit 1
import sys
import torch
from offpolicy.config import load_config
from offpolicy.models.build import build_model
cfg = load_config("configs/quickstart-vllm.yaml", ["model.dtype=bfloat16"])
build_model(cfg.model, torch.device("cpu")).save_pretrained(sys.argv[1])
PY
        rc=0
        for m in "$tiny" ${model:+"$model"}; do
            base=$(basename "$m") long=()
            [[ $m != "$tiny" ]] && long=("$([[ $NAME == vllm ]] && echo --max-model-len || echo --context-length)" 4096)
            # shellcheck disable=SC2086
            python3 - "$NAME" "$m" 8311 "$out/smoke-$base" "${long[@]}" ${SMOKE_ARGS:-} <<'PY' || rc=1
import json, os, subprocess, sys, time, urllib.error, urllib.request
from offpolicy.rollout.engines.vllm.launch import wait_healthy
name, model, port, out, extra = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5:]
url, t0 = f"http://127.0.0.1:{port}", time.monotonic()
if name == "vllm":
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--skip-tokenizer-init",
           "--dtype", "bfloat16", "--gpu-memory-utilization", "0.5", "--port", str(port), *extra]
    path = "/v1/completions"
    body = dict(model=model, prompt=[1, 2, 3, 4, 5], max_tokens=16, temperature=1.0, return_token_ids=True)
    env = None
else:
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--skip-tokenizer-init",
           "--dtype", "bfloat16", "--mem-fraction-static", "0.5", "--port", str(port),
           "--attention-backend", "triton", *extra]
    path = "/generate"
    body = dict(input_ids=[1, 2, 3, 4, 5], sampling_params=dict(max_new_tokens=16, temperature=1.0),
                return_logprob=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}  # the GPU machine reaches no hub: fail at once, not on a timeout
print(" ".join(cmd[1:]), flush=True)
proc = subprocess.Popen(cmd, stdout=open(out + ".log", "w"), stderr=subprocess.STDOUT, env=env)
try:
    wait_healthy(url, proc, out + ".log", 600)
    print(f"{model}: healthy after {time.monotonic() - t0:.1f} s")
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    t = time.monotonic()
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            answer = json.load(r)
    except urllib.error.HTTPError as e:
        sys.exit(f"  {path} answered {e.code}: {e.read().decode(errors='replace')[:500]}")
    open(out + ".json", "w").write(json.dumps(answer, indent=1))
    if name == "vllm":
        c = answer["choices"][0]
        print(f"  {path} in {time.monotonic() - t:.2f} s: token ids {c['token_ids']}, finish {c['finish_reason']}")
    else:
        meta = answer["meta_info"]
        logprobs = [round(lp, 3) for lp, *_ in meta.get("output_token_logprobs") or []]
        print(f"  {path} in {time.monotonic() - t:.2f} s: output ids {answer['output_ids']}, finish "
              f"{meta.get('finish_reason')}, logprobs {logprobs}, weight_version {meta.get('weight_version')}")
finally:
    proc.terminate()
    proc.wait()
PY
            if [[ $NAME == vllm ]]; then
                grep -E "backend|quantization|Model loading took|KV cache|Error" "$out/smoke-$base.log" | head -n 12
            else
                grep -E "backend|quantization|Load weight|KV Cache|max_total_num_tokens|Error" "$out/smoke-$base.log" \
                    | head -n 12
            fi
        done
        exit $rc ;;
    env) echo "export PYTHONPATH=$PYTHONPATH" ;;
    *) echo "usage: $0 $NAME stash | install | smoke OUT [MODEL_DIR] | env"; exit 2 ;;
esac
