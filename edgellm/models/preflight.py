"""The Hub pull's preflight: free disk before the first byte, then RAM from
the GGUF header (its first MiBs, which become the start of the download),
sized by the core's one memory estimate."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

from edgellm.engine.memory import DEFAULT_CTX, MemoryEstimate, Shape, available_ram, estimate, shape_from_size
from edgellm.errors import GGUFError
from edgellm.fsutil import DISK_MARGIN, human_size, partial_path
from edgellm.gguf.reader import GGUFInfo, read_gguf
from edgellm.models.transfer import RemoteFile

log = logging.getLogger(__name__)

MiB = 1 << 20
HEADER_BYTES = 4 * MiB  # enough for the metadata and tensor table of most GGUFs
HEADER_MAX = 32 * MiB  # large vocabularies (128k tokens + merges) need more


@dataclass
class Preflight:
    """Disk and RAM check before the download; both are reported."""

    total_bytes: int
    download_bytes: int  # what is left to fetch (resume)
    disk_folder: str
    disk_free: int
    disk_needed: int  # download_bytes + margin
    memory: MemoryEstimate
    ram_available: int
    kv_source: str = "gguf header"  # or "estimate"

    @property
    def ram_needed(self) -> int:
        return self.memory.total_bytes

    @property
    def fits_disk(self) -> bool:
        return self.disk_free >= self.disk_needed

    @property
    def fits_ram(self) -> bool:
        return self.ram_available >= self.ram_needed

    def summary(self) -> str:
        kv = "" if self.kv_source == "gguf header" else f" ({self.kv_source})"
        return (
            f"disk: need {human_size(self.disk_needed)} (incl. {human_size(DISK_MARGIN)} margin), "
            f"{human_size(self.disk_free)} free; RAM: {self.memory.describe()}{kv}, "
            f"{human_size(self.ram_available)} available"
        )

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        del d["memory"]
        d.update(
            memory=self.memory.to_json(),
            n_ctx=self.memory.ctx,
            kv_bytes=self.memory.kv_bytes,
            ram_needed=self.ram_needed,
            fits_disk=self.fits_disk,
            fits_ram=self.fits_ram,
        )
        return d


def preflight_ram(
    dl: Path, files: list[RemoteFile], cached: dict, fetch_header, *, total: int, remaining: int, disk_free: int
) -> Preflight:
    first = files[0]
    info = _header_info(dl, first, cached.get(first.sha256), fetch_header)
    n_ctx = min(DEFAULT_CTX, info.context_length) if info and info.context_length else DEFAULT_CTX
    if info is not None and info.block_count:
        # the first shard's header has the shape; the weights are all shards together
        shape, source = Shape.of(info, tensor_bytes=total), "gguf header"
    else:
        shape, source = shape_from_size(total, int(total * 8 / 4.5)), "estimate"
    return Preflight(
        total, remaining, str(dl), disk_free, remaining + DISK_MARGIN, estimate(shape, ctx=n_ctx), available_ram(), source
    )


def _header_info(dl: Path, f: RemoteFile, cached_blob: Optional[Path], fetch_header) -> Optional[GGUFInfo]:
    """GGUF metadata of `f` from its first MiBs. They come from the HF cache or
    an earlier partial download when there is one; otherwise they are fetched
    as the first bytes of the partial download, so nothing is fetched twice."""
    if cached_blob is not None:
        return _parse_header(_read_prefix(cached_blob, min(f.size, HEADER_MAX)), dl)
    want = min(f.size, HEADER_BYTES)
    while True:
        part = fetch_header(f, want)
        info = _parse_header(_read_prefix(part, want), dl)
        if info is not None or want >= min(f.size, HEADER_MAX):
            return info
        want = min(f.size, HEADER_MAX)


def _read_prefix(p: Path, n: int) -> bytes:
    with open(p, "rb") as fh:
        return fh.read(n)


def _parse_header(data: bytes, dl: Path) -> Optional[GGUFInfo]:
    tmp = partial_path(dl / "header.gguf")
    try:
        tmp.write_bytes(data)
        return read_gguf(tmp, check=False)
    except GGUFError as e:
        log.debug("GGUF header not parsed from %d bytes: %s", len(data), e)
        return None
    finally:
        tmp.unlink(missing_ok=True)
