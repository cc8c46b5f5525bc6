#!/usr/bin/env bash
# Build llama.cpp's own C++ tools (llama-bench, llama-server, llama-perplexity, llama-quantize, llama-imatrix) from the
# llama.cpp source vendored in the llama-cpp-python sdist on PyPI, for `tokenmill bench compare`.
#
#   benchmarks/build_llama_cpp.sh [DEST]
#
# DEST (default: $TOKENMILL_CACHE/llama.cpp, else $XDG_CACHE_HOME/tokenmill/llama.cpp, else
# ~/.cache/tokenmill/llama.cpp) receives:
#   bin/llama-bench bin/llama-server bin/llama-perplexity bin/llama-quantize bin/llama-imatrix
#                                                statically linked, native CPU
#   convert_hf_to_gguf.py conversion/ gguf-py/   the HF -> GGUF converter (Python; needs torch, numpy,
#                                                sentencepiece, transformers; run it with PYTHONPATH=DEST/gguf-py)
#   BUILD_INFO                                   source version and cmake options
# and keeps the unpacked source and the build tree in DEST/src (delete it to save ~1 GB; a rerun rebuilds).
#
# Environment: LLAMA_CPP_PYTHON_VERSION (default 0.3.36), LLAMA_CPP_SDIST (an already downloaded sdist
# tarball to use instead of downloading), JOBS (parallel compile jobs, default: all cores).
# Needs python3 with pip, cmake >= 3.14 and a C++17 compiler; on a bare Debian/Ubuntu machine the missing
# ones are installed with apt-get (as root), cmake otherwise with pip into a private virtual environment.
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
if [ -n "${TOKENMILL_CACHE:-}" ]; then
    cache="$TOKENMILL_CACHE"
else
    cache="${XDG_CACHE_HOME:-$HOME/.cache}/tokenmill"
fi
DEST="${1:-$cache/llama.cpp}"
JOBS="${JOBS:-$(nproc 2>/dev/null || echo 2)}"
TARGETS=(llama-bench llama-server llama-perplexity llama-quantize llama-imatrix)

log() { echo "[build_llama_cpp] $*" >&2; }

apt_install() {  # apt_install PKG...: only where apt-get exists and we are root
    if command -v apt-get >/dev/null && [ "$(id -u)" = 0 ]; then
        log "installing $* with apt-get"
        DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "$@" >&2 \
            || { apt-get update >&2 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "$@" >&2; }
        return 0
    fi
    return 1
}

mkdir -p "$DEST/src"
DEST="$(cd "$DEST" && pwd)"
SRC_ROOT="$DEST/src"

# --- tools ------------------------------------------------------------------------------------------------
PY="$(command -v python3 || command -v python || true)"
[ -n "$PY" ] || apt_install python3 python3-pip python3-venv || { log "python3 is required"; exit 1; }
PY="${PY:-$(command -v python3)}"
if ! "$PY" -m pip --version >/dev/null 2>&1; then
    apt_install python3-pip python3-venv || { log "pip is required (python3 -m pip)"; exit 1; }
fi
if ! command -v c++ >/dev/null && ! command -v g++ >/dev/null && ! command -v clang++ >/dev/null; then
    apt_install g++ make || { log "a C++ compiler (g++ or clang++) is required"; exit 1; }
fi
cmake_ok() {  # cmake present and >= 3.14
    command -v cmake >/dev/null || return 1
    local v; v="$(cmake --version | head -n1 | awk '{print $3}')"
    [ "$(printf '%s\n3.14\n' "$v" | sort -V | head -n1)" = "3.14" ]
}
if ! cmake_ok; then
    apt_install cmake || true
fi
if ! cmake_ok; then
    log "installing cmake with pip into $DEST/src/tools"
    "$PY" -m venv "$SRC_ROOT/tools" >&2 || { apt_install python3-venv && "$PY" -m venv "$SRC_ROOT/tools" >&2; }
    "$SRC_ROOT/tools/bin/python" -m pip install -q cmake ninja >&2
    export PATH="$SRC_ROOT/tools/bin:$PATH"
fi
if ! command -v make >/dev/null && ! command -v ninja >/dev/null; then
    apt_install make || "$PY" -m pip install -q ninja >&2 || { log "make or ninja is required"; exit 1; }
fi

# --- source -------------------------------------------------------------------------------------------------
SDIST="${LLAMA_CPP_SDIST:-$SRC_ROOT/llama_cpp_python-$VERSION.tar.gz}"
if [ ! -f "$SDIST" ]; then
    log "downloading the llama-cpp-python $VERSION sdist from the package index"
    "$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$SRC_ROOT" >&2
    SDIST="$(ls "$SRC_ROOT"/llama_cpp_python-"$VERSION".tar.gz)"
fi
UNPACKED="$SRC_ROOT/llama_cpp_python-$VERSION"
if [ ! -f "$UNPACKED/vendor/llama.cpp/CMakeLists.txt" ]; then
    log "unpacking $SDIST"
    rm -rf "$UNPACKED"
    tar -xzf "$SDIST" -C "$SRC_ROOT"
