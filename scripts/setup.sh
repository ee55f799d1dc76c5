#!/usr/bin/env bash
# Sets up edgellm in ./.venv with a llama.cpp build that runs on this CPU.
#
#   scripts/setup.sh                 CPU build (AVX/AVX2/AVX512 as the CPU allows)
#   scripts/setup.sh --gpu cuda      also offload to CUDA (needs nvcc); or metal, vulkan
#   scripts/setup.sh --gpu vulkan --vulkan-headers DIR
#                                    Vulkan with headers from DIR/include when the
#                                    system's are too old (Debian 12's 1.3.239 are)
#   scripts/setup.sh --venv DIR      install into DIR instead of ./.venv (e.g. a
#                                    GPU build beside the CPU one in .venv)
#   scripts/setup.sh --portable --venv .venv-portable
#                                    one build for every x86-64 CPU: the CPU backend
#                                    as loadable variants, the best one that passes
#                                    the self-test chosen at run time (~12 min build)
#
# Switching the wheel in a venv is one command: rerun with or without --gpu.
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
VENV="$ROOT/.venv"
VK_HEADERS=""
PORTABLE=""
while [ $# -gt 0 ]; do
    case "$1" in
        --gpu) GPU="${2:-}"; shift 2 ;;
        --gpu=*) GPU="${1#--gpu=}"; shift ;;
        --venv) VENV="$(realpath -m "${2:?--venv needs a folder}")"; shift 2 ;;
        --vulkan-headers) VK_HEADERS="$(realpath "${2:?--vulkan-headers needs a folder}")"; shift 2 ;;
        --portable) PORTABLE=1; shift ;;
        -h|--help) sed -n '2,21p' "$0"; exit 0 ;;
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

