"""A fake Hugging Face Hub for tests: the real, unpatched ``huggingface_hub`` client talks to it.

The Hub cannot be reached from CI, so this serves the subset of the Hub protocol that
``huggingface_hub`` 2.4 uses for model downloads, over plain HTTP on 127.0.0.1:

* ``GET  /api/models/{repo}`` and ``/api/models/{repo}/revision/{rev}`` -> ``id``, ``sha`` and
  ``siblings``.  As on the Hub, ``size``/``blobId``/``lfs`` are only filled in with ``?blobs=true``
  (what ``HfApi.model_info(files_metadata=True)`` sends).
* ``GET  /api/models/{repo}/tree/{rev}[/{path}]?recursive=`` (``list_repo_tree``/``list_repo_files``,
  ``snapshot_download``) and ``POST /api/models/{repo}/paths-info/{rev}`` (``get_paths_info``).
  No pagination: one page, no ``Link`` header.
* ``HEAD|GET /{repo}/resolve/{rev}/{filename}``.  LFS files answer ``302`` to a second listener (the
  "CDN", ``.cdn_url``) with ``X-Repo-Commit``, ``ETag``/``X-Linked-Etag`` = ``"<sha256>"`` and
  ``X-Linked-Size``.  The CDN runs on another port on purpose: huggingface_hub only stops at the
  redirect (and reads the metadata from it) when the target is another origin, and then drops the
  ``Authorization`` header, exactly as with the real CDN.  Files below ``lfs_min_size`` are plain git
  files: served inline with ``ETag`` = git blob sha1 and no ``lfs`` block, like ``config.json`` on
  the Hub.  Byte bodies support ``Range`` (206/416) and ``Accept-Ranges: bytes``.  No Xet headers
  are ever sent, so the client always takes its plain HTTP path.
* Errors carry the Hub's ``X-Error-Code`` header, which is what huggingface_hub maps to exceptions:
  ``RepoNotFound`` -> RepositoryNotFoundError, ``RevisionNotFound`` -> RevisionNotFoundError,
  ``EntryNotFound`` -> RemoteEntryNotFoundError, ``GatedRepo`` -> GatedRepoError.

Fault knobs (thread-safe, settable while the server runs; ``clear_faults()`` resets them):

* ``cut_after(filename, nbytes, times=1, reset=False)``: send ``nbytes`` of a body, then close.
  ``reset=False`` closes cleanly (FIN: the client sees a short body), ``reset=True`` aborts (RST).
* ``corrupt_byte(filename, offset, times=None)``: flip one byte; metadata keeps the true sha256.
* ``fail_times(filename_or_glob, status, n=1, method=None)``: answer ``status`` n times.  Matches the
  file name, or an ``fnmatch`` glob on the URL path (e.g. ``"/cdn-lfs/*"``, ``"/api/models/*"``).
* ``require_token(token)``: no bearer -> 401 ``GatedRepo``; a wrong one -> 401 "Invalid credentials"
  (as the Hub does).  ``None`` lifts it.  The CDN never checks it (its URLs are "signed").
* ``throttle(bytes_per_second)``: slow every body down so a test can kill a client mid-download.

Counters: ``bytes_sent[filename]`` (body bytes actually written, all requests) and ``requests``
(list of ``Request(method, path, range)``; CDN paths start with ``/cdn-lfs/``).

CLI: ``python tests/support/hubserver.py --port 0 --repo owner/name FILE... [--throttle BPS]``.
"""

from __future__ import annotations

import argparse
import collections
import fnmatch
import hashlib
import json
import pathlib
import socket
import struct
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import NamedTuple

DEFAULT_SHA = "5f0c6e9a1b2d3c4e5f60718293a4b5c6d7e8f901"
CHUNK = 64 * 1024


class Request(NamedTuple):
    method: str
    path: str
    range: str | None


