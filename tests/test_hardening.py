"""Hardening: full disks, hostile names and paths, the RAM guard.

Proven here, each through the real CLI:

* A disk that fills up *during* pull, quantize, convert and eval (a real 20 MB
  tmpfs filled to ~400 KB free, with the free-space preflight fooled so the
  write itself fails; RLIMIT_FSIZE in the child where mount is not allowed)
  ends in one `error:` line, registers nothing, leaves no temp file after the
  next start, and every file that existed before keeps its sha256. With the
  space back, the same command succeeds.
* The preflight (EDGELLM_FAKE_FREE_BYTES) refuses the same four jobs before
  they write a byte.
* `../`, absolute paths, NUL bytes and 300-character names are refused in
  `--name`, catalog entries (a temp models.toml), Hub filenames (`--file` and a
  hostile repo listing) and bundle manifests.
* The RAM guard refuses a model whose weights + KV exceed available RAM with
  the numbers, and `--force` loads it anyway.

Chat-template sandboxing is proven in tests/test_chat.py, malformed GGUFs in
tests/test_fuzz_gguf.py, kill -9 in scripts/kill_trials.py (docs/hardening.md).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import resource
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

import pytest

from support.gguf_files import TINY_EVAL_ARGS, write_tiny_llama
from support.helpers import DEFAULT_NAME, WIKITEXT, assert_one_line_error, run_cli as _run_cli, store_snapshot, tamper_manifest
from support.hubserver import HubServer

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20
BIG = str(1 << 40)  # what a fooled preflight sees: the disk "looks" empty
REPO = "edge/hard-GGUF"


def file_hashes(home: Path) -> dict[str, str]:
    return {
        str(p.relative_to(home)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in home.rglob("*")
        if p.is_file() and p.name != "index.lock"
    }


def listed(cli) -> list[str]:
    res = cli("models", "list", "--local", "--json")
    assert res.exit_code == 0, res
    return [m["name"] for m in res.json()["models"]]


@pytest.fixture(scope="module")
def tiny_f16(tmp_path_factory) -> Path:
    """A genuinely float llama (2.9 MB) that llama.cpp quantizes and runs."""
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny-F16.gguf")


@pytest.fixture(scope="module")
def small_text(tmp_path_factory) -> Path:
    # The tiny model's byte vocabulary makes one token per byte: 6 KB is plenty for 2 chunks of 64.
    p = tmp_path_factory.mktemp("text") / "text.txt"
    p.write_bytes(WIKITEXT.read_bytes()[:6000])
    return p


# -- a disk that fills up ------------------------------------------------------


@dataclass
class SmallDisk:
    root: Path
    tmpfs: bool
    preexec: Optional[Callable[[], None]] = None

    def fill(self, leave: int) -> None:
        """Leave about `leave` bytes writable: fill the tmpfs, or cap file sizes in the child."""
        if self.tmpfs:
            free = os.statvfs(self.root).f_bavail * os.statvfs(self.root).f_frsize
            with open(self.root / "filler", "wb") as fh:
                os.posix_fallocate(fh.fileno(), 0, max(0, free - leave))
        else:

            def cap() -> None:
                resource.setrlimit(resource.RLIMIT_FSIZE, (leave, leave))

            self.preexec = cap

    def unfill(self) -> None:
        (self.root / "filler").unlink(missing_ok=True)
        self.preexec = None


@contextlib.contextmanager
def small_disk(tmp_path: Path, mechanism: str, size_mb: int = 20) -> Iterator[SmallDisk]:
    """A real 20 MB tmpfs, or (mechanism "rlimit") a per-file size limit in the child (EFBIG)."""
    mnt = tmp_path / "disk"
    mnt.mkdir()
    if mechanism == "rlimit":
        yield SmallDisk(mnt, tmpfs=False)
        return
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_mb}m", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.decode().strip()[:80]}); the rlimit case still runs")
    try:
        yield SmallDisk(mnt, tmpfs=True)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def run_cli(args: list, *, env: dict, preexec=None, timeout: float = 180):
    return _run_cli(*args, env=env, preexec_fn=preexec, timeout=timeout, cwd=ROOT)


def _setup_store(cli, tiny_f16: Path) -> None:
    assert cli("import", tiny_f16, "--name", "tiny-f16").exit_code == 0
    res = cli("quantize", "tiny-f16", "--level", "q8_0", "--no-progress")
    assert res.exit_code == 0, res


JOBS = {
    # job -> (args, the model it would register)
    "quantize": (["quantize", "tiny-f16", "--level", "q4_0", "--no-progress"], "tiny-q4_0"),
    "convert": (["convert", "tiny-q8_0", "--to", "f32", "--no-progress"], "tiny-f32"),
    "eval": (
        ["eval", "tiny-f16", "--levels", "q4_k_m", "--text", "{text}", *TINY_EVAL_ARGS, "--no-progress", "--json"],
        "tiny-q4_k_m",
    ),
    "pull": (["pull", REPO, "--file", "tiny-F16.gguf", "--name", "pulled", "--no-progress"], "pulled"),
}


@pytest.fixture
def hub(tiny_f16, monkeypatch):
    with HubServer({REPO: {"tiny-F16.gguf": tiny_f16}}) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setenv("EDGELLM_HUB_BACKOFF", "0.01")
        monkeypatch.setenv("EDGELLM_HUB_RETRIES", "2")
        yield server


@pytest.mark.parametrize("mechanism", ["tmpfs", "rlimit"])
@pytest.mark.parametrize("job", list(JOBS))
def test_disk_filling_up_mid_write(job, mechanism, tiny_f16, small_text, hub, cli, tmp_path, monkeypatch):
    with small_disk(tmp_path, mechanism) as disk:
        home = disk.root / "home"
        monkeypatch.setenv("EDGELLM_HOME", str(home))
        monkeypatch.setenv("EDGELLM_FAKE_FREE_BYTES", BIG)  # the preflight is fooled: the write itself must fail
        _setup_store(cli, tiny_f16)
        before_names = listed(cli)
        before_snap, before_hashes = store_snapshot(home), file_hashes(home)
        args, would_register = JOBS[job]
        args = [a.format(text=small_text) for a in args]

        disk.fill(leave=400_000)  # the outputs are 0.9-5.8 MB
        res = run_cli(args, env=dict(os.environ), preexec=disk.preexec)
        assert_one_line_error(res)
        err = res.stderr.lower()
        assert "write" in err and any(w in err for w in ("disk full", "no space left", "file too large", "file size limit")), res
        disk.unfill()

        assert listed(cli) == before_names  # this start also ran the cleanup
        assert would_register not in listed(cli)
        assert not list(home.rglob("*.partial"))
        after = file_hashes(home)
        for f, sha in before_hashes.items():
            assert after.get(f) == sha, f"{f} changed or vanished"
        new = set(after) - set(before_hashes)
        # A pull keeps its verified-so-far bytes for resume (in downloads/, never under a model's name).
        assert all(f.startswith("downloads/") for f in new), new
        if job != "pull":
            assert store_snapshot(home) == before_snap

        # With the space back, the same command succeeds.
        res = run_cli(args, env=dict(os.environ))
        assert res.exit_code == 0, res
        assert would_register in listed(cli)


@pytest.mark.parametrize("job", list(JOBS))
def test_disk_preflight_refuses_before_writing(job, tiny_f16, small_text, hub, cli, edgellm_home, monkeypatch):
    _setup_store(cli, tiny_f16)
    before_snap, before_hashes = store_snapshot(edgellm_home), file_hashes(edgellm_home)
    monkeypatch.setenv("EDGELLM_FAKE_FREE_BYTES", str(1 * MiB))
    args, would_register = JOBS[job]
    res = cli(*[a.format(text=small_text) for a in args])
    assert_one_line_error(res)
    assert "not enough disk" in res.stderr and "1.0 MB free" in res.stderr, res
    assert would_register not in listed(cli)
    assert store_snapshot(edgellm_home) == before_snap
    assert file_hashes(edgellm_home) == before_hashes
    if job == "pull":
        assert hub.bytes_sent["tiny-F16.gguf"] == 0


# -- names and paths -------------------------------------------------------------

HOSTILE_NAMES = ["../escape", "/etc/passwd", "a/../../b", "nul\x00byte", "x" * 300, ".hidden", "a\\b"]


@pytest.mark.parametrize("bad", HOSTILE_NAMES, ids=lambda s: repr(s[:12]))
def test_hostile_name_flags_are_refused(bad, tiny_f16, hub, cli, edgellm_home):
    assert cli("import", tiny_f16, "--name", "tiny-f16").exit_code == 0
    before = store_snapshot(edgellm_home)
    for args in (
        ["import", tiny_f16, "--name", bad],
        ["convert", "tiny-f16", "--to", "f32", "--name", bad],
        ["pull", REPO, "--file", "tiny-F16.gguf", "--name", bad],
    ):
        res = cli(*args)
        assert_one_line_error(res)
        assert "invalid model name" in res.stderr, (args, res)
        assert store_snapshot(edgellm_home) == before
    assert hub.bytes_sent["tiny-F16.gguf"] == 0
    assert not list(edgellm_home.parent.rglob("escape*")) and not (edgellm_home.parent / "b").exists()


@pytest.mark.parametrize(
    "filename",
    ["../x.gguf", "/etc/x.gguf", "a/../../x.gguf", "nul\x00.gguf", "a\\..\\x.gguf", "d/" + "x" * 300 + ".gguf"],
    ids=lambda s: repr(s[:10]),
)
def test_hostile_hub_file_flag_is_refused(filename, hub, cli):
    res = cli("pull", REPO, "--file", filename)
    assert_one_line_error(res)
    assert "unsafe file name" in res.stderr, res
    assert hub.requests == []


def test_hostile_filename_in_a_hub_listing_is_refused(tiny_f16, cli, edgellm_home, monkeypatch):
    # The repo listing itself carries the path: `--level` must not follow it anywhere.
    hostile = "../../../escape/tiny-Q8_0.gguf"
    with HubServer({REPO: {hostile: tiny_f16}}) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        res = cli("pull", REPO, "--level", "q8_0")
        assert_one_line_error(res)
        assert "unsafe file name" in res.stderr, res
        assert not any(r.path.startswith("/cdn-lfs/") for r in server.requests)
    assert listed(cli) == []
    assert not list(edgellm_home.parent.rglob("escape"))


@pytest.mark.parametrize(
    "entry,expect",
    [
        ('name = "../evil"\nrepo = "a/b"\n[model.files]\nq8_0 = "x.gguf"', "invalid model name"),
        ('name = "' + "n" * 300 + '"\nrepo = "a/b"\n[model.files]\nq8_0 = "x.gguf"', "invalid model name"),
        ('name = "ok"\nrepo = "a/b"\n[model.files]\nq8_0 = "../../x.gguf"', "unsafe filename"),
        ('name = "ok"\nrepo = "a/b"\n[model.files]\nq8_0 = "/etc/x.gguf"', "unsafe filename"),
        ('name = "ok"\nrepo = "a/b"\n[model.files]\nq8_0 = "x\\u0000.gguf"', "unsafe filename"),
        (
            'name = "ok"\nrepo = "a/b"\n[model.files]\nq8_0 = ["ok-00001-of-00002.gguf", "../ok-00002-of-00002.gguf"]',
            "unsafe filename",
        ),
        ('name = "ok"\nrepo = "a/b"\n[model.files]\nq8_0 = "' + "x" * 300 + '.gguf"', "unsafe filename"),
    ],
    ids=["dotdot-name", "long-name", "dotdot-file", "abs-file", "nul-file", "split-shard", "long-file"],
)
def test_hostile_catalog_entries_are_refused(entry, expect, cli, tmp_path, monkeypatch):
    cat = tmp_path / "models.toml"
    cat.write_text("[[model]]\n" + entry + "\n", encoding="utf-8")
    monkeypatch.setenv("EDGELLM_CATALOG", str(cat))
    for args in (["models", "list"], ["pull", "ok"]):
        res = cli(*args)
        assert_one_line_error(res)
        assert expect in res.stderr and "catalog" in res.stderr, res


# What a tampered manifest is refused with, by the field tampered: a name fails as a name, a file path as a path.
MANIFEST_REFUSAL = {"name": "invalid model name", "path": "unsafe"}


@pytest.mark.parametrize(
    "field,value",
    [
        ("name", "../escape"),
        ("name", "nul\x00byte"),
        ("path", "/etc/passwd"),
        ("path", "../../outside.gguf"),
        ("path", "m/" + "y" * 300 + ".gguf"),
    ],
)
def test_hostile_bundle_manifests_are_refused(field, value, tiny_f16, cli, tmp_path, monkeypatch):
    assert cli("import", tiny_f16, "--name", "tiny-f16").exit_code == 0
    bundle = tmp_path / "bundle"
    assert cli("export", "tiny-f16", "--to", bundle).exit_code == 0
    tamper_manifest(bundle, field, value)
    fresh = tmp_path / "fresh-home"
    monkeypatch.setenv("EDGELLM_HOME", str(fresh))
    res = cli("import", bundle)
    assert_one_line_error(res)
    assert MANIFEST_REFUSAL[field] in res.stderr, res
    assert listed(cli) == [] and not list(fresh.rglob("*.gguf"))


# -- RAM guard -------------------------------------------------------------------


def test_ram_guard_refuses_with_the_numbers_unless_forced(default_model, cli, monkeypatch):
    monkeypatch.setenv("EDGELLM_FAKE_AVAILABLE_RAM", "1000000")
    args = ["chat", DEFAULT_NAME, "-p", "hi", "--max-tokens", "4", "--temperature", "0", "--no-history", "--ctx", "512"]
    res = cli(*args)
    assert_one_line_error(res)
    err = res.stderr.strip().splitlines()[-1]
    from edgellm.fsutil import human_size
    from edgellm.gguf.reader import read_gguf

    weights = read_gguf(default_model.path).tensor_bytes
    kv = 2 * 30 * 512 * 3 * 64 * 2  # K and V, 30 layers, 3 KV heads of 64, ctx 512, f16
    assert "needs ~" in err and "at ctx 512" in err and f"weights {human_size(weights)}" in err, err
    assert f"KV cache {human_size(kv)}" in err and "KV cache 11.8 MB" in err and "1.0 MB available" in err, err
    assert "--force" in err
    res = cli(*args, "--force")
    assert res.exit_code == 0, res
    assert res.stdout.strip()


# -- the fuzz harness can see what it counts -------------------------------------


def test_fuzz_harness_reports_signals_hangs_and_tracebacks(monkeypatch):
    """scripts/fuzz_gguf.py's zero failures mean something: a worker that dies by a signal,
    a run that hangs, and a traceback are each reported, and the jobs after them still run."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("fuzz_gguf_h", ROOT / "scripts" / "fuzz_gguf.py")
    fuzz = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "fuzz_gguf_h", fuzz)  # its dataclasses look themselves up there
    spec.loader.exec_module(fuzz)
    worker = r"""
import json, os, signal, sys, time
for job in json.loads(sys.stdin.readline()):
    print('BEGIN ' + json.dumps(job['key']), flush=True)
    what = job['args'][0]
    if what == 'abort':
        os.kill(os.getpid(), signal.SIGABRT)
    if what == 'hang':
        time.sleep(60)
    err = 'Traceback (most recent call last):\n  boom\n' if what == 'trace' else 'error: bad file\n'
    print('END ' + json.dumps({'key': job['key'], 'code': 1, 'stdout': '', 'stderr': err, 'exc': None}), flush=True)
"""
    monkeypatch.setattr(fuzz, "WORKER", worker)
    # 6 s per run: generous for a loaded shared machine, yet far below the 60 s "hang"
    jobs = [{"key": [i, c], "args": [c]} for i, c in enumerate(["ok", "abort", "ok", "hang", "trace", "ok"])]
    res = {r["key"][1] + str(r["key"][0]): r["problem"] for r in fuzz.run_jobs(jobs, dict(os.environ), timeout=6)}
    assert res == {
        "ok0": None,
        "abort1": "killed the process (signal 6)",
        "ok2": None,
        "hang3": "hung (no result within 6 s)",
        "trace4": "traceback",
        "ok5": None,
    }

    # a worker that ends before it begins any job drops none unreported: each is charged after 3 starts
    monkeypatch.setattr(fuzz, "WORKER", "import sys; sys.exit(3)")
    res = {r["key"][1] + str(r["key"][0]): r["problem"] for r in fuzz.run_jobs(jobs[:2], dict(os.environ), timeout=6)}
    assert res == {k: "the worker ended before the job began (exit 3)" for k in ("ok0", "abort1")}
