"""Fixtures for the tests that need the default model's F16 (test_convert, test_quantize, ...).

Loaded for the whole suite as a plugin (`pytest_plugins` in conftest.py), so
the F16 is produced once per session by the real `convert` (about 7 s) and
then registered into each test's own store by reference, like conftest's
`default_model`.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

import pytest

from support.helpers import DEFAULT_NAME, DEFAULT_REF, run_ok

F16_NAME = f"{DEFAULT_REF}-f16"
IMATRIX_CHUNKS = 2  # the session's matrices: short, and still every entry llama-imatrix writes
# A module that imports these fixtures by name gets its own copy of the session
# fixture: the memo keeps that to one conversion per session all the same.
_cache: dict[str, object] = {}


@pytest.fixture(scope="session")
def f16_session(default_gguf, tmp_path_factory):
    """(ConvertResult, session home) for the default model converted to F16."""
    if "f16" not in _cache:
        from edgellm.gguf.reader import read_gguf
        from edgellm.models.resolve import record_from_info
        from edgellm.models.store import Store
        from quant.convert import convert

        home = tmp_path_factory.mktemp("quant-session-home")
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("EDGELLM_HOME", str(home))
            store = Store()
            info = read_gguf(default_gguf)
            store.register(record_from_info(DEFAULT_NAME, info, [str(default_gguf)], "-", catalog=DEFAULT_REF))
            result = convert(DEFAULT_NAME, "f16", store=store)
        _cache["f16"] = (result, home)
    return _cache["f16"]


@pytest.fixture
def f16_model(f16_session, default_model):
    """The session's F16 registered in this test's store (with its real lineage), plus the Q4_1 parent."""
    from edgellm.models.store import ModelRecord, Store

    result, _home = f16_session
    rec = result.record
    assert rec is not None
    data = rec.to_json()
    data.pop("path", None)
    data["files"] = [str(result.path)]
    data["file_sha256"] = {str(result.path): rec.sha256}
    return Store().register(ModelRecord.from_json(data))


def wait_for_partial(folder: Path, proc: subprocess.Popen, *, min_bytes: int = 1, timeout: float = 60) -> Path:
    """Block until a `*.partial` file under `folder` holds data (the job is mid-write)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for p in folder.rglob("*.partial"):
            try:
                if p.stat().st_size >= min_bytes:
                    return p
            except FileNotFoundError:
                continue
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"the job ended (rc={proc.returncode}) before writing: {err[-500:]}")
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    raise AssertionError("no partial file appeared")


@pytest.fixture(scope="session")
def f16_path(f16_session) -> Path:
    return Path(f16_session[0].path)


@pytest.fixture(scope="session")
def session_imatrix(f16_path, tmp_path_factory) -> Path:
    """edgellm's matrix of the F16 on the shipped text, IMATRIX_CHUNKS x 512, computed once."""
    if "imatrix" not in _cache:
        from quant.imatrix import compute_imatrix

        home = tmp_path_factory.mktemp("imatrix-home")
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("EDGELLM_HOME", str(home))
            rec = compute_imatrix(f16_path, chunks=IMATRIX_CHUNKS, threads=2)
        _cache["imatrix"] = rec.path
    return _cache["imatrix"]  # type: ignore[return-value]


@pytest.fixture(scope="session")
def reference_imatrix(f16_path, llama_tools, tmp_path_factory) -> Path:
    """llama-imatrix of the same tree, same file, text, ctx and chunks."""
    from quant.imatrix import calibration_path

    out = tmp_path_factory.mktemp("llama-imatrix") / "ref.gguf"
    # session_imatrix's text, ctx, chunks and threads
    as_ours = ["-f", calibration_path(), "-c", "512", "--chunks", IMATRIX_CHUNKS, "-t", "2"]
    run_ok(llama_tools / "llama-imatrix", "-m", f16_path, *as_ours, "--no-ppl", "-o", out)
    return out
