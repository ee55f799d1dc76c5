#!/usr/bin/env bash
# Sets up (idempotent) and runs the test suite. Extra arguments go to pytest.
#
#   scripts/test.sh              the whole suite (~15-20 min on 2 cores)
#   scripts/test.sh -k store     a slice
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
echo "[test] checking the import layers (contracts in pyproject.toml)"
.venv/bin/lint-imports --no-cache --no-logo
echo "[test] linting: ruff check, ruff format --check, mypy (configuration in pyproject.toml)"
.venv/bin/ruff check edgellm quant tui
.venv/bin/ruff format --check edgellm quant tui
.venv/bin/mypy
echo "[test] building llama.cpp's reference tools (cached after the first run)"
EDGELLM_LLAMA_TOOLS="$(scripts/build_llama_tools.sh)"
export EDGELLM_LLAMA_TOOLS
# CI runs pytest with -q, which hides pytest's header: the free disk is said here, so a run that
# fails on "not enough disk" says at once why
echo "[test] running pytest ($(df -h --output=avail "${TMPDIR:-/tmp}" | tail -1 | tr -d ' ') free in ${TMPDIR:-/tmp})"
exec .venv/bin/python -m pytest "$@"
