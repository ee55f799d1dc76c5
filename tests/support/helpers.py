"""Constants, the CLI runners and the shared assertions of the test suite.

conftest.py builds its fixtures on these; test modules import them from here
(`from support.helpers import ...`: tests/ is on pytest's pythonpath, see
pyproject.toml). The default model's facts come from its catalog entry in
models.toml, so a test cannot disagree with what `edgellm pull` checks.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from edgellm.models.catalog import load_catalog

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
WIKITEXT = ROOT.parent / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"

# models.toml itself, not EDGELLM_CATALOG: a test that points that elsewhere
# must not change what "the default model" means for the rest of the suite.
DEFAULT_ENTRY = load_catalog(ROOT / "models.toml").default
assert DEFAULT_ENTRY.package is not None, "the default catalog entry must ship in a package"
DEFAULT_REF = DEFAULT_ENTRY.name  # "smollm2-135m-instruct"
DEFAULT_LEVEL = DEFAULT_ENTRY.package.level  # "q4_1"
DEFAULT_NAME = f"{DEFAULT_REF}-{DEFAULT_LEVEL}"  # its name in the store
DEFAULT_SHA256 = DEFAULT_ENTRY.package.sha256
DEFAULT_SIZE = DEFAULT_ENTRY.package.size_bytes
DEFAULT_SOURCE = f"{DEFAULT_ENTRY.package.index}:{DEFAULT_ENTRY.package.requirement}"  # ModelRecord.source


def shared_cache() -> Path:
    """The machine's download cache (EDGELLM_CACHE), shared by every test's own EDGELLM_HOME."""
    env = os.environ.get("EDGELLM_CACHE")
    if env:
        return Path(env)
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("edgellm", appauthor=False))


class CliResult:
    def __init__(self, exit_code: int, stdout: str, stderr: str) -> None:
        self.exit_code, self.stdout, self.stderr = exit_code, stdout, stderr

    def json(self):
        import json

        return json.loads(self.stdout)

    def __repr__(self) -> str:
        return f"CliResult(exit={self.exit_code}, stdout={self.stdout[-500:]!r}, stderr={self.stderr[-500:]!r})"


def cli_argv(*args) -> list[str]:
    return [sys.executable, "-m", "edgellm.cli", *map(str, args)]


def run_cli(
    *args, env: dict | None = None, timeout: float = 600, input: str | None = None, preexec_fn=None, cwd: Path | str | None = None
) -> CliResult:
    """`edgellm ARGS` in a child process. `env` is the whole environment (default: this process's)."""
    proc = subprocess.run(
        cli_argv(*args),
        env=os.environ.copy() if env is None else env,
        capture_output=True,
        text=True,
        timeout=timeout,
        input=input,
        preexec_fn=preexec_fn,
        cwd=cwd,
    )
    return CliResult(proc.returncode, proc.stdout, proc.stderr)


def run_ok(*argv, env: dict | None = None, timeout: float = 1800) -> subprocess.CompletedProcess:
    """`argv` (a llama.cpp tool, a script) run to its end, which must be a success; a failure shows its stderr's tail."""
    proc = subprocess.run([str(a) for a in argv], env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc


def start_cli(*args, env: dict | None = None, preexec_fn=None, text: bool = True) -> subprocess.Popen:
    """`edgellm ARGS` in a child process the test can signal; `env` adds to this process's environment."""
    return subprocess.Popen(
        cli_argv(*args),
        env=dict(os.environ, **(env or {})),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=text,
        preexec_fn=preexec_fn,
    )


def assert_one_line_error(res: CliResult) -> None:
    """The contract for every expected failure: exit != 0, one `error:` line, no traceback."""
    assert res.exit_code != 0, res
    assert "Traceback" not in res.stderr and "Traceback" not in res.stdout, res
    lines = [ln for ln in res.stderr.strip().splitlines() if ln.strip()]
    assert lines and lines[-1].startswith("error: "), res
    assert len([ln for ln in lines if ln.startswith("error: ")]) == 1, res


def assert_refused(cli, home: Path, *args, says: str | list[str]) -> CliResult:
    """`cli(*args)` fails as every refusal must (one `error:` line) with an error
    that says each of `says`, and leaves the store at `home` as it was."""
    before = store_snapshot(home)
    res = cli(*args)
    assert_one_line_error(res)
    for needle in [says] if isinstance(says, str) else says:
        assert needle in res.stderr, (needle, res)
    assert store_snapshot(home) == before
    return res


def refused(cli, home: Path, *args) -> str:
    """assert_refused, and no `.partial` file left anywhere under `home`: the error, for the caller's checks."""
    res = assert_refused(cli, home, *args, says=[])
    assert not list(home.rglob("*.partial"))
    return res.stderr


class CancelAfter:
    """An `on_progress` that records each event's `done` and cancels `token` once
    `done` reaches `n`: a job stopped part-way, at a point the test knows."""

    def __init__(self, n: int) -> None:
        from edgellm.progress import CancelToken

        self.n = n
        self.token = CancelToken()
        self.seen: list[int] = []

    def __call__(self, p) -> None:
        self.seen.append(p.done)
        if p.done >= self.n:
            self.token.cancel()


def store_snapshot(home: Path) -> tuple:
    """The index and the files under the store: equal snapshots mean nothing changed."""
    idx = home / "index.json"
    files = (
        sorted(str(p.relative_to(home)) for p in home.rglob("*") if p.is_file() and p.name != "index.lock")
        if home.exists()
        else []
    )
    return (idx.read_text() if idx.exists() else None, files)


def tamper_manifest(bundle, field: str, value) -> None:
    """Rewrite one field of an exported bundle's manifest: the model's `name`, or a key of its first file."""
    import json

    path = bundle / "manifest.json"
    m = json.loads(path.read_text())
    if field == "name":
        m["models"][0]["name"] = value
    else:
        m["models"][0]["files"][0][field] = value
    path.write_text(json.dumps(m))


def register_default(gguf_path: Path, home: Path | None = None):
    """The default model's GGUF registered (by reference, no copy) in the store at `home` (default: EDGELLM_HOME)."""
    from edgellm.gguf.reader import read_gguf
    from edgellm.models.resolve import record_from_info
    from edgellm.models.store import Store

    rec = record_from_info(
        DEFAULT_NAME, read_gguf(gguf_path), [str(gguf_path)], DEFAULT_SHA256, source=DEFAULT_SOURCE, catalog=DEFAULT_REF
    )
    return (Store(home) if home is not None else Store()).register(rec)


def llama_tools_dir() -> Path:
    """llama.cpp's reference tools: $EDGELLM_LLAMA_TOOLS (as scripts/test.sh sets it), else built and
    cached by scripts/build_llama_tools.sh (instant once built on this machine)."""
    env = os.environ.get("EDGELLM_LLAMA_TOOLS")
    if env:
        assert Path(env).is_dir(), f"EDGELLM_LLAMA_TOOLS={env} is not a folder"
        return Path(env)
    proc = subprocess.run(["bash", str(ROOT / "scripts" / "build_llama_tools.sh")], capture_output=True, text=True, timeout=3600)
    assert proc.returncode == 0, f"building llama.cpp's tools failed: {proc.stderr[-2000:]}"
    return Path(proc.stdout.strip().splitlines()[-1])
