"""Hub pulls through the real, unpatched huggingface_hub client against tests/support/hubserver.py.

What is proven here: a pull killed with SIGKILL resumes and sends <= 1.1x the file;
the sha256 is verified (a flipped byte is refused, nothing registered); 5xx and
dropped connections are retried; 401/404 become one-line errors; offline pulls make
no socket connection; the disk preflight stops before the first byte; the RAM
preflight refuses unless --force; levels resolve by GGUF naming; split sets pull whole.
"""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from support.gguf_files import write_stub_gguf
from support.helpers import DEFAULT_NAME, DEFAULT_SHA256, assert_one_line_error, store_snapshot
from support.hubserver import DEFAULT_SHA, HubServer

REPO = "edge/tiny-GGUF"
Q8 = "tiny-Q8_0.gguf"
Q6 = "tiny-Q6_K.gguf"
MiB = 1 << 20


def sha256(p: Path) -> str:
    return hashlib.sha256(Path(p).read_bytes()).hexdigest()


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    d = tmp_path_factory.mktemp("gguf")
    out = {
        Q8: write_stub_gguf(d / Q8, pad_mib=3),
        "tiny-Q4_K_M.gguf": write_stub_gguf(d / "tiny-Q4_K_M.gguf", ftype=15, seed=1),
        "tiny.Q5_K_M.gguf": write_stub_gguf(d / "tiny.Q5_K_M.gguf", ftype=17, seed=2),
        "tiny-v2.Q5_K_M.gguf": write_stub_gguf(d / "tiny-v2.Q5_K_M.gguf", ftype=17, seed=3),
        "tiny-Q6_K.gguf": write_stub_gguf(d / "tiny-Q6_K.gguf", ftype=18, seed=5, pad_mib=9),  # > the 4 MiB header read
        "README.md": b"# tiny\n",
    }
    split = d / "split"
    split.mkdir()
    write_stub_gguf(split / "tiny-F16.gguf", ftype=1, seed=4, split_max_tensors=2)
    for p in sorted(split.glob("*.gguf")):
        out[p.name] = p
    return out


@pytest.fixture
def hub(files, monkeypatch):
    with HubServer({REPO: files}, lfs_min_size=64) as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        monkeypatch.setenv("EDGELLM_HUB_BACKOFF", "0.01")
        yield server


def listed(cli) -> list[str]:
    res = cli("models", "list", "--local", "--json")
    assert res.exit_code == 0, res
    return [m["name"] for m in res.json()["models"]]


def body_gets(server: HubServer) -> list:
    return [r for r in server.requests if r.method == "GET" and r.path.startswith("/cdn-lfs/")]


# -- happy paths -------------------------------------------------------------------------


def test_pull_repo_by_level_registers_a_verified_model(hub, files, cli, edgellm_home):
    res = cli("pull", REPO, "--level", "Q8_0", "--json", "--no-progress")  # level is case-insensitive
    assert res.exit_code == 0, res
    rec = res.json()
    want = hub.file(REPO, Q8)
    assert rec["name"] == "tiny-q8_0" and rec["level"] == "q8_0"
    assert rec["sha256"] == want.sha256 == sha256(files[Q8])
    assert rec["source"] == f"hf:{REPO}@{DEFAULT_SHA}"
    assert Path(rec["path"]).is_file() and sha256(rec["path"]) == want.sha256
    pf = rec["preflight"]
    assert pf["total_bytes"] == want.size and pf["fits_disk"] and pf["fits_ram"]
    # KV cache from the GGUF header: 2 (K,V) x 2 layers x 512 ctx x 2 kv heads x 16 dims x 2 bytes
    assert pf["kv_source"] == "gguf header" and pf["n_ctx"] == 512 and pf["kv_bytes"] == 2 * 2 * 512 * 2 * 16 * 2
    assert hub.bytes_sent[Q8] == want.size  # the header read became the start of the download
    assert listed(cli) == ["tiny-q8_0"]
    assert not list((edgellm_home / "downloads").glob("*.download*"))
    # A second pull is served from the store: no byte moves.
    hub.reset_counters()
    assert cli("pull", REPO, "--level", "q8_0", "--json").json()["sha256"] == want.sha256
    assert hub.bytes_sent[Q8] == 0


