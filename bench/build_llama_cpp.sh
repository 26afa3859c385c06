#!/usr/bin/env bash
# `make llama-cpp`: llama.cpp for the engine benchmark's GPT peer (bench/enginebench/llama_cpp.py), built here from
# the llama.cpp source vendored in the llama-cpp-python sdist (PyPI is the only registry this project reaches), into
# .cache/llama.cpp/ (git-ignored). Not part of `make test` or CI: the bench skips llama.cpp while it is missing.
#
#   1. `pip download --no-binary :all: --no-deps llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION` into
#      .cache/llama.cpp/sdist, unpacked there (its vendor/llama.cpp is the source; the Python bindings are not built);
#   2. cmake (Release, GGML_NATIVE=ON: this CPU's ISA; no curl, no OpenSSL, no web UI: nothing is downloaded at
#      build or run time) into .cache/llama.cpp/build, only the targets the bench runs: llama-server (the timed
#      system: greedy continuations, token ids in and out, also the agreement check's) and llama-batched-bench (the
#      tool's own benchmark, a row of its own). About 16 minutes at -j2 on 2 busy cores (2026-12, AMD EPYC).
#
# Re-running it when both binaries exist does nothing (LLAMA_CPP_REBUILD=1 rebuilds). JOBS (default 2) is the make
# parallelism; on a busy machine run it under `nice -n 19`. The version is pinned: the GGUF it loads is written by
# the `gguf` package of the same llama.cpp revision (0.19.0 for llama-cpp-python 0.3.36, locked in requirements/).
set -euo pipefail
cd "$(dirname "$0")/.."

LLAMA_CPP_PYTHON_VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
CACHE=${LLAMA_CPP_CACHE:-.cache/llama.cpp}
PYTHON=${PYTHON:-python3}
JOBS=${JOBS:-2}
TARGETS=(llama-batched-bench llama-server)

SDIST_DIR=$CACHE/sdist
SOURCE=$SDIST_DIR/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION/vendor/llama.cpp
BUILD=$CACHE/build
step() { printf '\n=== %s (%s)\n' "$1" "$(date +%T)"; }

built=1
for target in "${TARGETS[@]}"; do [ -x "$BUILD/bin/$target" ] || built=0; done
if [ "$built" = 1 ] && [ "${LLAMA_CPP_REBUILD:-0}" = 0 ]; then
  echo "llama.cpp: built in $BUILD/bin (${TARGETS[*]}); LLAMA_CPP_REBUILD=1 rebuilds it"
  exit 0
fi
command -v cmake >/dev/null || { echo "build_llama_cpp.sh: cmake not found (sudo apt-get install cmake)" >&2; exit 1; }

# --- 1. the source -------------------------------------------------------------------------------------------------
if [ ! -f "$SOURCE/CMakeLists.txt" ]; then
  step "llama-cpp-python $LLAMA_CPP_PYTHON_VERSION sdist -> $SDIST_DIR"
  mkdir -p "$SDIST_DIR"
  "$PYTHON" -m pip download --quiet --no-binary :all: --no-deps --dest "$SDIST_DIR" \
    "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
  tar -xzf "$SDIST_DIR/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz" -C "$SDIST_DIR"
fi

# --- 2. the build --------------------------------------------------------------------------------------------------
step "cmake configure $SOURCE -> $BUILD"
cmake -S "$SOURCE" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
  -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_APP=OFF
step "cmake build ${TARGETS[*]} (-j$JOBS)"
start=$(date +%s)
cmake --build "$BUILD" --config Release -j "$JOBS" --target "${TARGETS[@]}"
echo "llama.cpp: built ${TARGETS[*]} into $BUILD/bin in $(( $(date +%s) - start )) s"
