#!/usr/bin/env bash
# vLLM 0.26 on a lent GPU machine, carried in parts (deploy/gpu/pack-vllm.sh made them in .gpu/): deploy/gpu/server.sh
# vllm, under its old name. From the repository root on the GPU machine, one call per part while the machine stays
# held (/tmp stays):
#     bash deploy/gpu/vllm.sh stash                 # keep the parts this call carried in /tmp/vllm-parts
#     bash deploy/gpu/vllm.sh install               # all parts there: check, unpack into /tmp/vsite; this checkout
#                                                   # and .whl/ (pyzmq, msgspec, megatron-core) into /tmp/site
#     bash deploy/gpu/vllm.sh smoke OUT [MODEL_DIR] # import vllm; a server per model: an OpenAI completion
#     bash deploy/gpu/vllm.sh env                   # prints the PYTHONPATH line the rest uses (/tmp/site:/tmp/vsite)
exec bash "$(dirname "$0")/server.sh" vllm "$@"
