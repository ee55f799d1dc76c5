#!/usr/bin/env bash
# Builds llama.cpp's reference tools (llama-bench, llama-perplexity, llama-server,
# llama-quantize) from the very llama.cpp tree vendored in the pinned
# llama-cpp-python sdist, with the same CPU flags as the Python bindings.
# That makes them the fair baseline for every ratio edgellm publishes.
#
# They are built with shared libraries (llama.cpp's own default, and how
# llama-cpp-python builds the libllama/libggml that edgellm calls): a static
# build runs pp512 a few percent faster here (docs/bench.md), so a static
# baseline would measure the linking, not edgellm. The libraries sit beside
# the tools (RUNPATH $ORIGIN), so the bin folder can be used where it is.
#
# Usage: build_llama_tools.sh [TOOL...]   (default: the tools the suite needs)
# Cached under $EDGELLM_CACHE/llama-tools/<version>-<flags key>-shared/bin;
# prints that bin folder on stdout. Idempotent: a finished tool is reused.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_cpu_flags.sh

ARGS="$(edgellm_cmake_args "${EDGELLM_GPU:-}")"
KEY="$(edgellm_flags_key "$ARGS")"
OUT="$EDGELLM_CACHE/llama-tools/$LLAMA_CPP_PYTHON_VERSION-$KEY-shared"
# llama-server: the reference for the server tests' logprobs and embeddings (tests/test_server_tools.py);
# llama-completion: the baseline of scripts/bench_chat.py and bench_speculative.py (without it in the
# default set, EDGELLM_LLAMA_TOOLS=$(build_llama_tools.sh) pointed those scripts at a folder lacking it)
TOOLS="${*:-llama-bench llama-perplexity llama-quantize llama-imatrix ggml-rpc-server llama-server llama-completion}"

have_all() { for t in $TOOLS; do [ -x "$OUT/bin/$t" ] || return 1; done; }
if have_all; then echo "$OUT/bin"; exit 0; fi
# One build at a time per flag set: the test suite, scripts and a second
# shell may all ask at once, and two cmake runs in one build folder break it.
mkdir -p "$OUT"
exec 9>"$OUT/.lock"
flock 9
if have_all; then echo "$OUT/bin"; exit 0; fi

say() { echo "[build_llama_tools] $*" >&2; }
edgellm_build_env
SDIST="$(edgellm_sdist)"
# Configured through llama-cpp-python's own top-level CMake project, as the
# wheels are, so the objects ccache keeps from the wheel built for these flags
# are the tools' too (_cpu_flags.sh, edgellm_build_env). The tree is kept:
# asking for one more tool later (llama-server for the load test, say)
# compiles only that tool.
TOP="$EDGELLM_CACHE/build/tools-$KEY"
[ -f "$TOP/src/CMakeLists.txt" ] || TOP="$(edgellm_build_tree "tools-$KEY" "$SDIST")"
BUILD="$TOP/build"
say "configuring with: $ARGS"
cmake -S "$TOP/src" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DCMAKE_BUILD_RPATH='$ORIGIN' \
    -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF $ARGS >&2
say "building $TOOLS ($(nproc) jobs; a few minutes, less with ccache after setup.sh)"
cmake --build "$BUILD" --config Release -j "$(nproc)" --target $TOOLS >&2
mkdir -p "$OUT/bin"
# libraries first, tools last and each by rename: have_all never sees a half-copied tool
cp -a "$BUILD"/bin/*.so* "$OUT/bin/"
for t in $TOOLS; do cp "$BUILD/bin/$t" "$OUT/bin/.$t.partial" && mv "$OUT/bin/.$t.partial" "$OUT/bin/$t"; done
echo "$OUT/bin"
