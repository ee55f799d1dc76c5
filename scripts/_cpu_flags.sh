# Sourced by setup.sh and build_llama_tools.sh so the Python bindings and the
# llama.cpp reference tools are always built with the same CPU flags: every
# speed ratio we publish depends on that.
#
# GGML_NATIVE (the default) enables whatever the compiler sees on the build
# host, including the AMX tile path, which dies with SIGILL under hypervisors
# that hide AMX state from the guest. So on x86-64 we turn NATIVE off and list
# the SIMD extensions the kernel reports in /proc/cpuinfo, never AMX.

LLAMA_CPP_PYTHON_VERSION="0.3.36"
# The one CPU-feature table (cmake option, ggml name, /proc/cpuinfo and sysctl spellings), shared
# with edgellm.engine.cpu_features: a spelling fixed there is fixed here.
EDGELLM_CPU_TABLE="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)/edgellm/engine/cpu_features.tsv"
EDGELLM_CACHE="${EDGELLM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/edgellm}"

# The host's flags, one line, in the OS's spelling: /proc/cpuinfo (or the file
# EDGELLM_CPUINFO names: recorded flag lines of another CPU), else macOS's sysctl.
edgellm_host_flags() {
    local info="${EDGELLM_CPUINFO:-/proc/cpuinfo}"
    if [ -r "$info" ]; then
        grep -m1 -E '^(flags|Features)' "$info" | cut -d: -f2
    elif [ "$(uname -s)" = "Darwin" ]; then
        sysctl -n machdep.cpu.features machdep.cpu.leaf7_features 2>/dev/null | tr '\n' ' '
    fi
}

# -DGGML_<X>=ON|OFF for the table's x86 build rows, in the table's order: ON
# exactly when the kernel lists the feature, AMX always OFF.
edgellm_cpu_build_args() {
    local os=linux
    [ -r "${EDGELLM_CPUINFO:-/proc/cpuinfo}" ] || os=macos
    awk -F'\t' -v flags=" $(edgellm_host_flags) " -v os="$os" '
        /^#/ || $1 == "cmake" || $5 != "x86" || $6 == "-" { next }
        { name = (os == "linux") ? $3 : $4; on = ($6 == "host" && index(flags, " " name " ") > 0) ? "ON" : "OFF"
          out = out (out == "" ? "" : " ") "-D" $1 "=" on }
        END { print out }' "$EDGELLM_CPU_TABLE"
}

edgellm_cmake_args() {
    local gpu="${1:-}" args arch
    arch="$(uname -m)"
    # GGML_RPC: `edgellm worker` and `--rpc` reach llama.cpp's RPC backend
    # through ctypes; it is a small, plain-C backend, so every build has it.
    args="-DLLAVA_BUILD=OFF -DGGML_RPC=ON"
    case "$arch" in
        x86_64|amd64)
            args="$args -DGGML_NATIVE=OFF $(edgellm_cpu_build_args)"
            ;;
        *)
            args="$args -DGGML_NATIVE=ON"
            ;;
    esac
    case "$gpu" in
        "") ;;
        cuda) args="$args -DGGML_CUDA=ON" ;;
        metal) args="$args -DGGML_METAL=ON" ;;
        vulkan) args="$args -DGGML_VULKAN=ON" ;;
        *) echo "unknown --gpu '$gpu' (expected cuda, metal or vulkan)" >&2; return 2 ;;
    esac
    echo "$args"
}

# The portable build: the CPU backend as loadable libraries, one per x86-64
# level (x64, sse42, sandybridge, haswell ... zen4, sapphirerapids), chosen at
# run time by edgellm (edgellm/engine/backends.py), so one wheel runs on every
# CPU. llama-cpp-python does not install the variants itself: GGML_BACKEND_DIR
# (typed STRING, else CMake makes it absolute against the build folder) puts
# them in the wheel's llama_cpp/lib beside libggml-base.so, found by $ORIGIN.
# On other architectures llama.cpp offers no variant set here: one native
# loadable CPU backend.
edgellm_portable_cmake_args() {
    local args='-DLLAVA_BUILD=OFF -DGGML_RPC=ON -DGGML_BACKEND_DL=ON -DGGML_BACKEND_DIR:STRING=llama_cpp/lib -DCMAKE_INSTALL_RPATH=$ORIGIN'
    case "$(uname -m)" in
        x86_64|amd64) args="$args -DGGML_CPU_ALL_VARIANTS=ON -DGGML_NATIVE=OFF" ;;
        *) args="$args -DGGML_NATIVE=ON" ;;
    esac
    echo "$args"
}