class _File:
    """One repo file; hashes are computed once, bodies are always streamed."""

    def __init__(self, source: bytes | pathlib.Path, lfs_min_size: int):
        self.source = source if isinstance(source, bytes) else pathlib.Path(source)
        sha256, sha1 = hashlib.sha256(), hashlib.sha1()
        self.size = len(source) if isinstance(source, bytes) else self.source.stat().st_size
        sha1.update(b"blob %d\0" % self.size)
        for chunk in self.chunks(0, self.size):
            sha256.update(chunk)
            sha1.update(chunk)
        self.sha256 = sha256.hexdigest()
        self.lfs = self.size >= lfs_min_size
        pointer = f"version https://git-lfs.github.com/spec/v1\noid sha256:{self.sha256}\nsize {self.size}\n"
        self.pointer_size = len(pointer)
        # A git tree holds the pointer for LFS files, so that is what the blob id hashes.
        pointer_sha1 = hashlib.sha1(b"blob %d\0%s" % (len(pointer), pointer.encode())).hexdigest()
        self.blob_id = pointer_sha1 if self.lfs else sha1.hexdigest()

    def chunks(self, start: int, end: int, size: int = CHUNK):
        if isinstance(self.source, bytes):
            for pos in range(start, end, size):
                yield self.source[pos : min(end, pos + size)]
            return
        with open(self.source, "rb") as f:
            f.seek(start)
            while start < end and (data := f.read(min(size, end - start))):
                start += len(data)
                yield data

    def entry(self, path: str) -> dict:
        out = {"type": "file", "path": path, "size": self.size, "oid": self.blob_id}
        if self.lfs:
            out["lfs"] = {"oid": self.sha256, "size": self.size, "pointerSize": self.pointer_size}
        return out


