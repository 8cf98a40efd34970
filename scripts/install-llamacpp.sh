#!/usr/bin/env bash
# Build llama.cpp (the copy vendored by llama-cpp-python's sdist) and its Python bindings into .venv-llamacpp/,
# for the llama.cpp adapter (hybridqual.adapters.llamacpp). Idempotent: a second run checks and exits in seconds.
#
#   bash scripts/install-llamacpp.sh              # fresh CPU machine or CI; needs python3 >= 3.9, cmake, a C++ compiler
#   bash scripts/install-llamacpp.sh --no-server  # skip the llama-server binary
#
# What ends up in $VENV (default .venv-llamacpp/, override with HQ_LLAMACPP_VENV):
#   src/llama_cpp_python-$VERSION/   the sdist, unpacked (vendor/llama.cpp is the llama.cpp source, with its .git)
#   build/                           one cmake build of vendor/llama.cpp: shared libllama/libggml* and bin/llama-server
#   lib/python3.X/site-packages/     llama_cpp_python (pure Python; installed with LLAMA_BUILD=OFF, then the libs
#                                    of build/ copied into llama_cpp/lib), numpy, gguf-py (vendored), safetensors, torch,
#                                    transformers, sentencepiece (the converter imports torch and transformers)
#   converter/                       convert_hf_to_gguf.py, the conversion/ package it imports and its builtin
#                                    vocabularies (models/ggml-vocab-*.gguf), from the sdist
#   llamacpp.json                    versions and the llama.cpp commit (read by hybridqual.adapters.llamacpp)
# Building libllama once with cmake (instead of pip's own cmake build) lets the same build give llama-server.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
VENV=${HQ_LLAMACPP_VENV:-$ROOT/.venv-llamacpp}
VERSION=${LLAMACPP_PY_VERSION:-0.3.36}
# torch: the system python's own build when it has one (e.g. a +cpu wheel on a CPU machine), else the registry's
SYS_TORCH=$(${PYTHON3:-python3} -c 'from importlib.metadata import version; print(version("torch"))' 2>/dev/null || true)
TORCH_SPEC=${LLAMACPP_TORCH_SPEC:-torch${SYS_TORCH:+==$SYS_TORCH}}
TRANSFORMERS_SPEC=${LLAMACPP_TRANSFORMERS_SPEC:-transformers==4.57.6}
SERVER=1
for a in "$@"; do
  case "$a" in
    --no-server) SERVER=0 ;;
    -h|--help) sed -n 2,17p "$0"; exit 0 ;;
    *) echo "install-llamacpp.sh: unknown argument $a" >&2; exit 2 ;;
  esac
done
export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2}
NICE=(nice -n 19)
t0=$SECONDS
CHANGED=0
say() { CHANGED=1; echo "install-llamacpp.sh: $* ($((SECONDS - t0)) s)"; }
found() { "$PY" -c 'import importlib.util, sys; sys.exit(0 if all(importlib.util.find_spec(m) for m in sys.argv[1:]) else 1)' "$@"; }

PY3=${PYTHON3:-python3}
[ -x "$VENV/bin/python" ] || { "$PY3" -m venv "$VENV"; say "venv $VENV made"; }
PY="$VENV/bin/python"
PIP=("$PY" -m pip install -q --disable-pip-version-check)
have() { "$PY" - "$@" <<'EOF' 2>/dev/null
import sys
from importlib.metadata import version
sys.exit(0 if all(version(n) == v for n, v in (a.split("==") for a in sys.argv[1:])) else 1)
EOF
}

SRC="$VENV/src/llama_cpp_python-$VERSION"
VENDOR="$SRC/vendor/llama.cpp"
if [ ! -f "$SRC/.unpacked" ]; then
  mkdir -p "$VENV/src"
  [ -f "$VENV/src/llama_cpp_python-$VERSION.tar.gz" ] || \
    "$PY" -m pip download -q --disable-pip-version-check --no-deps --no-binary :all: --no-build-isolation \
      -d "$VENV/src" "llama-cpp-python==$VERSION" 2>/dev/null || \
    "$PY" -m pip download -q --disable-pip-version-check --no-deps --no-binary :all: \
      -d "$VENV/src" "llama-cpp-python==$VERSION"
  rm -rf "$SRC"
  tar -xzf "$VENV/src/llama_cpp_python-$VERSION.tar.gz" -C "$VENV/src"
  touch "$SRC/.unpacked"
  say "sdist unpacked"
fi

BUILD="$VENV/build"
TARGETS=(llama)
[ "$SERVER" = 1 ] && TARGETS+=(llama-server)
need_build=0
[ -f "$BUILD/bin/libllama.so" ] || need_build=1
[ "$SERVER" = 1 ] && [ ! -x "$BUILD/bin/llama-server" ] && need_build=1
if [ "$need_build" = 1 ]; then
  tb=$SECONDS
  "${NICE[@]}" cmake -S "$VENDOR" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
    -DCMAKE_INSTALL_RPATH='$ORIGIN' -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_TOOLS=ON \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF \
    >"$VENV/cmake-configure.log" 2>&1 || { tail -30 "$VENV/cmake-configure.log" >&2; exit 1; }
  "${NICE[@]}" cmake --build "$BUILD" --target "${TARGETS[@]}" >"$VENV/cmake-build.log" 2>&1 || \
    { tail -30 "$VENV/cmake-build.log" >&2; exit 1; }
  echo "$((SECONDS - tb))" >"$BUILD/build_seconds"
  say "llama.cpp built (${TARGETS[*]}) in $((SECONDS - tb)) s"
