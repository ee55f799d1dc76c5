"""Pulling GGUF models from the Hugging Face Hub: what to pull, whether it
fits, and where it lands.

* Resolve: catalog `NAME[:LEVEL]` through models.toml, or `owner/repo` with a
  level (matched against the repo listing by GGUF naming, case-insensitively)
  or a file; a split GGUF is pulled as its whole set.
* Preflight, before the first byte: free disk for what is left to fetch; then
  the RAM the model needs at the default context (weights + KV cache from the
  GGUF header + compute overhead). The header comes from a range request that
  is the start of the download itself, so nothing is fetched twice. `force`
  overrides only the RAM check.
* Transfer, resume and sha256 verification: `edgellm.models.transfer`.
* Register the verified files in the store, source `hf:owner/repo@commit`.
* Offline (`offline=True`, HF_HUB_OFFLINE=1 or EDGELLM_OFFLINE=1): the store,
  then the Hugging Face cache; no network call is made at all.

Everything on the wire goes through the real huggingface_hub client, so its
token handling (HF_TOKEN, `hf auth login`), proxies and error types apply.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Optional
from urllib.parse import urlsplit

from edgellm import paths
from edgellm.errors import DownloadError, InsufficientResources, IntegrityError, ModelExists, ModelNotFound, OfflineError
from edgellm.fsutil import atomic_path, check_free_disk, free_bytes, human_size, sha256_file
from edgellm.gguf.reader import read_gguf
from edgellm.models.hub_ref import Target, check_repo_path, default_name, match_level, resolve_target, split_members
from edgellm.models.preflight import Preflight, preflight_ram
from edgellm.models.resolve import record_from_info
from edgellm.models.store import ModelRecord, Store, validate_name
from edgellm.models.transfer import RemoteFile, call, endpoint, fetch, resume_size, sidecar_file, verify
from edgellm.progress import CancelToken, ProgressCallback, no_progress

log = logging.getLogger(__name__)

MiB = 1 << 20
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
_TRUTHY = ("1", "true", "yes", "on")

# huggingface_hub reads this once, at import (which happens lazily, after this):
# edgellm fetches the files the user asked for and nothing else (no agent
# registry look-up on the side, which matters behind a firewall).
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


# -- environment ----------------------------------------------------------------


def is_offline(offline: bool = False) -> bool:
    return offline or any(os.environ.get(v, "").lower() in _TRUTHY for v in ("HF_HUB_OFFLINE", "EDGELLM_OFFLINE"))


def hf_cache_dir() -> Path:
    """The Hugging Face hub cache, by the client's own rules, read at call time."""
    env = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
    if env:
        return Path(env).expanduser()
    hf_home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(hf_home).expanduser() / "hub"


def downloads_dir(store: Store) -> Path:
    return store.home / "downloads"


# -- the pull -------------------------------------------------------------------