class HubServer:
    def __init__(
        self,
        repos: dict[str, dict[str, bytes | pathlib.Path]],
        *,
        revision_sha: str = DEFAULT_SHA,
        lfs_min_size: int = 0,
        host: str = "127.0.0.1",
        port: int = 0,
    ):
        self.sha = revision_sha
        self.repos = {r: {n: _File(s, lfs_min_size) for n, s in fs.items()} for r, fs in repos.items()}
        self.bytes_sent: collections.Counter[str] = collections.Counter()
        self.requests: list[Request] = []
        self._lock = threading.Lock()
        self.clear_faults()
        self._servers = []
        for is_cdn, p in ((False, port), (True, 0)):
            srv = ThreadingHTTPServer((host, p), _Handler)
            srv.daemon_threads = True  # a client parked on keep-alive must not block stop()
            srv.hub, srv.is_cdn = self, is_cdn
            self._servers.append(srv)
        self.url = f"http://{host}:{self._servers[0].server_address[1]}"
        self.cdn_url = f"http://{host}:{self._servers[1].server_address[1]}"
        # A short poll interval keeps stop() (which waits for a poll) from costing ~0.5 s per test.
        self._threads = [threading.Thread(target=s.serve_forever, args=(0.05,), daemon=True) for s in self._servers]

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> HubServer:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        for s in self._servers:
            s.shutdown()
            s.server_close()

    def __enter__(self) -> HubServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- fault knobs --------------------------------------------------------------------------
    def clear_faults(self) -> None:
        with self._lock:
            self._cuts: dict[str, list] = {}  # filename -> [nbytes, times_left, reset]
            self._corrupt: dict[str, list] = {}  # filename -> [offset, times_left or None]
            self._fails: list[list] = []  # [pattern, status, times_left, method]
            self._token: str | None = None
            self._bps: float | None = None

    def cut_after(self, filename: str, nbytes: int, times: int = 1, *, reset: bool = False) -> None:
        with self._lock:
            self._cuts[filename] = [nbytes, times, reset]

    def corrupt_byte(self, filename: str, offset: int, times: int | None = None) -> None:
        with self._lock:
            self._corrupt[filename] = [offset, times]

    def fail_times(self, pattern: str, status: int, n: int = 1, method: str | None = None) -> None:
        with self._lock:
            self._fails.append([pattern, status, n, method])

    def require_token(self, token: str | None) -> None:
        self._token = token

    def throttle(self, bytes_per_second: float | None) -> None:
        self._bps = bytes_per_second

    def reset_counters(self) -> None:
        with self._lock:
            self.bytes_sent.clear()
            self.requests.clear()

    def file(self, repo_id: str, filename: str) -> _File:
        """Metadata (``size``, ``sha256``, ``blob_id``, ``lfs``) of a served file."""
        return self.repos[repo_id][filename]

    # -- helpers for the handler ----------------------------------------------------------------
    def _take(self, table: dict, filename: str, times_index: int) -> list | None:
        """Consume one use of a per-file fault; None when it is absent or spent."""
        with self._lock:
            fault = table.get(filename)
            if fault is None or fault[times_index] == 0:
                return None
            if fault[times_index] is not None:
                fault[times_index] -= 1
            return list(fault)

    def _take_failure(self, method: str, path: str, filename: str | None) -> int | None:
        with self._lock:
            for f in self._fails:
                pattern, status, left, only = f
                hit = pattern == filename or fnmatch.fnmatch(path, pattern)
                if hit and left > 0 and only in (None, method):
                    f[2] -= 1
                    return status
        return None


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive like the Hub; every reply therefore sets Content-Length
    server_version = "hubserver"

    def log_message(self, *args) -> None:
        pass  # per-request lines would drown pytest output; `requests` is the log

    @property
    def hub(self) -> HubServer:
        return self.server.hub

    # -- plumbing ----------------------------------------------------------------------------
    def _reply(self, status: int, headers: dict | None = None, body: bytes = b"") -> None:
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, str(v))
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _json(self, obj, status: int = 200) -> None:
        self._reply(status, {"Content-Type": "application/json"}, json.dumps(obj).encode())

    def _error(self, status: int, code: str | None, message: str, extra: dict | None = None) -> None:
        headers = {"Content-Type": "application/json", "X-Error-Message": message, **(extra or {})}
        if code:
            headers["X-Error-Code"] = code
        self._reply(status, headers, json.dumps({"error": message}).encode())

    def _dispatch(self) -> None:
        url = urllib.parse.urlsplit(self.path)
        path = urllib.parse.unquote(url.path)
        query = urllib.parse.parse_qs(url.query)
        hub = self.hub
        with hub._lock:
            hub.requests.append(Request(self.command, path, self.headers.get("Range")))
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.server.is_cdn:
            if not path.startswith("/cdn-lfs/"):
                return self._error(404, None, "Not Found")
            path_for_route = path[len("/cdn-lfs") :]
        else:
            path_for_route = path
        repo, rev, filename = _split_resolve(path_for_route)
        status = hub._take_failure(self.command, path, filename)
        if status is not None:
            return self._error(status, None, f"Injected failure {status}")
        if not self.server.is_cdn and not self._authorized(path):
            return
        if path.startswith("/api/models/"):
            return self._api(path[len("/api/models/") :], query, body)
        if repo is None:
            return self._error(404, None, "Not Found")
        self._resolve(repo, rev, filename)

    do_HEAD = do_GET = do_POST = _dispatch

    def _authorized(self, path: str) -> bool:
        token = self.hub._token
        if token is None:
            return True
        auth = self.headers.get("Authorization")
        if auth is None:
            msg = f"Access to {path} is restricted. You must be authenticated to access it."
            self._error(401, "GatedRepo", msg)
            return False
        if auth != f"Bearer {token}":
            self._error(401, None, "Invalid credentials in Authorization header")
            return False
        return True

    def _find(self, repo: str, rev: str) -> dict | None:
        """Repo files, or None after answering the Hub's 404."""
        if repo not in self.hub.repos:
            self._error(404, "RepoNotFound", "Repository not found")
            return None
        if rev not in ("main", self.hub.sha):
            self._error(404, "RevisionNotFound", "Invalid rev id: " + rev)
            return None
        return self.hub.repos[repo]

    # -- /api/models -----------------------------------------------------------------------------
    def _api(self, rest: str, query: dict, body: bytes) -> None:
        # The repo id has a slash in it, so match known ids rather than splitting the path.
        candidates = [r for r in self.hub.repos if rest == r or rest.startswith(r + "/")]
        repo = max(candidates, key=len, default=None)
        if repo is None:
            return self._error(404, "RepoNotFound", "Repository not found")
        tail = rest[len(repo) + 1 :].split("/", 2) if rest != repo else []
        if not tail or (tail[0] == "revision" and len(tail) >= 2):
            rev = "/".join(tail[1:]) if tail else "main"
            if (files := self._find(repo, rev)) is None:
                return
            blobs = query.get("blobs", ["false"])[0].lower() == "true"
            siblings = []
            for name, f in sorted(files.items()):
                s = {"rfilename": name}
                if blobs:
                    s |= {"size": f.size, "blobId": f.blob_id}
                    if f.lfs:
                        s["lfs"] = {"sha256": f.sha256, "size": f.size, "pointerSize": f.pointer_size}
                siblings.append(s)
            gated = "auto" if self.hub._token else False
            return self._json({
                "id": repo, "modelId": repo, "author": repo.split("/")[0], "sha": self.hub.sha, "private": False,
                "gated": gated, "disabled": False, "tags": [], "lastModified": "2024-01-01T00:00:00.000Z",
                "siblings": siblings, "usedStorage": sum(f.size for f in files.values()),
            })  # fmt: skip
        if tail[0] == "tree" and len(tail) >= 2:
            if (files := self._find(repo, tail[1])) is None:
                return
            prefix = tail[2].strip("/") + "/" if len(tail) > 2 and tail[2].strip("/") else ""
            recursive = query.get("recursive", ["false"])[0].lower() == "true"
            out, dirs = [], set()
            for name in sorted(files):
                if not name.startswith(prefix):
                    continue
                parts = name[len(prefix) :].split("/")
                for i in range(1, len(parts) if recursive else min(2, len(parts))):
                    dirs.add(prefix + "/".join(parts[:i]))
                if recursive or len(parts) == 1:
                    out.append(files[name].entry(name))
            if prefix and not out and not dirs:
                return self._error(404, "EntryNotFound", f"{prefix} does not exist on {tail[1]}")
            return self._json([_folder(d) for d in sorted(dirs)] + out)
        if tail[0] == "paths-info" and len(tail) >= 2 and self.command == "POST":
            if (files := self._find(repo, tail[1])) is None:
                return
            form = urllib.parse.parse_qs(body.decode())
            wanted = form.get("paths", []) or json.loads(body or b"{}").get("paths", [])
            out = []
            for p in wanted:
                p = p.strip("/")
                if p in files:
                    out.append(files[p].entry(p))
                elif any(n.startswith(p + "/") for n in files):
                    out.append(_folder(p))
            return self._json(out)
        self._error(404, None, "Not Found")

    # -- /resolve ----------------------------------------------------------------------------
    def _resolve(self, repo: str, rev: str, filename: str) -> None:
        if (files := self._find(repo, rev)) is None:
            return
        hub = self.hub
        commit = {"X-Repo-Commit": hub.sha}
        f = files.get(filename)
        if f is None:
            return self._error(404, "EntryNotFound", f"{filename} does not exist on {rev}", commit)
        if f.lfs and not self.server.is_cdn:
            quote = urllib.parse.quote
            target = f"{hub.cdn_url}/cdn-lfs/{quote(repo)}/resolve/{hub.sha}/{quote(filename)}"
            etag = f'"{f.sha256}"'
            headers = {"Location": target, "ETag": etag, "X-Linked-Etag": etag, "X-Linked-Size": f.size}
            return self._reply(302, {**commit, **headers})
        etag = f'"{f.sha256}"' if f.lfs else f'"{f.blob_id}"'
        self._send_file(filename, f, {**commit, "ETag": etag, "Accept-Ranges": "bytes"})

    def _send_file(self, name: str, f: _File, headers: dict) -> None:
        start, end, status = 0, f.size, 200
        rng = self.headers.get("Range")
        if rng:
            parsed = _parse_range(rng, f.size)
            if parsed is None:
                return self._reply(416, {**headers, "Content-Range": f"bytes */{f.size}"})
            start, end = parsed
            status = 206
            headers["Content-Range"] = f"bytes {start}-{end - 1}/{f.size}"
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, str(v))
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Length", str(end - start))
        self.end_headers()
        if self.command == "HEAD":
            return
        hub = self.hub
        cut = hub._take(hub._cuts, name, 1)
        corrupt = hub._take(hub._corrupt, name, 1)
        stop = min(end, start + cut[0]) if cut else end
        bps = hub._bps
        chunk_size = max(1, min(CHUNK, int(bps / 20))) if bps else CHUNK
        pos = start
        try:
            for chunk in f.chunks(start, stop, chunk_size):
                if corrupt and pos <= corrupt[0] < pos + len(chunk):
                    i = corrupt[0] - pos
                    chunk = chunk[:i] + bytes([chunk[i] ^ 0xFF]) + chunk[i + 1 :]
                t0 = time.monotonic()
                self.wfile.write(chunk)
                pos += len(chunk)
                with hub._lock:
                    hub.bytes_sent[name] += len(chunk)
                if bps:
                    time.sleep(max(0.0, len(chunk) / bps - (time.monotonic() - t0)))
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True  # the client went away mid-body: nothing more to do
            return
        if cut and stop < end:
            self.close_connection = True
            if cut[2]:
                # SO_LINGER 0 makes close() send RST instead of FIN.
                self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                self.connection.close()
            else:
                self.connection.shutdown(socket.SHUT_RDWR)


