"""The model index: atomic writes, two writers at once, names, cleanup."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
from pathlib import Path

import pytest

from edgellm.errors import ModelExists, ModelNotFound, StoreError, UsageError
from edgellm.fsutil import atomic_path, remove_stale_partials
from edgellm.models.store import ModelRecord, Store, validate_name


def _record(tmp: Path, name: str) -> ModelRecord:
    f = tmp / f"{name}.bin"
    f.write_bytes(name.encode())
    return ModelRecord(name=name, files=[str(f)], size_bytes=f.stat().st_size, sha256="0" * 64)


def _writer(home: str, tmp: str, prefix: str, n: int) -> None:
    os.environ["EDGELLM_HOME"] = home
    store = Store(Path(home))
    for i in range(n):
        store.register(_record(Path(tmp), f"{prefix}-{i}"))


def test_register_get_list_remove(edgellm_home, tmp_path):
    store = Store()
    rec = store.register(_record(tmp_path, "alpha"))
    assert store.get("alpha").files == rec.files
    assert [m.name for m in store.list()] == ["alpha"]
    with pytest.raises(ModelExists):
        store.register(_record(tmp_path, "alpha"))
    store.remove("alpha")
    assert store.list() == []
    # files outside the store's folder are never deleted by rm
    assert Path(rec.files[0]).exists()
    with pytest.raises(ModelNotFound):
        store.get("alpha")


def test_two_processes_writing_at_once_lose_nothing(edgellm_home, tmp_path):
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=_writer, args=(str(edgellm_home), str(tmp_path), p, 25)) for p in ("a", "b")]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
        assert p.exitcode == 0
    names = {m.name for m in Store().list()}
    assert names == {f"{p}-{i}" for p in ("a", "b") for i in range(25)}
    json.loads((edgellm_home / "index.json").read_text())  # never half-written
    assert not list(edgellm_home.glob("*.partial"))


@pytest.mark.parametrize("bad", ["../evil", "/abs", "a/b", "", "x" * 200, "nul\x00byte", ".hidden", "a..b"])
def test_names_that_could_escape_are_rejected(bad):
    with pytest.raises(UsageError):
        validate_name(bad)


def test_corrupt_index_is_a_clear_error(edgellm_home):
    edgellm_home.mkdir(parents=True)
    (edgellm_home / "index.json").write_text("{not json")
    with pytest.raises(StoreError, match="corrupt"):
        Store().list()


def test_atomic_path_keeps_old_file_on_failure(tmp_path):
    target = tmp_path / "out.txt"
    target.write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_path(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("killed")
    assert target.read_text() == "old"
    assert list(tmp_path.iterdir()) == [target]


def test_stale_partials_of_dead_processes_are_removed_live_ones_kept(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    stale = tmp_path / "models" / "m" / f"m.gguf.{dead_pid}.partial"
    live = tmp_path / "models" / "m" / f"n.gguf.{os.getpid()}.partial"
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"x")
    live.write_bytes(b"y")
    removed = remove_stale_partials(tmp_path)
    assert removed == [stale]
    assert live.exists() and not stale.exists()


def test_cli_start_removes_leftovers_of_killed_jobs(edgellm_home, cli):
    folder = edgellm_home / "models" / "x"
    folder.mkdir(parents=True)
    leftover = folder / "x.gguf.999999999.partial"  # no such pid
    leftover.write_bytes(b"partial")
    res = cli("models", "list", "--json", "--local")
    assert res.exit_code == 0
    assert not leftover.exists()