fi
LLAMA="$UNPACKED/vendor/llama.cpp"
[ -f "$LLAMA/CMakeLists.txt" ] || { log "no llama.cpp source in $UNPACKED/vendor/llama.cpp"; exit 1; }

# --- build --------------------------------------------------------------------------------------------------
BUILD="$SRC_ROOT/build-$VERSION"
# A native build is for this CPU: a build tree made on another CPU (a copied cache) starts afresh.
cpu_id="$(uname -m) $(grep -m1 -E '^(flags|Features)' /proc/cpuinfo 2>/dev/null | md5sum | cut -c1-12)"
if [ -d "$BUILD" ] && [ -f "$BUILD/CPU" ] && [ "$(cat "$BUILD/CPU")" != "$cpu_id" ]; then
    log "the build tree was made on another CPU; rebuilding"
    rm -rf "$BUILD"
fi
CMAKE_OPTS=(
    -DCMAKE_BUILD_TYPE=Release
    -DGGML_NATIVE=ON                # this machine's CPU features (AVX2/AVX-512/AMX/NEON ...)
    -DBUILD_SHARED_LIBS=OFF         # self-contained binaries
    -DLLAMA_OPENSSL=OFF             # no HTTPS client: models are local files
    -DLLAMA_CURL=OFF
    -DLLAMA_BUILD_TESTS=OFF
    -DLLAMA_BUILD_EXAMPLES=OFF
    -DLLAMA_BUILD_TOOLS=ON
    -DLLAMA_BUILD_SERVER=ON
    -DLLAMA_BUILD_APP=OFF
    -DLLAMA_BUILD_UI=OFF            # no npm
    -DLLAMA_USE_PREBUILT_UI=OFF     # no download of the web UI at build time
)
# On CPUs with AMX, llama.cpp's AMX matrix path (taken by a native build) crashes in ggml_backend_amx_mul_mat
# (llama.cpp issue 20824, open, not fixed in this version). Build for the same CPU features minus AMX:
# every other path, the AVX-512 VNNI/BF16 kernels and the x86 weight repacking included, stays as native.
flags=" $(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | cut -d: -f2-) "
if [[ "$flags" == *" amx_int8 "* ]]; then
    log "AMX CPU: building without llama.cpp's AMX path (it crashes here), with the CPU's other features"
    has() { [[ "$flags" == *" $1 "* ]] && echo ON || echo OFF; }
    CMAKE_OPTS=("${CMAKE_OPTS[@]/-DGGML_NATIVE=ON/-DGGML_NATIVE=OFF}"
        -DGGML_SSE42="$(has sse4_2)" -DGGML_AVX="$(has avx)" -DGGML_AVX2="$(has avx2)" -DGGML_FMA="$(has fma)"
        -DGGML_F16C="$(has f16c)" -DGGML_BMI2="$(has bmi2)" -DGGML_AVX_VNNI="$(has avx_vnni)"
        -DGGML_AVX512="$(has avx512bw)" -DGGML_AVX512_VBMI="$(has avx512vbmi)"
        -DGGML_AVX512_VNNI="$(has avx512_vnni)" -DGGML_AVX512_BF16="$(has avx512_bf16)"
        -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
fi
GEN=()
command -v ninja >/dev/null && [ ! -f "$BUILD/Makefile" ] && GEN=(-G Ninja)
log "configuring ($(cmake --version | head -n1))"
cmake -S "$LLAMA" -B "$BUILD" "${GEN[@]}" "${CMAKE_OPTS[@]}" >&2
echo "$cpu_id" > "$BUILD/CPU"
log "building ${TARGETS[*]} with $JOBS jobs"
start=$(date +%s)
cmake --build "$BUILD" --config Release -j "$JOBS" --target "${TARGETS[@]}" >&2
elapsed=$(( $(date +%s) - start ))

# --- install ------------------------------------------------------------------------------------------------
mkdir -p "$DEST/bin"
for t in "${TARGETS[@]}"; do
    install -m 755 "$BUILD/bin/$t" "$DEST/bin/$t"
done
cp "$LLAMA/convert_hf_to_gguf.py" "$DEST/"
for d in conversion gguf-py; do
    if [ -d "$LLAMA/$d" ]; then
        rm -rf "${DEST:?}/$d"
        cp -r "$LLAMA/$d" "$DEST/$d"
    fi
done
{
    echo "source: llama-cpp-python $VERSION sdist, vendor/llama.cpp"
    echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ), compile step ${elapsed}s with $JOBS jobs (a rerun compiles only what changed)"
    echo "compiler: $(${CXX:-c++} --version 2>/dev/null | head -n1)"
    echo "cpu: $(grep -m1 '^model name' /proc/cpuinfo 2>/dev/null | cut -d: -f2- | sed 's/^ //') (built for this CPU)"
    echo "cmake: ${CMAKE_OPTS[*]}"
} > "$DEST/BUILD_INFO"
log "done in ${elapsed}s: $DEST/bin"
echo "$DEST"