def test_level_resolution_lists_ambiguity_and_what_exists(hub, cli, edgellm_home):
    res = cli("pull", REPO, "--level", "q5_k_m")
    assert_one_line_error(res)
    assert "tiny-v2.Q5_K_M.gguf" in res.stderr and "tiny.Q5_K_M.gguf" in res.stderr and "--file" in res.stderr
    res = cli("pull", REPO, "--level", "q2_k")
    assert_one_line_error(res)
    assert "no q2_k" in res.stderr and "q4_k_m" in res.stderr and "q8_0" in res.stderr and "f16" in res.stderr
    res = cli("pull", REPO, "--file", "tiny.Q5_K_M.gguf", "--name", "pick", "--json")
    assert res.exit_code == 0 and res.json()["name"] == "pick" and res.json()["level"] == "q5_k_m", res


def test_catalog_pull_fetches_a_split_set(hub, files, cli, tmp_path, monkeypatch):
    catalog = tmp_path / "models.toml"
    catalog.write_text(f"""
[[model]]
name = "tiny-test"
repo = "{REPO}"
parameters = 1000
context_length = 512
default_level = "q8_0"
[model.files]
q8_0 = "{Q8}"
f16 = ["tiny-F16-00001-of-00002.gguf", "tiny-F16-00002-of-00002.gguf"]
""")
    monkeypatch.setenv("EDGELLM_CATALOG", str(catalog))
    res = cli("pull", "tiny-test", "--level", "f16", "--json", "--no-progress")
    assert res.exit_code == 0, res
    rec = res.json()
    from edgellm.models.resolve import store_name

    assert rec["name"] == store_name("tiny-test", "f16") and rec["catalog"] == "tiny-test" and rec["level"] == "f16"
    assert [Path(f).name for f in rec["files"]] == ["tiny-F16-00001-of-00002.gguf", "tiny-F16-00002-of-00002.gguf"]
    for f, sha in rec["file_sha256"].items():
        assert sha == hub.file(REPO, Path(f).name).sha256
    assert rec["size_bytes"] == sum(files[Path(f).name].stat().st_size for f in rec["files"])
    # The repo form with --file on one shard also fetches the whole set.
    res = cli("pull", REPO, "--file", "tiny-F16-00002-of-00002.gguf", "--json")
    assert res.exit_code == 0 and len(res.json()["files"]) == 2, res


def test_cancelled_pull_resumes_in_process(hub, files, edgellm_home):
    from edgellm.models import hub as hubmod
    from edgellm.errors import Cancelled
    from edgellm.progress import CancelToken

    token = CancelToken()
    size = hub.file(REPO, Q6).size

    def stop_half_way(p):
        if p.task.startswith("download") and p.done >= size // 2:
            token.cancel()

    with pytest.raises(Cancelled):
        hubmod.pull(REPO, level="q6_k", on_progress=stop_half_way, cancel=token)
    part = edgellm_home / "downloads" / f"{hub.file(REPO, Q6).sha256}.download"
    assert size // 2 <= part.stat().st_size < size
    from edgellm.models.store import Store

    assert Store().list() == []  # a partial download is never listed
    rec = hubmod.pull(REPO, level="q6_k")
    assert rec.sha256 == sha256(rec.path) == hub.file(REPO, Q6).sha256
    assert hub.bytes_sent[Q6] == size  # not one byte fetched twice
    assert not part.exists()


# -- resume after kill -9, on the real default model ----------------------------------------


