#!/usr/bin/env bash
# Builds llama.cpp's reference tools (llama-bench, llama-perplexity,
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
# prints that bin folder on stdout. Idempotent: a finished tool is reused, and
# the CMake build folder is kept beside it, so asking for one more tool later
# (llama-server for the load test, say) compiles only that tool.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_cpu_flags.sh

ARGS="$(edgellm_cmake_args "${EDGELLM_GPU:-}")"
KEY="$(edgellm_flags_key "$ARGS")"
OUT="$EDGELLM_CACHE/llama-tools/$LLAMA_CPP_PYTHON_VERSION-$KEY-shared"
TOOLS="${*:-llama-bench llama-perplexity llama-quantize llama-imatrix ggml-rpc-server}"

have_all() { for t in $TOOLS; do [ -x "$OUT/bin/$t" ] || return 1; done; }
if have_all; then echo "$OUT/bin"; exit 0; fi
# One build at a time per flag set: the test suite, scripts and a second
# shell may all ask at once, and two cmake runs in one build folder break it.
mkdir -p "$OUT"
exec 9>"$OUT/.lock"
flock 9
if have_all; then echo "$OUT/bin"; exit 0; fi

say() { echo "[build_llama_tools] $*" >&2; }
SDIST="$EDGELLM_CACHE/dl/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz"
if [ ! -f "$SDIST" ]; then
    say "fetching the llama-cpp-python $LLAMA_CPP_PYTHON_VERSION sdist (for its vendored llama.cpp)"
    mkdir -p "$EDGELLM_CACHE/dl"
    python3 -m pip download --no-deps --no-binary :all: --no-build-isolation -q \
        "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" -d "$EDGELLM_CACHE/dl" >&2 || \
    python3 -m pip download --no-deps --no-binary :all: -q \
        "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" -d "$EDGELLM_CACHE/dl" >&2
fi
SRC="$EDGELLM_CACHE/src/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION"
if [ ! -d "$SRC/vendor/llama.cpp" ]; then
    mkdir -p "$EDGELLM_CACHE/src"
    tar xzf "$SDIST" -C "$EDGELLM_CACHE/src"
fi
BUILD="$OUT/build"
say "configuring with: $ARGS"
# LLAVA_BUILD is a llama-cpp-python option, meaningless here; drop it.
cmake -S "$SRC/vendor/llama.cpp" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release \
    -DBUILD_SHARED_LIBS=ON -DCMAKE_BUILD_RPATH='$ORIGIN' -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_SERVER=ON ${ARGS//-DLLAVA_BUILD=OFF/} >&2
say "building $TOOLS ($(nproc) jobs; a few minutes)"
cmake --build "$BUILD" --config Release -j "$(nproc)" --target $TOOLS >&2
mkdir -p "$OUT/bin"
# libraries first, tools last and each by rename: have_all never sees a half-copied tool
cp -a "$BUILD"/bin/*.so* "$OUT/bin/"
for t in $TOOLS; do cp "$BUILD/bin/$t" "$OUT/bin/.$t.partial" && mv "$OUT/bin/.$t.partial" "$OUT/bin/$t"; done
echo "$OUT/bin"