# The pinned ggml-vulkan.cpp uses vk::LayerSettingEXT (VK_EXT_layer_settings,
# headers >= 1.3.261); older headers fail deep inside the build, so say it now.
vulkan_check() {
    local missing="" inc="${VK_HEADERS:+$VK_HEADERS/include}"
    command -v glslc >/dev/null || missing="$missing glslc"
    [ -e /usr/include/vulkan/vulkan.h ] || [ -n "$inc" ] || missing="$missing libvulkan-dev"
    ldconfig -p 2>/dev/null | grep -q 'libvulkan\.so ' || [ -e /usr/lib/x86_64-linux-gnu/libvulkan.so ] \
        || missing="$missing libvulkan-dev"
    [ -d /usr/include/spirv ] || missing="$missing spirv-headers"
    if [ -n "$missing" ]; then
        echo "setup.sh: --gpu vulkan needs:$missing (Debian/Ubuntu: apt-get install -y mesa-vulkan-drivers libvulkan-dev glslc spirv-headers)" >&2
        exit 1
    fi
    ls /usr/share/vulkan/icd.d/*.json >/dev/null 2>&1 \
        || say "note: no Vulkan driver is installed (apt-get install -y mesa-vulkan-drivers gives lavapipe, a software device)"
    if [ -n "$inc" ]; then
        grep -qs LayerSettingEXT "$inc"/vulkan/vulkan_structs.hpp \
            || { echo "setup.sh: $inc/vulkan has no vk::LayerSettingEXT: Vulkan headers >= 1.3.261 are needed" >&2; exit 1; }
    elif ! grep -qs LayerSettingEXT /usr/include/vulkan/vulkan_structs.hpp; then
        echo "setup.sh: the system's Vulkan headers ($(grep -m1 -o 'VK_HEADER_VERSION [0-9]*' /usr/include/vulkan/vulkan_core.h)) are too old for llama.cpp (>= 1.3.261 needed); pass --vulkan-headers DIR (a Vulkan-Headers checkout with the C++ headers)" >&2
        exit 1
    fi
}

[ -n "$PORTABLE" ] && [ -n "$GPU" ] && { echo "setup.sh: --portable is a CPU build; it does not combine with --gpu" >&2; exit 2; }
case "$GPU" in
    "") ;;
    cuda) command -v nvcc >/dev/null || { echo "setup.sh: --gpu cuda needs the CUDA toolkit (nvcc) on PATH" >&2; exit 1; } ;;
    metal) [ "$(uname -s)" = Darwin ] || { echo "setup.sh: --gpu metal is for macOS" >&2; exit 1; } ;;
    vulkan) vulkan_check ;;
    *) echo "setup.sh: --gpu takes cuda, metal or vulkan" >&2; exit 2 ;;
esac

if [ ! -x "$VENV/bin/python" ]; then
    say "creating $VENV with $($PY --version)"
    "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
"$VPY" -m pip install -q --disable-pip-version-check --upgrade pip >/dev/null 2>&1 || true

ARGS="$(edgellm_cmake_args "$GPU")"
KEY="$(edgellm_flags_key "$ARGS")"
if [ -n "$PORTABLE" ]; then
    # Its own key and a "portable-" prefix: offline_bundle.sh looks for it there.
    ARGS="$(edgellm_portable_cmake_args)"
    KEY="portable-$(edgellm_flags_key "$ARGS")"
fi
WHEELS="$EDGELLM_CACHE/wheels/$KEY"
say "llama.cpp CPU flags: $ARGS"
cached_wheel() { ls "$WHEELS"/llama_cpp_python-"$LLAMA_CPP_PYTHON_VERSION"-*.whl 2>/dev/null | head -1 || true; }
WHEEL="$(cached_wheel)"
if [ -z "$WHEEL" ]; then
    # One build per flag set at a time: two would share $EDGELLM_CACHE/build/$KEY.
    mkdir -p "$EDGELLM_CACHE/wheels"
    exec 8>"$EDGELLM_CACHE/wheels/.$KEY.lock"
    flock 8
    WHEEL="$(cached_wheel)"
fi
if [ -z "$WHEEL" ]; then
    say "building llama-cpp-python $LLAMA_CPP_PYTHON_VERSION for these flags (about 6-10 min on 2 cores; once per machine)"
    mkdir -p "$WHEELS.partial"
    BUILD_ARGS="$ARGS"
    # The headers folder is where the headers come from, not a build choice:
    # it stays out of the cache key.
    [ -n "$VK_HEADERS" ] && [ "$GPU" = vulkan ] && BUILD_ARGS="$ARGS -DVulkan_INCLUDE_DIR=$VK_HEADERS/include"
    # Built from a fresh copy of the pinned sdist in $EDGELLM_CACHE/build/$KEY,
    # never a prebuilt wheel (it would carry someone else's CPU flags), with
    # the build folder beside it: ccache, when installed, then shares objects
    # with the other builds (_cpu_flags.sh, edgellm_build_env).
    # --no-cache-dir: pip's own wheel cache ignores CMAKE_ARGS and would hand
    # back the wheel built for another flag set (it gave a Vulkan venv the CPU one).
    edgellm_build_env
    TOP="$(edgellm_build_tree "$KEY" "$(edgellm_sdist "$VPY")")"
    CMAKE_ARGS="$BUILD_ARGS" CMAKE_BUILD_PARALLEL_LEVEL="$(nproc 2>/dev/null || echo 2)" \
        "$VPY" -m pip wheel -q --disable-pip-version-check --no-cache-dir --no-deps \
        --config-settings=build-dir="$TOP/build" "$TOP/src" -w "$WHEELS.partial"
    # ccache holds the objects; the tree itself is 1-2 GB
    rm -rf "$TOP"
    if [ -n "$GPU" ] && ! "$VPY" -c 'import sys, zipfile; sys.exit(not any("libggml-"+sys.argv[2] in n for n in zipfile.ZipFile(sys.argv[1]).namelist()))' \
            "$(ls "$WHEELS.partial"/llama_cpp_python-*.whl | head -1)" "$GPU"; then
        echo "setup.sh: the wheel built for --gpu $GPU has no ggml-$GPU backend; not caching it" >&2
        rm -rf "$WHEELS.partial"; exit 1
    fi
    # llama-cpp-python installs no backend it does not name: without the
    # CPU variants a portable wheel could not run a model at all.
    if [ -n "$PORTABLE" ] && ! "$VPY" -c 'import sys, zipfile; sys.exit(not any("/libggml-cpu" in n for n in zipfile.ZipFile(sys.argv[1]).namelist()))' \
            "$(ls "$WHEELS.partial"/llama_cpp_python-*.whl | head -1)"; then
        echo "setup.sh: the portable wheel holds no libggml-cpu-* backend; not caching it" >&2
        rm -rf "$WHEELS.partial"; exit 1
    fi
    rm -rf "$WHEELS" && mv "$WHEELS.partial" "$WHEELS"
    WHEEL="$(cached_wheel)"
else
    say "reusing the wheel built for these flags: $WHEEL"
fi
# The marker names the wheel file's hash, not only the flags: a wheel rebuilt
# for the same flags is installed too.
STAMP="$KEY $(sha256sum "$WHEEL" | cut -c1-16)"
INSTALLED_KEY="$(cat "$VENV/.edgellm-llama-key" 2>/dev/null || true)"
if [ "$INSTALLED_KEY" != "$STAMP" ] || ! "$VPY" -c 'import llama_cpp' 2>/dev/null; then
    say "installing llama-cpp-python into $VENV"
    "$VPY" -m pip install -q --disable-pip-version-check --force-reinstall --no-deps "$WHEEL"
    echo "$STAMP" > "$VENV/.edgellm-llama-key"
fi
say "installing edgellm (editable) with the server, plot and test extras"
"$VPY" -m pip install -q --disable-pip-version-check -e ".[serve,plot,test]"
# An editable install compiles nothing; a wheel's install compiles every module.
# Compiled here, each command starts as it would from a wheel, also where
# PYTHONDONTWRITEBYTECODE keeps Python from caching them itself (+0.05 s a command).
"$VPY" -m compileall -q edgellm quant tui >/dev/null || true

say "checking the build"
if "$VPY" -m edgellm.cli doctor --no-self-test >/dev/null; then :; else
    echo "setup.sh: doctor reports a problem with the build (see above)" >&2; exit 1
fi
say "done. Activate with: source $VENV/bin/activate   (or run $VENV/bin/edgellm)"