def pull(
    ref: str,
    *,
    store: Optional[Store] = None,
    level: Optional[str] = None,
    filename: Optional[str] = None,
    revision: Optional[str] = None,
    name: Optional[str] = None,
    force: bool = False,
    offline: bool = False,
    token: Optional[str] = None,
    on_progress: ProgressCallback = no_progress,
    on_preflight: Optional[Callable[[Preflight], None]] = None,
    cancel: Optional[CancelToken] = None,
    **_ignored: Any,
) -> ModelRecord:
    """Pull catalog `NAME[:LEVEL]`, or a Hub repo `owner/name` with `level` or `filename`.

    Returns the registered record (or the one already in the store).
    Raises UsageError/CatalogError (bad reference), ModelNotFound (repo, file,
    revision or level missing), InsufficientResources (disk; RAM unless
    `force`), DownloadError (auth, retries exhausted), IntegrityError (sha256
    mismatch: the file is deleted), OfflineError (offline and not cached),
    Cancelled (the partial download is kept for the next pull).
    """
    store = store or Store()
    target = resolve_target(ref, level=level, filename=filename, revision=revision, name=name)
    if target.name and (rec := _existing(store, target, target.filenames or None)):
        return rec
    if is_offline(offline):
        return _pull_offline(store, target, on_progress=on_progress, cancel=cancel)
    from huggingface_hub import HfApi  # huggingface_hub (~0.3 s) only on a Hub call

    ep = endpoint()
    what = {"repo": target.repo, "revision": target.revision}
    info = call(
        lambda: HfApi(endpoint=ep, token=token).model_info(target.repo, revision=target.revision, files_metadata=True),
        what=what,
        cancel=cancel,
    )
    siblings = {s.rfilename: s for s in (info.siblings or [])}
    filenames = target.filenames or match_level(target.level or "", list(siblings), repo=target.repo)
    if not target.catalog and target.filenames:
        filenames = split_members(filenames[0], list(siblings)) if filenames[0] in siblings else filenames
    for f in filenames:
        check_repo_path(f)  # the listing is remote input too: its names become URLs and local paths
        if f not in siblings:
            raise ModelNotFound(f"{target.repo} has no file '{f}' at {target.revision or 'main'} (404)")
    name = target.name or default_name(filenames[0])
    validate_name(name)
    if rec := _existing(store, Target(target.repo, target.level, filenames, target.revision, name, target.catalog), filenames):
        return rec
    commit = info.sha or target.revision or "main"
    files = []
    for f in filenames:
        s = siblings[f]
        sha = (s.lfs.sha256 if s.lfs else "") or ""
        if not _SHA256_RE.match(sha.lower()) or not s.size:
            raise DownloadError(f"{target.repo}: {f} has no LFS sha256 on the Hub, so it cannot be verified")
        files.append(RemoteFile(f, int(s.size), sha.lower()))
    return _download_and_register(
        store,
        target,
        name,
        commit,
        files,
        token=token,
        force=force,
        on_progress=on_progress,
        on_preflight=on_preflight,
        cancel=cancel,
    )


def _existing(store: Store, target: Target, filenames: Optional[list[str]]) -> Optional[ModelRecord]:
    rec = store.find(target.name) if target.name else None
    if rec is None:
        return None
    if target.catalog is not None and rec.catalog == target.catalog.name:
        return rec
    if rec.source.startswith(f"hf:{target.repo}@") and (filenames is None or rec.extra.get("filenames") == filenames):
        return rec
    raise ModelExists(f"a model named '{target.name}' already exists ({rec.source}); pick another --name or remove it first")


def _download_and_register(
    store: Store,
    target: Target,
    name: str,
    commit: str,
    files: list[RemoteFile],
    *,
    token,
    force,
    on_progress,
    on_preflight,
    cancel,
) -> ModelRecord:
    import filelock  # filelock only where the index is written

    dl = paths.ensure(downloads_dir(store))
    total = sum(f.size for f in files)
    have = {f.sha256: resume_size(dl, f) for f in files}
    cached = {f.sha256: _hf_cached_blob(target.repo, f) for f in files}
    remaining = sum(f.size - have[f.sha256] for f in files if cached[f.sha256] is None)

    # Preflight 1: disk, before any byte is fetched.
    disk_free = free_bytes(dl)
    check_free_disk(dl, remaining, what=f"{name} ({human_size(total)}, {human_size(remaining)} to fetch)")

    locks = [filelock.FileLock(str(dl / f"{f.sha256}.lock")) for f in files]
    try:
        for lk in locks:
            lk.acquire(timeout=0)
    except filelock.Timeout:
        raise DownloadError(f"another edgellm process is already downloading {name}") from None
    try:
        locate = _locator(target.repo, commit, token=token, cancel=cancel)

        # Preflight 2: RAM, from the first shard's GGUF header.
        def fetch_header(f: RemoteFile, upto: int) -> Path:
            # No progress events yet: the preflight report comes first, then the download's bar.
            return fetch(dl, f, locate, commit=commit, repo=target.repo, on_progress=no_progress, cancel=cancel, limit=upto)

        pf = preflight_ram(dl, files, cached, fetch_header, total=total, remaining=remaining, disk_free=disk_free)
        log.info("preflight for %s: %s", name, pf.summary())
        if on_preflight:
            on_preflight(pf)
        if not pf.fits_ram:
            msg = f"{name} may not fit in RAM: {pf.memory.describe()}, {human_size(pf.ram_available)} available"
            if not force:
                raise InsufficientResources(msg + "; pass --force to pull anyway")
            log.warning("%s; pulling anyway (--force)", msg)

        folder = store.model_folder(name)
        finals: list[Path] = []
        shas: dict[str, str] = {}
        with _removed_unless_registered(store, name, finals):
            for f in files:
                final = folder / Path(f.filename).name
                in_cache = cached[f.sha256]
                if in_cache is not None:
                    _adopt(in_cache, final, f, on_progress=on_progress, cancel=cancel)
                else:
                    part = fetch(dl, f, locate, commit=commit, repo=target.repo, on_progress=on_progress, cancel=cancel)
                    verify(part, f, on_progress=on_progress, cancel=cancel)
                    folder.mkdir(parents=True, exist_ok=True)
                    os.replace(part, final)
                    sidecar_file(dl, f).unlink(missing_ok=True)
                finals.append(final)
                shas[store.relative(final)] = f.sha256
            rec = _record(
                store,
                name,
                finals,
                shas,
                total,
                source=f"hf:{target.repo}@{commit}",
                target=target,
                filenames=[f.filename for f in files],
            )
            return store.register(rec)
    finally:
        for lk in locks:
            lk.release()


