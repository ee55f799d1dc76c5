"""Moving bytes from the Hub: retries, resumable ranged downloads, verification.

The transfer half of `edgellm.models.hub` (which decides *what* to pull). Every
request goes through huggingface_hub: `get_hf_file_metadata` for the
location, `http_get` for the bytes. What the client does not do is added here:

* Resume across processes. The partial file is
  `EDGELLM_HOME/downloads/<sha256>.download` with a `.json` sidecar (expected
  sha256, size, repo, commit). It does not match the store's stale-temp
  pattern (`*.<pid>.partial`), so a killed pull's bytes survive the next start,
  and it is never in the index, so it is never listed or loaded. The rest is
  fetched as ranged `http_get` calls of at most 8 MiB: the client buffers
  10 MiB before writing, so the segment size is what bounds the bytes lost to
  a `kill -9` (about 1/64 of the file).
* Retries: 5xx, 408/429 and dropped connections are retried with exponential
  backoff (base `EDGELLM_HUB_BACKOFF` s, `EDGELLM_HUB_RETRIES` attempts in a
  row without progress); the client itself retries a body GET only on 408/429.
* Verification: the finished file's sha256 must equal the Hub's LFS sha256
  (the client never checks it); on mismatch the file is deleted.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Optional, cast

from edgellm.errors import Cancelled, DownloadError, EdgeLLMError, IntegrityError, ModelNotFound, one_line
from edgellm.fsutil import atomic_write_text, human_size, sha256_file
from edgellm.progress import CancelToken, Progress, ProgressCallback, RateMeter

log = logging.getLogger(__name__)

MiB = 1 << 20
PARTIAL_SUFFIX = ".download"


@dataclass(frozen=True)
class RemoteFile:
    """One file of a pull, as the Hub describes it."""

    filename: str  # path in the repo
    size: int
    sha256: str


def endpoint() -> str:
    """Read at call time: huggingface_hub reads HF_ENDPOINT only once, at import."""
    env = os.environ.get("HF_ENDPOINT")
    if env:
        return env.rstrip("/")
    from huggingface_hub import constants  # huggingface_hub (~0.3 s) only on a Hub call

    return constants.ENDPOINT


def env_float(var: str, default: float) -> float:
    try:
        return float(os.environ.get(var, default))
    except ValueError:
        return default


# -- Hub errors -> one line -------------------------------------------------------


def _status(e: BaseException) -> Optional[int]:
    resp = getattr(e, "response", None)
    return getattr(resp, "status_code", None)


def _is_transport_error(e: BaseException) -> bool:
    """A connect/read/write/timeout/protocol failure of the HTTP library under huggingface_hub.

    Recognised by its class hierarchy, not by importing the library: huggingface_hub
    1.x is built on `httpx`, 2.x on `httpx2`, and both name the base `TransportError`.
    """
    return any(c.__name__ == "TransportError" and c.__module__.split(".")[0] in ("httpx", "httpx2") for c in type(e).__mro__)


def _retryable(e: BaseException) -> bool:
    from huggingface_hub.errors import HfHubHTTPError  # huggingface_hub (~0.3 s) only on a Hub call

    if isinstance(e, HfHubHTTPError):
        st = _status(e)
        return st is not None and (st >= 500 or st in (408, 429))
    # http_get's size-consistency OSError has no errno; a local disk error (ENOSPC...) has one.
    return _is_transport_error(e) or (isinstance(e, OSError) and e.errno is None)


def hub_error(e: BaseException, *, repo: str, filename: Optional[str] = None, revision: Optional[str] = None) -> EdgeLLMError:
    """Map a huggingface_hub/httpx exception to a one-line EdgeLLMError."""
    # huggingface_hub (~0.3 s) only on a Hub call
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    st = _status(e)
    # GatedRepoError subclasses RepositoryNotFoundError: test it first.
    if isinstance(e, GatedRepoError):
        return DownloadError(
            f"{repo} is gated or private and no token was sent ({st or 401}): set HF_TOKEN or run `hf auth login`"
        )
    if isinstance(e, RepositoryNotFoundError):
        return ModelNotFound(f"no Hub repo named '{repo}' (404); check the name (private repos need HF_TOKEN)")
    if isinstance(e, RevisionNotFoundError):
        return ModelNotFound(f"{repo} has no revision '{revision}' (404)")
    if isinstance(e, RemoteEntryNotFoundError):
        return ModelNotFound(f"{repo} has no file '{filename}' at {revision or 'main'} (404)")
    if isinstance(e, HfHubHTTPError):
        if st == 401:
            return DownloadError(
                f"the Hub refused the token for {repo} (401 invalid credentials): check HF_TOKEN or `hf auth login`"
            )
        if st == 403:
            return DownloadError(
                f"access to {repo} is forbidden (403): accept its license on the Hub with the account of your token"
            )
        if st == 404:
            return ModelNotFound(f"{repo}: {filename or 'repo'} not found (404)")
        return DownloadError(f"the Hub answered HTTP {st} for {repo}/{filename or ''}".rstrip("/"))
    if isinstance(e, OSError) and e.errno:
        return DownloadError(f"cannot write the download of {filename or repo}: {e.strerror}")
    return DownloadError(f"could not reach {endpoint()} for {repo}: {one_line(e, 200, typed=True)}")


def _sleep(seconds: float, cancel: Optional[CancelToken]) -> None:
    end = time.monotonic() + seconds
    while (left := end - time.monotonic()) > 0:
        if cancel is not None:
            cancel.check()
        time.sleep(min(left, 0.1))


def call(fn: Callable[[], Any], *, what: dict, cancel: Optional[CancelToken]) -> Any:
    """Run a metadata call with bounded retries on 5xx and connection errors."""
    retries = int(env_float("EDGELLM_HUB_RETRIES", 5))
    base = env_float("EDGELLM_HUB_BACKOFF", 1.0)
    for attempt in range(1, retries + 1):
        if cancel is not None:
            cancel.check()
        try:
            return fn()
        except EdgeLLMError:
            raise
        except Exception as e:
            if not _retryable(e) or attempt == retries:
                err = hub_error(e, **what)
                if _retryable(e):
                    err = DownloadError(f"{err} (after {attempt} attempts)")
                raise err from None
            log.warning("Hub request failed (%s); retrying in %.1f s", type(e).__name__, base * 2 ** (attempt - 1))
            _sleep(min(30.0, base * 2 ** (attempt - 1)), cancel)
    raise AssertionError("unreachable")


# -- partial downloads ------------------------------------------------------------


def partial_file(dl: Path, f: RemoteFile) -> Path:
    return dl / f"{f.sha256}{PARTIAL_SUFFIX}"


def sidecar_file(dl: Path, f: RemoteFile) -> Path:
    return dl / f"{f.sha256}{PARTIAL_SUFFIX}.json"


def resume_size(dl: Path, f: RemoteFile) -> int:
    """Bytes of `f` already on disk from an earlier pull (0 if none or untrustworthy)."""
    part, side = partial_file(dl, f), sidecar_file(dl, f)
    try:
        meta = json.loads(side.read_text(encoding="utf-8"))
        size = part.stat().st_size
    except (OSError, ValueError):
        part.unlink(missing_ok=True)
        return 0
    if meta.get("sha256") != f.sha256 or meta.get("size") != f.size or size > f.size:
        part.unlink(missing_ok=True)
        side.unlink(missing_ok=True)
        return 0
    return size


def _start_partial(dl: Path, f: RemoteFile, *, repo: str, commit: str) -> Path:
    part, side = partial_file(dl, f), sidecar_file(dl, f)
    if not side.exists():
        atomic_write_text(
            side,
            json.dumps(
                {
                    "repo": repo,
                    "filename": f.filename,
                    "sha256": f.sha256,
                    "size": f.size,
                    "commit": commit,
                    "started": time.time(),
                }
            )
            + "\n",
        )
    part.touch(exist_ok=True)
    return part


class _RangeIgnored(Exception):
    pass


class _SegmentWriter:
    """The file object handed to http_get: refuses bytes past the segment
    (a server that ignored Range), reports progress, honours cancel."""

    def __init__(self, fh, end: int, report: Callable[[int], None], cancel: Optional[CancelToken]) -> None:
        self._fh, self._end, self._report, self._cancel = fh, end, report, cancel
        self._start = fh.tell()

    def write(self, data: bytes) -> int:
        if self._fh.tell() + len(data) > self._end:
            raise _RangeIgnored()
        n = self._fh.write(data)
        self._fh.flush()  # what a kill -9 leaves behind is what we resume from
        self._report(self._fh.tell())
        if self._cancel is not None:
            self._cancel.check()
        return n

    def tell(self) -> int:
        # Bytes of this segment: huggingface_hub 1.x (to 1.2x) checks `expected_size == tell()`,
        # so an absolute position would fail every segment after the first.
        return self._fh.tell() - self._start

    def __getattr__(self, attr: str) -> Any:  # seek/truncate for http_get's own resume logic
        return getattr(self._fh, attr)


class _QuietBar:
    """tqdm stand-in: the CLI and TUI render edgellm's own progress events."""

    def __init__(self, *a, **kw) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def update(self, n=1) -> None:
        pass


