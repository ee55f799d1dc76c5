"""huggingface_hub at the lowest version pyproject allows: pulls work and failures stay one line.

The venv holds the newest huggingface_hub; a user's resolver may pick any
version in pyproject's range. The lowest one is read from pyproject's
dependency line, installed once per machine (with its own dependencies: 1.x
brings httpx, 2.x httpx2) into a folder under EDGELLM_CACHE, and put first on
PYTHONPATH of a child `python -m edgellm.cli pull`. A `sitecustomize` beside it
records which huggingface_hub that very process imported, so the test cannot
pass on the venv's version by accident.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from support.gguf_files import write_stub_gguf
from support.helpers import ROOT, CliResult, assert_one_line_error, cli_argv, shared_cache
from support.hubserver import HubServer

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

REPO = "edge/min-GGUF"
FILE = "min-Q8_0.gguf"

PROBE = """
import atexit, json, os, sys

def _report():
    m = sys.modules.get("huggingface_hub")
    with open(os.environ["HF_PROBE_OUT"], "w") as fh:
        json.dump({"version": getattr(m, "__version__", None), "file": getattr(m, "__file__", None)}, fh)

atexit.register(_report)
"""


def lowest_allowed() -> str:
    """The `>=` bound of huggingface-hub in pyproject's dependencies (an upper bound must be there too)."""
    from packaging.requirements import Requirement

    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    req = next(Requirement(d) for d in deps if Requirement(d).name.replace("_", "-") == "huggingface-hub")
    lower = [s.version for s in req.specifier if s.operator == ">="]
    assert len(lower) == 1, f"pyproject must give huggingface-hub one lower bound: {req}"
    assert any(s.operator == "<" for s in req.specifier), f"pyproject must cap huggingface-hub at the last tested major: {req}"
    return lower[0]


@pytest.fixture(scope="module")
def lowest_hub() -> tuple[str, Path]:
    """(version, folder) with that huggingface_hub and its dependencies, installed once per machine."""
    import filelock

    version = lowest_allowed()
    target = shared_cache() / "test-deps" / f"huggingface_hub-{version}-py{sys.version_info[0]}{sys.version_info[1]}"
    target.parent.mkdir(parents=True, exist_ok=True)
    with filelock.FileLock(str(target) + ".lock", timeout=900):
        if not (target / ".complete").exists():
            tmp = target.with_name(target.name + f".{os.getpid()}.partial")
            proc = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "pip",
                    "install",
                    "--quiet",
                    "--disable-pip-version-check",
                    "--target",
                    str(tmp),
                    f"huggingface_hub=={version}",
                ],
                capture_output=True,
                text=True,
                timeout=900,
            )
            assert proc.returncode == 0, f"installing huggingface_hub=={version} failed: {proc.stderr[-2000:]}"
            (tmp / ".complete").write_text(version + "\n")
            if target.exists():  # a half-made folder of an interrupted run
                import shutil

                shutil.rmtree(target)
            tmp.rename(target)
    return version, target


def pull(args: list, *, hub_dir: Path, probe_dir: Path, endpoint: str, tmp_path: Path) -> tuple[CliResult, dict]:
    out = tmp_path / f"probe-{len(list(tmp_path.glob('probe-*.json')))}.json"
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(probe_dir), str(hub_dir)]),
        HF_PROBE_OUT=str(out),
        HF_ENDPOINT=endpoint,
        EDGELLM_HUB_RETRIES="2",
        EDGELLM_HUB_BACKOFF="0",
    )
    proc = subprocess.run(cli_argv("pull", *args), env=env, capture_output=True, text=True, timeout=300)
    res = CliResult(proc.returncode, proc.stdout, proc.stderr)
    assert out.is_file(), f"the probe did not report (did the CLI skip atexit?): {res}"
    return res, json.loads(out.read_text())


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed on exit: nothing listens there


def test_lowest_allowed_huggingface_hub_pulls_and_fails_in_one_line(lowest_hub, tmp_path):
    version, hub_dir = lowest_hub
    probe_dir = tmp_path / "probe"
    probe_dir.mkdir()
    (probe_dir / "sitecustomize.py").write_text(PROBE)
    src = write_stub_gguf(tmp_path / FILE, pad_mib=3)  # 3.1 MiB: fetched in 1 MiB ranged segments

    def imported(probe: dict) -> None:
        from packaging.version import Version

        assert probe["version"] and Version(probe["version"]) == Version(version), probe
        assert Path(probe["file"]).resolve().is_relative_to(hub_dir.resolve()), probe

    with HubServer({REPO: {FILE: src}}, lfs_min_size=64) as hub:
        # a repo the Hub does not have: its 404, in one line
        res, probe = pull(
            ["edge/no-such-GGUF", "--file", FILE, "--no-progress"],
            hub_dir=hub_dir,
            probe_dir=probe_dir,
            endpoint=hub.url,
            tmp_path=tmp_path,
        )
        imported(probe)
        assert_one_line_error(res)
        assert "edge/no-such-GGUF" in res.stderr and "404" in res.stderr, res
        assert "internal error" not in res.stderr and "ModuleNotFoundError" not in res.stderr, res

        # a good pull: every segment lands first time (1.x once failed its size check on each after the first)
        res, probe = pull(
            [REPO, "--file", FILE, "--json", "--no-progress"],
            hub_dir=hub_dir,
            probe_dir=probe_dir,
            endpoint=hub.url,
            tmp_path=tmp_path,
        )
        imported(probe)
        assert res.exit_code == 0, res
        assert res.json()["sha256"] == hub.file(REPO, FILE).sha256
        ranges = [
            tuple(map(int, r.range.removeprefix("bytes=").split("-")))
            for r in hub.requests
            if r.method == "GET" and r.path.startswith("/cdn-lfs/")
        ]
        # each byte asked for once, in order: no segment was fetched again
        assert len(ranges) >= 3 and ranges[0][0] == 0 and ranges[-1][1] == src.stat().st_size - 1, ranges
        assert all(b[0] == a[1] + 1 for a, b in zip(ranges, ranges[1:])), ranges
        assert "retry" not in res.stderr, res

    # nothing listening: the transport error is recognised (retried, then one line), not an internal error
    res, probe = pull(
        ["edge/any-GGUF", "--file", FILE, "--no-progress"],
        hub_dir=hub_dir,
        probe_dir=probe_dir,
        endpoint=f"http://127.0.0.1:{closed_port()}",
        tmp_path=tmp_path,
    )
    imported(probe)
    assert_one_line_error(res)
    assert "could not reach" in res.stderr and "after 2 attempts" in res.stderr, res
    assert "internal error" not in res.stderr and "ModuleNotFoundError" not in res.stderr, res
