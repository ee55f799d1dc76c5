"""The fake Hub in tests/support/hubserver.py, exercised by the real, unpatched huggingface_hub client.

These tests also pin down what huggingface_hub 2.4 itself does on faults, because edgellm's
downloader is built on those facts:

* HEAD /resolve answering 5xx: the first HEAD is never retried, but when nothing is cached
  hf_hub_download makes a second metadata pass with backoff (5 retries, sleeping 1, 2, 4, 8, 8 s).
* The body GET (CDN) is retried only on 408/429; any 5xx raises HfHubHTTPError at once.
* A connection closed mid-body (RemoteProtocolError), a connect error or a timeout is resumed
  *inside the same call* with ``Range: bytes=N-`` after a 1 s sleep, up to 5 times in a row
  (the count resets whenever data was written).  N only advances in whole 10 MiB steps
  (constants.DOWNLOAD_CHUNK_SIZE: iter_bytes buffers that much before writing), so files under
  10 MiB restart from 0.  A reset (RST -> httpx2.ReadError) is *not* retried: it propagates.
* Nothing is resumed *across* calls: each call downloads into ``blobs/<etag>.<uuid8>.incomplete``,
  deletes it on failure, and a killed process leaves an orphan that the next call ignores.
* The sha256 of the body is never checked against the advertised ETag.
"""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from huggingface_hub import HfApi, hf_hub_download
from huggingface_hub.errors import (
    EntryNotFoundError,
    GatedRepoError,
    HfHubHTTPError,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from support.hubserver import DEFAULT_SHA, HubServer

REPO = "edge/tiny"
MiB = 1024 * 1024
CHUNK = 10 * MiB  # huggingface_hub.constants.DOWNLOAD_CHUNK_SIZE: the resume granularity


@pytest.fixture(scope="module")
def small() -> bytes:
    return os.urandom(3 * MiB)


@pytest.fixture(scope="module")
def big() -> bytes:
    # Larger than one client chunk, so a cut after the first chunk can be resumed with Range.
    return os.urandom(CHUNK + 6 * MiB)


@pytest.fixture
def hub(small: bytes, big: bytes, tmp_path: Path):
    weights = tmp_path / "big.gguf"
    weights.write_bytes(big)  # a Path-backed file, streamed from disk
    files = {"small.gguf": small, "big.gguf": weights, "config.json": b'{"arch": "tiny"}'}
    with HubServer({REPO: files}, lfs_min_size=1024) as server:
        yield server


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def download(hub: HubServer, filename: str, cache: Path, **kw) -> Path:
    return Path(hf_hub_download(REPO, filename, endpoint=hub.url, cache_dir=cache, **kw))


def ranged_gets(hub: HubServer) -> list[str]:
    return [r.range for r in hub.requests if r.method == "GET" and r.range]


def test_model_info_lists_lfs_sha256(hub: HubServer, small: bytes):
    info = HfApi(endpoint=hub.url).model_info(REPO, files_metadata=True)
    assert info.id == REPO and info.sha == DEFAULT_SHA
    siblings = {s.rfilename: s for s in info.siblings}
    assert set(siblings) == {"small.gguf", "big.gguf", "config.json"}
    assert siblings["small.gguf"].size == len(small)
    assert siblings["small.gguf"].lfs.sha256 == sha256(small)
    assert siblings["config.json"].lfs is None  # below lfs_min_size: a plain git file
    assert ("GET", f"/api/models/{REPO}", None) in hub.requests

    bare = HfApi(endpoint=hub.url).model_info(REPO, revision=DEFAULT_SHA)
    assert bare.siblings[0].lfs is None and bare.siblings[0].size is None  # like the Hub without blobs=true


def test_tree_and_paths_info(hub: HubServer, big: bytes):
    api = HfApi(endpoint=hub.url)
    assert sorted(api.list_repo_files(REPO)) == ["big.gguf", "config.json", "small.gguf"]
    (info,) = api.get_paths_info(REPO, ["big.gguf"])
    assert info.lfs.sha256 == sha256(big) and info.size == len(big)


def test_download_is_byte_identical(hub: HubServer, small: bytes, tmp_path: Path):
    path = download(hub, "small.gguf", tmp_path / "hf")
    assert path.read_bytes() == small
    # Cache layout: the blob is named by the LFS sha256, the snapshot entry links to it.
    repo_dir = tmp_path / "hf" / "models--edge--tiny"
    assert (repo_dir / "blobs" / sha256(small)).is_file()
    assert path == repo_dir / "snapshots" / DEFAULT_SHA / "small.gguf"
    assert (repo_dir / "refs" / "main").read_text() == DEFAULT_SHA
    # The LFS body comes from the "CDN" after the HEAD redirect; config.json is served inline.
    assert [r.method for r in hub.requests] == ["HEAD", "GET"]
    assert hub.requests[1].path.startswith("/cdn-lfs/")
    assert download(hub, "config.json", tmp_path / "hf").read_bytes() == b'{"arch": "tiny"}'


def test_cut_connection_is_resumed_within_the_call(hub: HubServer, big: bytes, tmp_path: Path):
    hub.cut_after("big.gguf", CHUNK + 256 * 1024)
    path = download(hub, "big.gguf", tmp_path / "hf")
    assert path.read_bytes() == big
    assert ranged_gets(hub) == [f"bytes={CHUNK}-"]
    assert hub.bytes_sent["big.gguf"] <= 1.1 * len(big)


def test_cut_before_first_chunk_restarts_from_zero(hub: HubServer, small: bytes, tmp_path: Path):
    hub.cut_after("small.gguf", MiB)
    assert download(hub, "small.gguf", tmp_path / "hf").read_bytes() == small
    assert ranged_gets(hub) == []
    assert hub.bytes_sent["small.gguf"] == MiB + len(small)


def test_reset_connection_raises_and_next_call_starts_over(hub: HubServer, big: bytes, tmp_path: Path):
    import httpx2

    hub.cut_after("big.gguf", CHUNK + MiB, reset=True)
    with pytest.raises(httpx2.ReadError):
        download(hub, "big.gguf", tmp_path / "hf")
    blobs = tmp_path / "hf" / "models--edge--tiny" / "blobs"
    assert list(blobs.glob("*.incomplete")) == []  # the partial file was deleted, not kept for resume
    hub.reset_counters()
    assert download(hub, "big.gguf", tmp_path / "hf").read_bytes() == big
    assert ranged_gets(hub) == [] and hub.bytes_sent["big.gguf"] == len(big)


def test_500_on_head_is_retried(hub: HubServer, small: bytes, tmp_path: Path):
    hub.fail_times("small.gguf", 500, 1)
    assert download(hub, "small.gguf", tmp_path / "hf").read_bytes() == small
    assert [r.method for r in hub.requests] == ["HEAD", "HEAD", "GET"]


def test_500_on_body_is_not_retried(hub: HubServer, tmp_path: Path):
    hub.fail_times("/cdn-lfs/*", 500, 1)
    with pytest.raises(HfHubHTTPError) as err:
        download(hub, "small.gguf", tmp_path / "hf")
    assert err.value.response.status_code == 500


def test_missing_token_is_gated_wrong_token_is_401(hub: HubServer, small: bytes, tmp_path: Path):
    hub.require_token("hf_right")
    with pytest.raises(GatedRepoError):
        download(hub, "small.gguf", tmp_path / "hf", token=False)
    with pytest.raises(HfHubHTTPError) as err:
        download(hub, "small.gguf", tmp_path / "hf", token="hf_wrong")
    assert err.value.response.status_code == 401 and not isinstance(err.value, RepositoryNotFoundError)
    with pytest.raises(GatedRepoError):
        HfApi(endpoint=hub.url, token=False).model_info(REPO)
    assert download(hub, "small.gguf", tmp_path / "hf", token="hf_right").read_bytes() == small


def test_missing_repo_file_and_revision(hub: HubServer, tmp_path: Path):
    with pytest.raises(RepositoryNotFoundError):
        hf_hub_download("edge/nope", "x.gguf", endpoint=hub.url, cache_dir=tmp_path)
    with pytest.raises(RepositoryNotFoundError):
        HfApi(endpoint=hub.url).model_info("edge/nope")
    with pytest.raises(RemoteEntryNotFoundError) as err:
        download(hub, "nope.gguf", tmp_path)
    assert isinstance(err.value, EntryNotFoundError)
    with pytest.raises(RevisionNotFoundError):
        download(hub, "small.gguf", tmp_path, revision="v9")


def test_corrupt_byte_is_not_detected_by_huggingface_hub(hub: HubServer, small: bytes, tmp_path: Path):
    hub.corrupt_byte("small.gguf", 12345)
    path = download(hub, "small.gguf", tmp_path / "hf")
    assert path.name == "small.gguf" and path.stat().st_size == len(small)
    assert sha256(path.read_bytes()) != sha256(small)
    assert path.resolve().name == sha256(small)  # stored under the advertised (true) sha256


def test_hf_endpoint_env_and_killed_download(hub: HubServer, big: bytes, tmp_path: Path):
    """A subprocess reads HF_ENDPOINT/HF_HOME at import; a SIGKILLed download leaves an orphan."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HF_", "HUGGINGFACE_"))}
    env |= {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "home"), "HF_HUB_DISABLE_XET": "1"}
    code = textwrap.dedent(f"""
        from huggingface_hub import hf_hub_download
        print(hf_hub_download({REPO!r}, "big.gguf"))
    """)
    blobs = tmp_path / "home" / "hub" / "models--edge--tiny" / "blobs"
    hub.throttle(8 * MiB)
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 15
        while not any(p.stat().st_size for p in blobs.glob("*.incomplete")):
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    (orphan,) = blobs.glob("*.incomplete")
    assert orphan.name.startswith(sha256(big) + ".")  # <sha256>.<uuid8>.incomplete

    hub.throttle(None)
    hub.reset_counters()
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert Path(out.stdout.strip()).read_bytes() == big
    assert ranged_gets(hub) == []  # no cross-process resume ...
    assert orphan.exists()  # ... and the orphan is left behind


def test_cli_serves_files(tmp_path: Path, small: bytes):
    f = tmp_path / "w.gguf"
    f.write_bytes(small)
    cli = Path(__file__).parent / "support" / "hubserver.py"
    proc = subprocess.Popen([sys.executable, str(cli), "--port", "0", "--repo", "o/n", str(f)], stdout=subprocess.PIPE, text=True)
    try:
        url = proc.stdout.readline().strip()
        assert url.startswith("http://127.0.0.1:")
        path = hf_hub_download("o/n", "w.gguf", endpoint=url, cache_dir=tmp_path / "hf")
        assert Path(path).read_bytes() == small
    finally:
        proc.terminate()
        proc.wait(timeout=5)