def _segment_size(size: int) -> int:
    return max(MiB, min(8 * MiB, (size // 64) // (64 << 10) * (64 << 10)))


def _get_range(url: str, headers: dict, fh, start: int, end: int, report, cancel) -> None:
    """Fetch bytes [start, end) of `url` into `fh` (positioned at `start`) via the client's http_get."""
    from huggingface_hub.file_download import http_get  # huggingface_hub (~0.3 s) only on a Hub call

    writer = _SegmentWriter(fh, end, report, cancel)
    http_get(
        url,
        cast(BinaryIO, writer),  # http_get calls only write() and tell(), which it has
        headers={**headers, "Range": f"bytes={start}-{end - 1}"},
        expected_size=end - start,
        displayed_filename="edgellm",
        tqdm_class=_QuietBar,
    )


def fetch(
    dl: Path,
    f: RemoteFile,
    locate,
    *,
    commit: str,
    repo: str,
    on_progress: ProgressCallback,
    cancel: Optional[CancelToken],
    limit: Optional[int] = None,
) -> Path:
    """Download `f` (its first `limit` bytes) into its partial file, resuming, with bounded retries."""
    part = _start_partial(dl, f, repo=repo, commit=commit)
    retries = int(env_float("EDGELLM_HUB_RETRIES", 5))
    base = env_float("EDGELLM_HUB_BACKOFF", 1.0)
    seg = _segment_size(f.size)
    task = f"download {Path(f.filename).name}"
    meter = RateMeter()
    done = part.stat().st_size
    if done:
        log.info("resuming %s at %s of %s", f.filename, human_size(done), human_size(f.size))

    def report(pos: int) -> None:
        on_progress(Progress(task, pos, f.size, "B", rate=meter.update(pos)))

    limit = f.size if limit is None else min(limit, f.size)
    report(done)
    failures, refreshed = 0, False
    while done < limit:
        if cancel is not None:
            cancel.check()
        end = min(limit, done + seg)
        url, headers = locate(f)
        try:
            with open(part, "r+b") as fh:
                fh.seek(done)
                fh.truncate()
                _get_range(url, headers, fh, done, end, report, cancel)
            done, failures = end, 0
            continue
        except (Cancelled, EdgeLLMError):
            raise
        except _RangeIgnored:
            raise DownloadError(f"the server ignored the Range request for {f.filename}; cannot download it in pieces") from None
        except Exception as e:
            got = part.stat().st_size
            if got > done:
                done, failures = got, 0  # progress was made: the retry budget starts again
            st = _status(e)
            if st in (401, 403, 404) and not refreshed:
                refreshed = True  # signed CDN URLs expire: ask the Hub for a fresh one once
                locate(f, refresh=True)
                continue
            if not _retryable(e):
                raise hub_error(e, repo=repo, filename=f.filename, revision=commit) from None
            failures += 1
            if failures >= retries:
                err = hub_error(e, repo=repo, filename=f.filename, revision=commit)
                raise DownloadError(
                    f"{err} (gave up after {failures} attempts; {human_size(done)} of "
                    f"{human_size(f.size)} kept, pull again to resume)"
                ) from None
            delay = min(30.0, base * 2 ** (failures - 1))
            log.warning(
                "download of %s failed (%s); retry %d/%d in %.1f s", f.filename, type(e).__name__, failures, retries - 1, delay
            )
            _sleep(delay, cancel)
    return part


def verify(part: Path, f: RemoteFile, *, on_progress: ProgressCallback, cancel: Optional[CancelToken]) -> None:
    size = part.stat().st_size
    got = sha256_file(part, on_progress=on_progress, cancel=cancel, task=f"verify {Path(f.filename).name}")
    if size != f.size or got != f.sha256:
        part.unlink(missing_ok=True)
        sidecar_file(part.parent, f).unlink(missing_ok=True)
        raise IntegrityError(
            f"{Path(f.filename).name}: downloaded file has sha256 {got[:12]}... ({size} bytes) but the Hub says "
            f"{f.sha256[:12]}... ({f.size} bytes); it was deleted, pull again"
        )


__all__ = ["RemoteFile", "call", "endpoint", "fetch", "hub_error", "partial_file", "resume_size", "sidecar_file", "verify"]