# A short stable key for a flag set, so a wheel built for one set is never
# installed for another (pip's own wheel cache ignores CMAKE_ARGS).
# The patches applied to the sdist are part of the key: a wheel built before a
# patch changed is never reused after it.
EDGELLM_PATCHES_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/patches"
edgellm_flags_key() {
    { printf '%s' "$1"; cat "$EDGELLM_PATCHES_DIR"/*.patch 2>/dev/null; } | sha256sum | cut -c1-12
}

# Every llama.cpp build (each wheel, and the reference tools) happens in
# $EDGELLM_CACHE/build/<name>/{src,build}: a fresh copy of the pinned sdist and
# the binary folder of its top-level CMake project. One layout for all of them
# lets ccache, when installed, reuse one build's objects in the next: with
# CCACHE_BASEDIR at the build root the compile commands hold relative paths,
# equal between builds; and ccache's preprocessor mode still hits where a
# define differs but no source reads it (libllama and common do not read
# GGML_USE_VULKAN or GGML_BACKEND_DL). On a fresh CI machine the tools and the
# Vulkan variant then compile little beyond their own files (docs in README,
# "Development"). Without ccache nothing changes but the folder.
edgellm_build_env() {
    export CCACHE_DIR="${CCACHE_DIR:-$EDGELLM_CACHE/ccache}"
    export CCACHE_BASEDIR="$EDGELLM_CACHE/build"
    export CCACHE_NOHASHDIR=1
    # One compiler name for every build: ccache hashes it, and scikit-build-core's
    # CMake picks gcc where the system's picks cc (the same binary).
    if [ -z "${CC:-}" ] && command -v gcc >/dev/null; then export CC=gcc; fi
    if [ -z "${CXX:-}" ] && command -v g++ >/dev/null; then export CXX=g++; fi
    # The same generator for the wheels (scikit-build-core reads it) and the
    # tools: Ninja and Make run the compiler from different folders.
    if [ -z "${CMAKE_GENERATOR:-}" ]; then
        if command -v ninja >/dev/null; then export CMAKE_GENERATOR=Ninja; else export CMAKE_GENERATOR="Unix Makefiles"; fi
    fi
}

# The pinned sdist, downloaded once into $EDGELLM_CACHE/dl (through pip, so
# a pip.conf index or find-links applies); prints its path.
edgellm_sdist() {
    local py="${1:-python3}" sdist="$EDGELLM_CACHE/dl/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz"
    if [ ! -f "$sdist" ]; then
        mkdir -p "$EDGELLM_CACHE/dl"
        # without build isolation when this Python has scikit-build-core (no
        # build env to make just to read the metadata); else with it, quietly
        "$py" -m pip download --no-deps --no-binary :all: --no-build-isolation -q --disable-pip-version-check \
            "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" -d "$EDGELLM_CACHE/dl" >/dev/null 2>&1 || \
        "$py" -m pip download --no-deps --no-binary :all: -q --disable-pip-version-check \
            "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" -d "$EDGELLM_CACHE/dl" >&2
    fi
    [ -f "$sdist" ] || { echo "could not fetch the llama-cpp-python $LLAMA_CPP_PYTHON_VERSION sdist" >&2; return 1; }
    echo "$sdist"
}

# A fresh source copy in $EDGELLM_CACHE/build/<name>/src; prints the folder
# holding src/ and build/. Fresh because llama-cpp-python installs its
# libraries into its own source tree, which a later wheel would package.
edgellm_build_tree() {
    local name="$1" sdist="$2" top="$EDGELLM_CACHE/build/$1"
    rm -rf "$top" && mkdir -p "$top"
    tar xzf "$sdist" -C "$top" && mv "$top/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION" "$top/src"
    # scripts/patches: what edgellm needs of llama.cpp that the pinned tree does
    # not offer (each patch says why); the tools get them too, so "the same tree"
    # stays true for every comparison.
    local p
    for p in "$EDGELLM_PATCHES_DIR"/*.patch; do
        [ -f "$p" ] || continue
        # patch(1) where the system has it, else git, which anyone with the clone
        # has (the ceiling keeps it from applying to a repository above the cache)
        if command -v patch >/dev/null; then
            patch -s -p1 -d "$top/src" < "$p" >&2
        else
            (cd "$top/src" && GIT_CEILING_DIRECTORIES="$top" git apply -p1 "$p") >&2
        fi || { echo "could not apply $p to the llama-cpp-python sdist" >&2; return 1; }
    done
    echo "$top"
}