def test_kill_9_at_half_then_pull_again_resumes(default_gguf, cli, edgellm_home, monkeypatch):
    fname = "SmolLM2-135M-Instruct-Q4_1.gguf"
    repo = "edge/SmolLM2-135M-Instruct-GGUF"
    with HubServer({repo: {fname: default_gguf}}) as server:
        meta = server.file(repo, fname)
        part = edgellm_home / "downloads" / f"{meta.sha256}.download"
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        env = dict(os.environ)
        server.throttle(24 * MiB)
        proc = subprocess.Popen(
            [sys.executable, "-m", "edgellm.cli", "pull", repo, "--file", fname, "--json", "--no-progress"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        try:
            deadline = time.monotonic() + 60
            while not (part.exists() and part.stat().st_size >= meta.size // 2):
                assert proc.poll() is None, proc.communicate()
                assert time.monotonic() < deadline, "the download never reached 50%"
                time.sleep(0.02)
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait()
        kept = part.stat().st_size
        assert 0.45 * meta.size <= kept < 0.75 * meta.size
        assert listed(cli) == []  # never listed; and the next start's cleanup keeps it for resume
        server.throttle(None)
        first_run = server.bytes_sent[fname]

        res = cli("pull", repo, "--file", fname, "--json", "--no-progress")
        assert res.exit_code == 0, res
        rec = res.json()
        assert rec["sha256"] == meta.sha256 == sha256(rec["path"]) == DEFAULT_SHA256
        assert rec["name"] == DEFAULT_NAME and rec["level"] == "q4_1"
        second_gets = body_gets(server)[-1]
        assert second_gets.range.endswith(f"-{meta.size - 1}")
        total = server.bytes_sent[fname]
        print(
            f"kill -9 at {kept / meta.size:.1%}: first run sent {first_run}, total {total} = {total / meta.size:.3f}x of {meta.size}"
        )
        assert total <= 1.1 * meta.size
        assert not part.exists()


# -- verification, retries, errors ---------------------------------------------------------


def test_corrupted_byte_is_refused_and_nothing_registered(hub, cli, edgellm_home):
    hub.corrupt_byte(Q8, 2 * MiB + 7)
    before = store_snapshot(edgellm_home)
    res = cli("pull", REPO, "--level", "q8_0")
    assert_one_line_error(res)
    assert "sha256" in res.stderr and "deleted" in res.stderr
    assert listed(cli) == []
    assert store_snapshot(edgellm_home)[0] == before[0]  # the index is untouched
    assert not [p for p in edgellm_home.rglob("*") if p.is_file() and p.suffix in (".gguf", ".download")]


@pytest.mark.parametrize("fault", ["500", "reset", "fin"])
def test_transient_failures_are_retried(hub, cli, fault):
    if fault == "500":
        hub.fail_times("/cdn-lfs/*", 500, 1)
    else:  # the connection drops half-way through the first 1 MiB segment
        hub.cut_after(Q8, MiB // 2, reset=(fault == "reset"))
    res = cli("pull", REPO, "--level", "q8_0", "--json")
    assert res.exit_code == 0, res
    assert res.json()["sha256"] == hub.file(REPO, Q8).sha256
    ranges = [r.range for r in body_gets(hub)]
    assert ranges.count(f"bytes=0-{MiB - 1}") == 2, ranges  # the failed segment, and its retry
    size = hub.file(REPO, Q8).size
    assert len(ranges) == -(-size // MiB) + 1
    assert hub.bytes_sent[Q8] == size + (0 if fault == "500" else MiB // 2)


def test_persistent_5xx_gives_up_with_one_line(hub, cli, monkeypatch):
    monkeypatch.setenv("EDGELLM_HUB_RETRIES", "3")
    hub.fail_times("/cdn-lfs/*", 503, 100)
    res = cli("pull", REPO, "--level", "q8_0")
    assert_one_line_error(res)
    assert "503" in res.stderr and "3 attempts" in res.stderr
    assert len(body_gets(hub)) == 3
    assert listed(cli) == []


def test_auth_and_not_found_errors_are_one_line(hub, cli, monkeypatch):
    hub.require_token("hf_right")
    res = cli("pull", REPO, "--level", "q8_0")
    assert_one_line_error(res)
    assert "gated or private" in res.stderr and "HF_TOKEN" in res.stderr
    monkeypatch.setenv("HF_TOKEN", "hf_wrong")
    res = cli("pull", REPO, "--level", "q8_0")
    assert_one_line_error(res)
    assert "401" in res.stderr and "token" in res.stderr
    monkeypatch.setenv("HF_TOKEN", "hf_right")  # the standard token mechanism is honoured
    assert cli("pull", REPO, "--level", "q8_0", "--json").exit_code == 0
    hub.require_token(None)

    res = cli("pull", "edge/nope", "--level", "q8_0")
    assert_one_line_error(res)
    assert "no Hub repo named 'edge/nope'" in res.stderr and "404" in res.stderr
    res = cli("pull", REPO, "--file", "nope-Q8_0.gguf")
    assert_one_line_error(res)
    assert "nope-Q8_0.gguf" in res.stderr and "404" in res.stderr
    res = cli("pull", REPO, "--level", "q8_0", "--revision", "v9", "--name", "other")
    assert_one_line_error(res)
    assert "revision 'v9'" in res.stderr
    res = cli("pull", REPO)
    assert_one_line_error(res)
    assert "--level" in res.stderr


# -- offline -------------------------------------------------------------------------------


@pytest.fixture
def no_sockets(monkeypatch):
    """Record (and refuse) every socket connection attempt in this process."""
    attempts = []

    def refuse(self, address, *a, **kw):
        attempts.append(address)
        raise OSError("network use in an offline test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket.socket, "connect_ex", refuse)
    return attempts


def test_offline_miss_is_one_line_and_makes_no_connection(hub, cli, no_sockets, monkeypatch, tmp_path):
    res = cli("pull", REPO, "--level", "q8_0", "--offline")
    assert_one_line_error(res)
    assert "offline" in res.stderr and REPO in res.stderr and "q8_0" in res.stderr
    catalog = tmp_path / "models.toml"
    catalog.write_text(f'[[model]]\nname = "tiny-test"\nrepo = "{REPO}"\n[model.files]\nq8_0 = "{Q8}"\n')
    monkeypatch.setenv("EDGELLM_CATALOG", str(catalog))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    res = cli("pull", "tiny-test")
    assert_one_line_error(res)
    assert "tiny-test:q8_0" in res.stderr and "not in the store" in res.stderr
    assert no_sockets == [] and hub.requests == []


def test_offline_serves_from_the_hf_cache(hub, cli, monkeypatch):
    from huggingface_hub import hf_hub_download

    from edgellm.models.hub import hf_cache_dir

    hf_hub_download(REPO, Q8, endpoint=hub.url, cache_dir=hf_cache_dir())
    hub.reset_counters()
    attempts = []
    monkeypatch.setattr(
        socket.socket, "connect", lambda self, addr, *a: attempts.append(addr) or (_ for _ in ()).throw(OSError("offline"))
    )
    monkeypatch.setenv("EDGELLM_OFFLINE", "1")
    res = cli("pull", REPO, "--level", "q8_0", "--json")
    assert res.exit_code == 0, res
    rec = res.json()
    assert rec["sha256"] == hub.file(REPO, Q8).sha256 == sha256(rec["path"])
    assert rec["source"] == f"hf:{REPO}@{DEFAULT_SHA}"
    assert attempts == [] and hub.requests == []


def test_offline_cli_subprocess_audit_hook(hub, tmp_path):
    """The same promise in a fresh process, where an audit hook sees every socket.connect."""
    code = (
        "import sys\n"
        "def hook(ev, args):\n"
        "    if ev == 'socket.connect': print('CONNECT', args[1], file=sys.stderr); raise SystemExit(99)\n"
        "sys.addaudithook(hook)\n"
        "from edgellm.cli import main\n"
        "sys.exit(main(['pull', 'edge/tiny-GGUF', '--file', 'tiny-Q8_0.gguf']))\n"
    )
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode not in (0, 99), proc.stderr
    assert "CONNECT" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: offline: ")
    assert hub.requests == []


# -- preflight -----------------------------------------------------------------------------


def test_disk_preflight_stops_before_the_first_byte(hub, cli, monkeypatch, edgellm_home):
    monkeypatch.setenv("EDGELLM_FAKE_FREE_BYTES", str(100 * MiB))
    res = cli("pull", REPO, "--level", "q8_0", "--force")  # --force does not override the disk check
    assert_one_line_error(res)
    assert "not enough disk" in res.stderr and "need 271.7 MB" in res.stderr and "104.9 MB free" in res.stderr
    assert body_gets(hub) == [] and hub.bytes_sent[Q8] == 0
    assert listed(cli) == []


def test_ram_preflight_refuses_unless_forced(hub, cli, monkeypatch):
    monkeypatch.setenv("EDGELLM_FAKE_AVAILABLE_RAM", str(50 * MiB))
    res = cli("pull", REPO, "--level", "q8_0")
    assert_one_line_error(res)
    assert "may not fit in RAM" in res.stderr and "--force" in res.stderr and "52.4 MB available" in res.stderr
    assert listed(cli) == []
    res = cli("pull", REPO, "--level", "q8_0", "--force", "--json")
    assert res.exit_code == 0, res
    assert res.json()["preflight"]["fits_ram"] is False
    assert hub.bytes_sent[Q8] == hub.file(REPO, Q8).size  # the header read by the refused pull was kept and reused
