#!/usr/bin/env bash
# On a machine with an NVIDIA GPU: installs what is missing (the project's venv, then a CUDA build of
# torch in it), runs the lossless tests that need CUDA, then scripts/gpu_check.py (lossless on the
# device, racer bench on the default model in float16/bfloat16/float32, the cost curve of a random
# ~1B Llama), and prints one table. About 5 minutes on a recent GPU; the whole run is bounded by 8.
#
#   bash scripts/gpu_check.sh            # table on stdout, also in gpu_check.md
#   RACER_TORCH_INDEX=https://download.pytorch.org/whl/cu126 bash scripts/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
command -v nvidia-smi >/dev/null 2>&1 || { echo "gpu_check: no nvidia-smi: not a machine with an NVIDIA GPU" >&2; exit 2; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader

bash scripts/setup.sh
if ! .venv/bin/python -c 'import sys, torch; sys.exit(not torch.cuda.is_available())' 2>/dev/null; then
  # setup.sh pins a CPU build; the same version from PyTorch's CUDA index.
  version=$(.venv/bin/python -c 'import torch; print(torch.__version__.split("+")[0])')
  .venv/bin/python -m pip install -q --force-reinstall --no-deps "torch==$version" \
    --index-url "${RACER_TORCH_INDEX:-https://download.pytorch.org/whl/cu128}"
  .venv/bin/python -c 'import torch; assert torch.cuda.is_available(), "torch still sees no CUDA device"'
fi

deadline=$((SECONDS + 480))
left() { echo $((deadline - SECONDS)); }
# The lossless tests that run on CUDA (they skip elsewhere), then the contract on the CPU side.
timeout "$(left)" .venv/bin/python -m pytest -q tests/verifier/test_engine.py -k cuda
timeout "$(left)" env PYTHONPATH="$PWD" .venv/bin/python scripts/gpu_check.py --device cuda --json gpu_check.json \
  | tee gpu_check.md