fi

# The Python bindings: pure Python (ctypes); LLAMA_BUILD=OFF skips the package's own cmake build of llama.cpp.
if ! have "llama_cpp_python==$VERSION"; then
  CMAKE_ARGS="-DLLAMA_BUILD=OFF" "${NICE[@]}" "${PIP[@]}" --no-deps "$SRC"
  say "llama_cpp_python $VERSION installed"
fi
SITE=$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
LIBDIR="$SITE/llama_cpp/lib"
if ! cmp -s "$BUILD/bin/libllama.so" "$LIBDIR/libllama.so" 2>/dev/null; then
  mkdir -p "$LIBDIR"
  cp -a "$BUILD"/bin/lib*.so* "$LIBDIR/"
  say "shared libraries copied into $LIBDIR"
fi
found numpy typing_extensions diskcache jinja2 || { "${PIP[@]}" numpy typing-extensions diskcache jinja2; say "numpy"; }
# gguf: the converter needs the gguf-py of its own llama.cpp commit; the registry's gguf 0.19.0 (the same version
# label) predates it (no MODEL_ARCH.GRANITE_SWA, no LazyChunkedTensor), so the vendored gguf-py is installed.
GGUF_SITE=$("$PY" -c 'import gguf, os; print(os.path.dirname(gguf.__file__))' 2>/dev/null || true)
cmp -s "$VENDOR/gguf-py/gguf/constants.py" "$GGUF_SITE/constants.py" 2>/dev/null || \
  { "${PIP[@]}" --no-deps --force-reinstall "$VENDOR/gguf-py"; say "gguf-py installed from $VENDOR/gguf-py"; }
found yaml tqdm requests || { "${PIP[@]}" pyyaml tqdm requests; say "gguf-py's dependencies installed"; }
found safetensors sentencepiece || { "${PIP[@]}" safetensors sentencepiece; say "safetensors"; }
# The converter imports torch (tensor handling) and transformers (AutoConfig, tokenizers) at module level.
found torch || { "${NICE[@]}" "${PIP[@]}" "$TORCH_SPEC"; say "torch installed"; }
found transformers || { "${PIP[@]}" "$TRANSFORMERS_SPEC"; say "transformers installed"; }

CONV="$VENV/converter"
if [ ! -f "$CONV/.from-$VERSION" ]; then
  rm -rf "$CONV"
  mkdir -p "$CONV"
  cp "$VENDOR/convert_hf_to_gguf.py" "$CONV/"
  cp -r "$VENDOR/conversion" "$CONV/conversion"
  # the vocabularies the converter falls back to for a folder without tokenizer files (read from sys.path[0]/models)
  mkdir -p "$CONV/models"
  cp "$VENDOR"/models/ggml-vocab-gpt-neox.gguf "$VENDOR"/models/ggml-vocab-llama-spm.gguf "$CONV/models/"
  touch "$CONV/.from-$VERSION"
  say "converter extracted into $CONV"
fi

COMMIT=$(git -C "$VENDOR" rev-parse HEAD 2>/dev/null || echo unknown)
"$PY" - "$VENV/llamacpp.json" "$VERSION" "$COMMIT" "$SERVER" "$BUILD" <<'EOF'
import json, sys
from importlib.metadata import version
out, ver, commit, server, build = sys.argv[1:]
info = {"llama_cpp_python": ver, "llama_cpp_commit": commit, "gguf": version("gguf"), "torch": version("torch"),
        "transformers": version("transformers"), "server": f"{build}/bin/llama-server" if server == "1" else None}
try:
    info["build_seconds"] = int(open(f"{build}/build_seconds").read())
except OSError:
    pass
json.dump(info, open(out, "w"), indent=1)
EOF
# the full import check (torch, transformers: ~10 s) only after a change; a no-op run checks llama_cpp alone
CHECK='import llama_cpp, gguf; llama_cpp.llama_backend_init()'
[ "$CHANGED" = 1 ] && CHECK="$CHECK; import convert_hf_to_gguf"
(cd "$CONV" && "$PY" -c "$CHECK" >/dev/null) || \
  { echo "install-llamacpp.sh: the install does not import (llama_cpp, gguf, the converter)" >&2; exit 1; }
[ "$SERVER" = 1 ] && { "$BUILD/bin/llama-server" --version >/dev/null 2>&1 || \
  { echo "install-llamacpp.sh: $BUILD/bin/llama-server does not run" >&2; exit 1; }; }
say "$VENV ready: llama-cpp-python $VERSION, llama.cpp ${COMMIT:0:9}$([ "$SERVER" = 1 ] && echo ', llama-server')"