def _locator(repo: str, commit: str, *, token, cancel) -> Callable[..., tuple[str, dict]]:
    """`locate(file, refresh=False)` -> (URL, headers) for the transfer, from the Hub's metadata, asked once per file
    unless `refresh` (a signed CDN URL expires mid-download)."""
    from huggingface_hub import file_download  # huggingface_hub (~0.3 s) only on a Hub call
    from huggingface_hub.utils import build_hf_headers

    ep = endpoint()
    locations: dict[str, tuple[str, dict]] = {}

    def locate(f: RemoteFile, refresh: bool = False) -> tuple[str, dict]:
        if refresh or f.sha256 not in locations:
            url = file_download.hf_hub_url(repo, f.filename, revision=commit, endpoint=ep)
            meta = call(
                lambda: file_download.get_hf_file_metadata(url, token=token, endpoint=ep),
                what={"repo": repo, "filename": f.filename, "revision": commit},
                cancel=cancel,
            )
            if meta.etag and _SHA256_RE.match(meta.etag) and meta.etag != f.sha256:
                raise IntegrityError(
                    f"{f.filename}: the Hub's ETag {meta.etag[:12]}... contradicts its LFS sha256 {f.sha256[:12]}..."
                )
            headers = build_hf_headers(token=token)
            if urlsplit(meta.location).netloc != urlsplit(ep).netloc:
                headers.pop("authorization", None)  # signed CDN URL: never send the token off the Hub
            locations[f.sha256] = (meta.location, headers)
        return locations[f.sha256]

    return locate


def _record(
    store: Store,
    name: str,
    finals: list[Path],
    shas: dict[str, str],
    total: int,
    *,
    source: str,
    target: Target,
    filenames: list[str],
) -> ModelRecord:
    info = read_gguf(finals[0])
    for p in finals[1:]:
        # Later shards carry only split.* metadata (no architecture): structure checks only.
        read_gguf(p, check=False)
    rels = [store.relative(p) for p in finals]
    rec = record_from_info(
        name,
        info,
        rels,
        shas[rels[0]],
        size_bytes=total,
        source=source,
        catalog=target.catalog.name if target.catalog else None,
        file_sha256=shas,
        extra={"repo": target.repo, "filenames": filenames, "revision": target.revision or "main"},
    )
    rec.level = (target.level or info.level).lower()
    return rec


# -- the Hugging Face cache and offline pulls ------------------------------------------


def _repo_cache(repo: str) -> Path:
    return hf_cache_dir() / ("models--" + repo.replace("/", "--"))