def _folder(path: str) -> dict:
    return {"type": "directory", "path": path, "oid": hashlib.sha1(path.encode()).hexdigest()}


def _split_resolve(path: str) -> tuple[str | None, str | None, str | None]:
    repo, sep, rest = path.lstrip("/").partition("/resolve/")
    if not sep or "/" not in rest:
        return None, None, None
    rev, _, filename = rest.partition("/")
    return repo, rev, filename


def _parse_range(header: str, size: int) -> tuple[int, int] | None:
    """Single ``bytes=a-b`` / ``a-`` / ``-n`` range -> half-open [start, end), None if unsatisfiable."""
    unit, _, spec = header.strip().partition("=")
    if unit.strip() != "bytes" or "," in spec:
        return None
    a, _, b = spec.strip().partition("-")
    try:
        start, end = (max(0, size - int(b)), size) if not a else (int(a), min(size, int(b) + 1) if b else size)
    except ValueError:
        return None
    return (start, end) if start < end else None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Serve files as a fake Hugging Face Hub repo.")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--repo", required=True, help="owner/name")
    ap.add_argument("--revision-sha", default=DEFAULT_SHA)
    ap.add_argument("--throttle", type=float, default=None, help="bytes per second")
    ap.add_argument("files", nargs="+", type=pathlib.Path)
    args = ap.parse_args(argv)
    files = {p.name: p for p in args.files}
    server = HubServer({args.repo: files}, revision_sha=args.revision_sha, port=args.port)
    server.throttle(args.throttle)
    with server:
        print(server.url, flush=True)
        try:
            threading.Event().wait()
        except KeyboardInterrupt:
            pass


if __name__ == "__main__":
    main()
