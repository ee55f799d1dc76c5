#!/usr/bin/env bash
# Runs scripts/render_ollama_template.go (built once, cached beside edgellm's other tools):
#   scripts/render_ollama_template.sh MODELFILE < conversation.json
# Needs Go (Debian: apt-get install -y golang-go).
set -euo pipefail
cd "$(dirname "$0")/.."
command -v go >/dev/null || { echo "error: go is not installed (Debian: apt-get install -y golang-go)" >&2; exit 2; }
CACHE="${EDGELLM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/edgellm}/go"
SRC=scripts/render_ollama_template.go
BIN="$CACHE/render_ollama_template-$(sha256sum "$SRC" | cut -c1-12)"
if [ ! -x "$BIN" ]; then
    mkdir -p "$CACHE"
    GOCACHE="${GOCACHE:-$CACHE/build}" GO111MODULE=off go build -o "$BIN.partial" "$SRC" && mv "$BIN.partial" "$BIN"
fi
exec "$BIN" "$@"
