# Sourced by setup.sh and build_llama_tools.sh so the Python bindings and the
# llama.cpp reference tools are always built with the same CPU flags: every
# speed ratio we publish depends on that.
#
# GGML_NATIVE (the default) enables whatever the compiler sees on the build
# host, including the AMX tile path, which dies with SIGILL under hypervisors
# that hide AMX state from the guest. So on x86-64 we turn NATIVE off and list
# the SIMD extensions the kernel reports in /proc/cpuinfo, never AMX.

LLAMA_CPP_PYTHON_VERSION="0.3.36"
EDGELLM_CACHE="${EDGELLM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/edgellm}"

edgellm_cmake_args() {
    local gpu="${1:-}" args arch flags
    arch="$(uname -m)"
    # GGML_RPC: `edgellm worker` and `--rpc` reach llama.cpp's RPC backend
    # through ctypes; it is a small, plain-C backend, so every build has it.
    args="-DLLAVA_BUILD=OFF -DGGML_RPC=ON"
    case "$arch" in
        x86_64|amd64)
            flags=" $(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | cut -d: -f2) "
            if [ "$(uname -s)" = "Darwin" ]; then
                flags=" $(sysctl -n machdep.cpu.features machdep.cpu.leaf7_features 2>/dev/null | tr 'A-Z.' 'a-z_') "
            fi
            has() { case "$flags" in *" $1 "*) echo ON ;; *) echo OFF ;; esac; }
            args="$args -DGGML_NATIVE=OFF"
            args="$args -DGGML_AVX=$(has avx) -DGGML_AVX2=$(has avx2)"
            args="$args -DGGML_FMA=$(has fma) -DGGML_F16C=$(has f16c) -DGGML_BMI2=$(has bmi2)"
            args="$args -DGGML_AVX_VNNI=$(has avx_vnni)"
            args="$args -DGGML_AVX512=$(has avx512f) -DGGML_AVX512_VBMI=$(has avx512vbmi)"
            args="$args -DGGML_AVX512_VNNI=$(has avx512_vnni) -DGGML_AVX512_BF16=$(has avx512_bf16)"
            args="$args -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
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
edgellm_flags_key() {
    printf '%s' "$1" | sha256sum | cut -c1-12
}
