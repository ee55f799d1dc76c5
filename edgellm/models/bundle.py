"""Export/import bundles: carrying models across an air gap.

A bundle is a folder: one sub-folder per model holding its GGUF file(s), and
`manifest.json` describing every model (name, files with sha256 and size,
level, source, parent, catalog data). Export builds the bundle in a hidden
sibling folder and renames it into place at the end, so a bundle that exists
is complete. Import treats the folder as untrusted input: the manifest is
validated (names, paths, hashes), every file is copied into the store while
being hashed, and only when every hash and size matched and every GGUF
validated are the files moved into place and all models registered in one
index transaction: all or nothing.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

from edgellm import __version__
from edgellm.errors import EdgeLLMError, GGUFError, IntegrityError, ModelExists, UsageError, one_line
from edgellm.fsutil import atomic_write_text, check_free_disk, copy_with_sha256, partial_path
from edgellm.gguf.reader import validate_for_import
from edgellm.models.catalog import load_catalog
from edgellm.models.store import ModelRecord, Store, validate_name
from edgellm.progress import CancelToken, ProgressCallback, no_progress

log = logging.getLogger(__name__)

FORMAT = "edgellm-bundle"
VERSION = 1
MANIFEST = "manifest.json"
_MAX_MANIFEST = 16 << 20
_MAX_PATH = 1024
_MAX_COMPONENT = 255
_SHA_RE = re.compile(r"^[0-9a-f]{64}$")
_RECORD_KEYS = ("architecture", "parameters", "context_length", "level", "source", "parent", "catalog", "extra")


# -- export ---------------------------------------------------------------------------


def export_bundle(
    names: list[str],
    dest: Path | str,
    *,
    store: Optional[Store] = None,
    on_progress: ProgressCallback = no_progress,
    cancel: Optional[CancelToken] = None,
) -> Path:
    """Write the models `names` and a manifest to the new folder `dest`; returns it.

    Raises ModelNotFound (unknown name), ModelExists (dest exists and is not
    empty), InsufficientResources (disk), IntegrityError (a store file no
    longer matches its recorded sha256), Cancelled.
    """
    store = store or Store()
    dest = Path(dest).expanduser().absolute()
    if not names:
        raise UsageError("name at least one model to export")
    records = [store.get(n) for n in dict.fromkeys(names)]  # ModelNotFound for unknown names
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise ModelExists(f"{dest} already exists and is not an empty folder; export into a new folder")
    total = sum(p.stat().st_size for r in records for p in r.paths)
    dest.parent.mkdir(parents=True, exist_ok=True)
    check_free_disk(dest.parent, total, what=f"exporting {len(records)} model(s)")
    tmp = dest.with_name(f".{dest.name}.export-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        entries = [_export_one(rec, tmp, on_progress=on_progress, cancel=cancel) for rec in records]
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "edgellm_version": _version(),
            "models": entries,
        }
        atomic_write_text(tmp / MANIFEST, json.dumps(manifest, indent=1) + "\n")
        if dest.exists():
            dest.rmdir()  # empty, checked above
        os.rename(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    log.info("exported %s to %s", ", ".join(r.name for r in records), dest)
    return dest


def _export_one(rec: ModelRecord, root: Path, *, on_progress, cancel) -> dict[str, Any]:
    folder = root / rec.name
    folder.mkdir()
    want = _file_shas(rec)
    files: list[dict[str, Any]] = []
    for rel, src in zip(rec.files, rec.paths, strict=False):
        target = folder / src.name
        size = src.stat().st_size
        with open(src, "rb") as fi, open(target, "wb") as fo:
            n, sha = copy_with_sha256(fi, fo, total=size, on_progress=on_progress, cancel=cancel, task=f"export {src.name}")
        expected = want.get(rel)
        if expected and sha != expected:
            raise IntegrityError(
                f"model '{rec.name}': {src} has sha256 {sha[:12]}..., the store recorded {expected[:12]}...; not exported (run `edgellm rm` and pull it again)"
            )
        files.append({"path": f"{rec.name}/{src.name}", "size": n, "sha256": sha})
    entry = {"name": rec.name, "files": files, "sha256": files[0]["sha256"], "size_bytes": sum(f["size"] for f in files)}
    entry.update({k: getattr(rec, k) for k in _RECORD_KEYS})
    entry["catalog_entry"] = _catalog_data(rec.catalog)
    return entry


def _file_shas(rec: ModelRecord) -> dict[str, str]:
    shas = dict(rec.file_sha256 or {})
    if rec.files and rec.files[0] not in shas:
        shas[rec.files[0]] = rec.sha256
    return shas


def _catalog_data(name: Optional[str]) -> Optional[dict[str, Any]]:
    if not name:
        return None
    try:
        e = load_catalog().find(name)
    except EdgeLLMError:
        return None
    if e is None:
        return None
    return {
        "name": e.name,
        "display": e.display,
        "repo": e.repo,
        "license": e.license,
        "architecture": e.architecture,
        "parameters": e.parameters,
        "context_length": e.context_length,
        "default_level": e.default_level,
        "files": e.files,
    }


def _version() -> str:
    return __version__


# -- import ---------------------------------------------------------------------------


def read_manifest(folder: Path | str) -> dict[str, Any]:
    """Load and validate `manifest.json` of a bundle (no file is read but the manifest)."""
    folder = Path(folder).expanduser()
    mpath = folder / MANIFEST
    if not folder.is_dir():
        raise UsageError(f"{folder} is not a folder")
    try:
        if mpath.stat().st_size > _MAX_MANIFEST:
            raise IntegrityError(f"{mpath} is implausibly large; not a bundle manifest")
        data = json.loads(mpath.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(f"{folder} has no {MANIFEST}; is it a bundle written by `edgellm export`?") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise IntegrityError(f"{mpath} is not valid JSON ({one_line(e, 80)})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise IntegrityError(f"{mpath} is not an edgellm bundle manifest")
    if data.get("version") != VERSION:
        raise IntegrityError(f"{mpath} has bundle version {data.get('version')!r}; this edgellm reads version {VERSION}")
    models = data.get("models")
    if not isinstance(models, list) or not models:
        raise IntegrityError(f"{mpath} lists no models")
    seen_names: set[str] = set()
    seen_paths: set[str] = set()
    root = folder.resolve()
    for m in models:
        if not isinstance(m, dict):
            raise IntegrityError(f"{mpath}: a model entry is not an object")
        try:
            name = validate_name(m.get("name"))
        except UsageError as e:
            raise IntegrityError(f"{mpath}: {e}") from None
        if name in seen_names:
            raise IntegrityError(f"{mpath}: model '{name}' is listed twice")
        seen_names.add(name)
        files = m.get("files")
        if not isinstance(files, list) or not files:
            raise IntegrityError(f"{mpath}: model '{name}' lists no files")
        basenames = set()
        for f in files:
            if not isinstance(f, dict):
                raise IntegrityError(f"{mpath}: model '{name}' has a malformed file entry")
            rel = _safe_rel_path(f.get("path"), mpath)
            if not _inside(root / rel, root):
                raise IntegrityError(f"{mpath}: {rel!r} points outside the bundle")
            if rel in seen_paths or Path(rel).name in basenames:
                raise IntegrityError(f"{mpath}: file {rel!r} is listed twice")
            seen_paths.add(rel)
            basenames.add(Path(rel).name)
            if not isinstance(f.get("size"), int) or isinstance(f.get("size"), bool) or f["size"] < 0:
                raise IntegrityError(f"{mpath}: {rel!r} has no valid size")
            if not isinstance(f.get("sha256"), str) or not _SHA_RE.match(f["sha256"]):
                raise IntegrityError(f"{mpath}: {rel!r} has no valid sha256")
        parent = m.get("parent")
        if parent is not None and not isinstance(parent, str):
            raise IntegrityError(f"{mpath}: model '{name}' has a malformed parent")
    return data


def _safe_rel_path(rel: Any, mpath: Path) -> str:
    bad = (
        not isinstance(rel, str)
        or not rel
        or "\x00" in rel
        or "\\" in rel
        or len(rel) > _MAX_PATH
        or rel.startswith("/")
        or re.match(r"^[A-Za-z]:", rel) is not None
    )
    parts = rel.split("/") if isinstance(rel, str) else []
    if bad or any(p in ("", ".", "..") or len(p) > _MAX_COMPONENT for p in parts) or not rel.lower().endswith(".gguf"):
        shown = repr(rel)[:80] if isinstance(rel, str) else type(rel).__name__
        raise IntegrityError(f"{mpath}: unsafe or invalid file path {shown}; refusing the bundle")
    return rel


def _inside(p: Path, root: Path) -> bool:
    try:
        p.resolve().relative_to(root)
        return True
    except ValueError:
        return False


def _order(models: list[dict]) -> list[dict]:
    """Parents before children (parents outside the bundle are just names)."""
    by_name = {m["name"]: m for m in models}
    out: list[dict] = []
    placed: set[str] = set()

    def place(m: dict, depth: int = 0) -> None:
        if m["name"] in placed or depth > len(models):
            return
        parent = m.get("parent")
        if parent in by_name:
            place(by_name[parent], depth + 1)
        placed.add(m["name"])
        out.append(m)

    for m in models:
        place(m)
    return out


# long: every file of the bundle is verified before any is registered, and all of it is undone on failure: one transaction
def import_bundle(
    folder: Path | str,
    *,
    store: Optional[Store] = None,
    on_progress: ProgressCallback = no_progress,
    cancel: Optional[CancelToken] = None,
) -> list[ModelRecord]:
    """Verify a bundle and register all its models, or none.

    Raises UsageError (no manifest), IntegrityError (unsafe manifest, a file
    missing or with the wrong size/sha256), GGUFError (a file that is not a
    valid GGUF), ModelExists (a name already in the store), InsufficientResources,
    Cancelled. On any failure nothing is registered and no file is left behind.
    """
    store = store or Store()
    folder = Path(folder).expanduser()
    manifest = read_manifest(folder)
    models = _order(manifest["models"])
    for m in models:
        if store.find(m["name"]):
            raise ModelExists(f"a model named '{m['name']}' is already in the store; remove it first (nothing was imported)")
    # Sizes first: cheap, and a wrong size needs no hashing to be refused.
    for m in models:
        for f in m["files"]:
            p = folder / f["path"]
            if not p.is_file():
                raise IntegrityError(f"bundle file {f['path']} is missing; nothing was imported")
            if p.stat().st_size != f["size"]:
                raise IntegrityError(
                    f"bundle file {f['path']} has {p.stat().st_size} bytes, the manifest says {f['size']}; nothing was imported"
                )
    total = sum(f["size"] for m in models for f in m["files"])
    check_free_disk(store.models_dir, total, what=f"importing {len(models)} model(s)")

    staged: list[tuple[Path, Path]] = []  # (temp, final)
    moved: list[Path] = []
    try:
        records = []
        for m in models:
            dest = store.model_folder(m["name"])
            dest.mkdir(parents=True, exist_ok=True)
            finals, shas = [], {}
            for f in m["files"]:
                src = folder / f["path"]
                final = dest / Path(f["path"]).name
                tmp = partial_path(final)
                staged.append((tmp, final))
                with open(src, "rb") as fi, open(tmp, "wb") as fo:
                    n, sha = copy_with_sha256(
                        fi, fo, total=f["size"], on_progress=on_progress, cancel=cancel, task=f"import {final.name}"
                    )
                if n != f["size"] or sha != f["sha256"]:
                    raise IntegrityError(
                        f"bundle file {f['path']} has sha256 {sha[:12]}... ({n} bytes), the manifest says "
                        f"{f['sha256'][:12]}... ({f['size']} bytes); the bundle was refused and nothing was imported"
                    )
                finals.append(final)
                shas[store.relative(final)] = sha
            info = _validate_staged(staged[-len(finals) :], m["files"])
            rels = [store.relative(p) for p in finals]
            rec = ModelRecord(
                name=m["name"],
                files=rels,
                size_bytes=sum(f["size"] for f in m["files"]),
                sha256=shas[rels[0]],
                architecture=info.architecture,
                parameters=info.parameters,
                context_length=info.context_length,
                level=str(m.get("level") or info.level),
                source=str(m.get("source") or f"import:{folder.resolve()}"),
                parent=m.get("parent"),
                catalog=m.get("catalog") if isinstance(m.get("catalog"), str) else None,
                file_sha256=shas,
                extra=dict(m.get("extra") or {}) if isinstance(m.get("extra"), dict) else {},
            )
            rec.extra["bundle"] = str(folder.resolve())
            records.append(rec)
        if cancel is not None:
            cancel.check()
        for tmp, final in staged:
            os.replace(tmp, final)
            moved.append(final)
        _register_all(store, records)
    except BaseException:
        for tmp, _final in staged:
            tmp.unlink(missing_ok=True)
        for p in moved:
            p.unlink(missing_ok=True)
        for m in models:
            d = store.models_dir / m["name"]
            if d.is_dir() and not any(d.iterdir()):
                d.rmdir()
        raise
    log.info("imported %s from %s", ", ".join(r.name for r in records), folder)
    return records


def _validate_staged(staged: list[tuple[Path, Path]], files: list[dict]) -> Any:
    """validate_for_import on the hashed copies, its errors naming the bundle's files."""
    try:
        return validate_for_import([tmp for tmp, _final in staged])
    except GGUFError as e:
        msg = str(e)
        for (tmp, _final), f in zip(staged, files, strict=False):
            msg = msg.replace(tmp.name, f"bundle file {f['path']}")
        raise GGUFError(f"{msg}; nothing was imported") from None


def _register_all(store: Store, records: list[ModelRecord]) -> None:
    """One index transaction: either every model is registered or none is."""
    with store.transaction() as data:
        for rec in records:
            if rec.name in data["models"]:
                raise ModelExists(f"a model named '{rec.name}' is already in the store; nothing was imported")
        for rec in records:
            data["models"][rec.name] = asdict(rec)


__all__ = ["export_bundle", "import_bundle", "read_manifest", "FORMAT", "VERSION", "MANIFEST"]
