#!/usr/bin/env bash
# Sets up edgellm in ./.venv with a llama.cpp build that runs on this CPU.
#
#   scripts/setup.sh                 CPU build (AVX/AVX2/AVX512 as the CPU allows)
#   scripts/setup.sh --gpu cuda      also offload to CUDA (needs nvcc); or metal, vulkan
#
# Idempotent: a second run reuses the venv and the wheel built for the same
# flags (kept in $EDGELLM_CACHE/wheels/<flags key>/), so it takes seconds.
# The build is proven by `edgellm doctor`'s subprocess self-test when the
# default model is present.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT="$PWD"
source scripts/_cpu_flags.sh

GPU=""
while [ $# -gt 0 ]; do
    case "$1" in
        --gpu) GPU="${2:-}"; shift 2 ;;
        --gpu=*) GPU="${1#--gpu=}"; shift ;;
        -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
        *) echo "setup.sh: unknown option $1" >&2; exit 2 ;;
    esac
done
say() { echo "[setup] $*"; }

PY="${PYTHON:-}"
if [ -z "$PY" ]; then
    for c in python3 python3.13 python3.12 python3.11 python3.10; do
        if command -v "$c" >/dev/null && "$c" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then PY="$c"; break; fi
    done
fi
[ -n "$PY" ] || { echo "setup.sh: Python >= 3.10 is required" >&2; exit 1; }

case "$GPU" in
    "") ;;
    cuda) command -v nvcc >/dev/null || { echo "setup.sh: --gpu cuda needs the CUDA toolkit (nvcc) on PATH" >&2; exit 1; } ;;
    metal) [ "$(uname -s)" = Darwin ] || { echo "setup.sh: --gpu metal is for macOS" >&2; exit 1; } ;;
    vulkan) command -v glslc >/dev/null || { echo "setup.sh: --gpu vulkan needs the Vulkan SDK (glslc) on PATH" >&2; exit 1; } ;;
    *) echo "setup.sh: --gpu takes cuda, metal or vulkan" >&2; exit 2 ;;
esac

if [ ! -x .venv/bin/python ]; then
    say "creating .venv with $($PY --version)"
    "$PY" -m venv .venv
fi
VPY="$ROOT/.venv/bin/python"
"$VPY" -m pip install -q --disable-pip-version-check --upgrade pip >/dev/null 2>&1 || true

ARGS="$(edgellm_cmake_args "$GPU")"
KEY="$(edgellm_flags_key "$ARGS")"
WHEELS="$EDGELLM_CACHE/wheels/$KEY"
say "llama.cpp CPU flags: $ARGS"
WHEEL="$(ls "$WHEELS"/llama_cpp_python-"$LLAMA_CPP_PYTHON_VERSION"-*.whl 2>/dev/null | head -1 || true)"
if [ -z "$WHEEL" ]; then
    say "building llama-cpp-python $LLAMA_CPP_PYTHON_VERSION for these flags (about 6-10 min on 2 cores; once per machine)"
    mkdir -p "$WHEELS.partial"
    # --no-binary: a prebuilt wheel would carry someone else's CPU flags.
    CMAKE_ARGS="$ARGS" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc 2>/dev/null || echo 2)" \
        "$VPY" -m pip wheel -q --disable-pip-version-check --no-deps --no-binary llama-cpp-python \
        "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" -w "$WHEELS.partial"
    rm -rf "$WHEELS" && mv "$WHEELS.partial" "$WHEELS"
    WHEEL="$(ls "$WHEELS"/llama_cpp_python-*.whl | head -1)"
else
    say "reusing the wheel built for these flags: $WHEEL"
fi
INSTALLED_KEY="$(cat .venv/.edgellm-llama-key 2>/dev/null || true)"
if [ "$INSTALLED_KEY" != "$KEY" ] || ! "$VPY" -c 'import llama_cpp' 2>/dev/null; then
    say "installing llama-cpp-python into .venv"
    "$VPY" -m pip install -q --disable-pip-version-check --force-reinstall --no-deps "$WHEEL"
    echo "$KEY" > .venv/.edgellm-llama-key
fi
say "installing edgellm (editable) with the server, plot and test extras"
"$VPY" -m pip install -q --disable-pip-version-check -e ".[serve,plot,test]"

say "checking the build"
if "$VPY" -m edgellm.cli doctor --no-self-test >/dev/null; then :; else
    echo "setup.sh: doctor reports a problem with the build (see above)" >&2; exit 1
fi
say "done. Activate with: source .venv/bin/activate   (or run .venv/bin/edgellm)"