def _hf_cached_blob(repo: str, f: RemoteFile) -> Optional[Path]:
    """The HF cache's blob for `f` (named by its sha256), when complete."""
    p = _repo_cache(repo) / "blobs" / f.sha256
    try:
        return p if p.is_file() and p.stat().st_size == f.size else None
    except OSError:
        return None


def _cached_snapshot(repo: str, revision: Optional[str]) -> Optional[Path]:
    root = _repo_cache(repo)
    rev = revision or "main"
    ref = root / "refs" / rev
    commit = ref.read_text().strip() if ref.is_file() else rev
    snap = root / "snapshots" / commit
    if snap.is_dir():
        return snap
    snaps = [p for p in (root / "snapshots").glob("*") if p.is_dir()] if revision is None else []
    return snaps[0] if len(snaps) == 1 else None


def _adopt(src: Path, final: Path, f: RemoteFile, *, on_progress, cancel) -> None:
    """Bring a file from the HF cache into the store: a hard link when possible, verified."""
    final.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(final) as tmp:
        try:
            os.link(src, tmp)
        except OSError:
            check_free_disk(final.parent, f.size, what=f"copying {Path(f.filename).name} from the Hugging Face cache")

            shutil.copyfile(src, tmp)
        got = sha256_file(tmp, on_progress=on_progress, cancel=cancel, task=f"verify {Path(f.filename).name}")
        if f.sha256 and got != f.sha256:
            raise IntegrityError(
                f"{src} in the Hugging Face cache has sha256 {got[:12]}..., expected {f.sha256[:12]}...; not used"
            )


def _pull_offline(store: Store, target: Target, *, on_progress, cancel) -> ModelRecord:
    what = (
        target.catalog.name + ":" + (target.level or "")
        if target.catalog
        else f"{target.repo} ({target.filenames[0] if target.filenames else target.level})"
    )
    snap = _cached_snapshot(target.repo, target.revision)
    cache = _repo_cache(target.repo)
    if snap is None:
        raise OfflineError(
            f"offline: {what} is not in the store, nor in the Hugging Face cache ({cache}); pull it while online or `edgellm import` a bundle"
        )
    listing = [str(p.relative_to(snap)) for p in snap.rglob("*") if p.is_file()]
    filenames = target.filenames or match_level(target.level or "", listing, repo=f"{target.repo} (cached)")
    filenames = split_members(filenames[0], listing) if not target.catalog and len(filenames) == 1 else filenames
    missing = [f for f in filenames if not (snap / f).is_file()]
    if missing:
        raise OfflineError(f"offline: {what}: {missing[0]} is not in the store, nor in the Hugging Face cache ({cache})")
    name = target.name or default_name(filenames[0])
    if rec := _existing(store, Target(target.repo, target.level, filenames, target.revision, name, target.catalog), filenames):
        return rec
    files: list[RemoteFile] = []
    finals: list[Path] = []
    shas: dict[str, str] = {}
    folder = store.model_folder(name)
    with _removed_unless_registered(store, name, finals):
        for fn in filenames:
            src = (snap / fn).resolve()
            blob = src.name if _SHA256_RE.match(src.name) else ""
            rf = RemoteFile(fn, src.stat().st_size, blob)
            final = folder / Path(fn).name
            _adopt(src, final, rf, on_progress=on_progress, cancel=cancel)
            finals.append(final)
            shas[store.relative(final)] = blob or sha256_file(final)
            files.append(rf)
        rec = _record(
            store,
            name,
            finals,
            shas,
            sum(f.size for f in files),
            source=f"hf:{target.repo}@{snap.name}",
            target=target,
            filenames=filenames,
        )
        return store.register(rec)


@contextlib.contextmanager
def _removed_unless_registered(store: Store, name: str, finals: list[Path]) -> Iterator[None]:
    """Files moved into the store's folder stay only if the model got registered:
    a failure or a cancel between the first rename and the index update removes them."""
    try:
        yield
    except BaseException:
        if not store.find(name):
            for p in finals:
                p.unlink(missing_ok=True)
        raise


__all__ = ["Preflight", "RemoteFile", "pull", "match_level", "is_offline", "endpoint", "hf_cache_dir", "downloads_dir"]
