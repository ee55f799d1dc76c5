"""What a pull reference names, before the network is consulted.

`NAME[:LEVEL]` resolves through the catalog (models.toml); `owner/repo` takes
a level, matched against the repo listing by GGUF naming, case-insensitively,
or a file; a split GGUF resolves to its whole set. `edgellm.models.hub` does
the pull itself, online or from the Hugging Face cache.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from edgellm.errors import CatalogError, ModelNotFound, UsageError
from edgellm.models.catalog import CatalogEntry, load_catalog, parse_ref
from edgellm.models.resolve import store_name
from edgellm.models.store import validate_name

_SPLIT_RE = re.compile(r"-(\d{5})-of-(\d{5})\.gguf$", re.IGNORECASE)
_LEVEL_RE = re.compile(r"[-_.]((?:i?q\d[a-z0-9_]*)|f16|bf16|f32)(?:-\d{5}-of-\d{5})?\.gguf$", re.IGNORECASE)


@dataclass
class Target:
    """What a reference asks for, before the network is consulted."""

    repo: str
    level: Optional[str]
    filenames: list[str]  # empty: resolve `level` against the repo listing
    revision: Optional[str]
    name: Optional[str]
    catalog: Optional[CatalogEntry] = None


def resolve_target(ref: str, *, level, filename, revision, name) -> Target:
    base, ref_level = parse_ref(ref)
    level = (level or ref_level or "").lower() or None
    if name is not None:
        validate_name(name)
    if "/" not in base:
        entry = load_catalog().get(base)  # CatalogError names the problem
        level = level or entry.default_level
        if filename:
            raise UsageError("--file applies to Hub repos (owner/name); catalog models pick files by level")
        files = entry.files.get(level)
        if not files:
            raise CatalogError(
                f"'{entry.name}' has no {level} file in {entry.repo}; levels there: {', '.join(entry.files) or 'none'}"
            )

        return Target(entry.repo, level, list(files), revision, name or store_name(entry.name, level), entry)
    if base.count("/") != 1 or not all(re.fullmatch(r"[\w.-]{1,96}", p) for p in base.split("/")):
        raise UsageError(f"'{base[:80]}' is neither a catalog name nor a Hub repo id (owner/name)")
    if filename and level:
        raise UsageError("give either --level or --file, not both")
    if not filename and not level:
        raise UsageError(f"pulling from the repo {base} needs --level LEVEL (e.g. q4_k_m) or --file FILE.gguf")
    if filename:
        check_repo_path(filename)
        if not filename.lower().endswith(".gguf"):
            raise UsageError(f"{filename} is not a .gguf file")
    return Target(base, level, [filename] if filename else [], revision, name)


def check_repo_path(f: str) -> None:
    if not f or "\x00" in f or f.startswith("/") or "\\" in f or ".." in f.split("/") or len(f) > 255:
        raise UsageError(f"unsafe file name {f[:60]!r}")


def default_name(filename: str) -> str:
    stem = _SPLIT_RE.sub("", Path(filename).name)
    stem = re.sub(r"\.gguf$", "", stem, flags=re.IGNORECASE)
    cleaned = "".join(c if c.isalnum() or c in "._+-" else "-" for c in stem).strip(".-_") or "model"
    return cleaned[:120].lower()


def split_members(filename: str, listing: list[str]) -> list[str]:
    """All shards of the split set `filename` belongs to, or [filename]."""
    m = _SPLIT_RE.search(filename)
    if not m:
        return [filename]
    n = int(m.group(2))
    prefix = filename[: m.start()]
    shards = [f"{prefix}-{i:05d}-of-{n:05d}.gguf" for i in range(1, n + 1)]
    lower = {f.lower(): f for f in listing}
    missing = [s for s in shards if s.lower() not in lower]
    if missing:
        raise ModelNotFound(f"split GGUF {Path(filename).name} is incomplete in the repo: {Path(missing[0]).name} is missing")
    return [lower[s.lower()] for s in shards]


def match_level(level: str, listing: list[str], *, repo: str) -> list[str]:
    """The file (or split set) in `listing` for `level`, by GGUF naming, case-insensitively."""
    want = level.lower()
    sets: dict[str, list[str]] = {}
    for f in listing:
        m = _LEVEL_RE.search(Path(f).name)
        if m and m.group(1).lower() == want:
            key = _SPLIT_RE.sub("", f).lower()
            sets.setdefault(key, []).append(f)
    if not sets:
        levels = sorted({m.group(1).lower() for f in listing if (m := _LEVEL_RE.search(Path(f).name))})
        raise ModelNotFound(f"{repo} has no {level} GGUF; levels there: {', '.join(levels) or 'none (no .gguf files)'}")
    if len(sets) > 1:
        names = ", ".join(sorted(min(v) for v in sets.values()))
        raise UsageError(f"{level} matches several files in {repo}: {names}; pick one with --file")
    (files,) = sets.values()
    return split_members(sorted(files)[0], listing)
