"""What convert and quantize share: where an output goes, whether it may be
overwritten, and how it is registered with its lineage.

Both jobs write `<store>/models/<name>/<name>.gguf` by default (or the user's
`-o` path) through `atomic_path`, validate the result with `read_gguf`, and
only then register it with `parent` and `level`, so the store never lists a
file that is not complete.
"""

from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Optional

from edgellm.errors import ModelExists, QuantizeError, UsageError
from edgellm.gguf.reader import GGUFInfo, read_gguf
from edgellm.models.resolve import Resolved, derived_name, record_from_info, resolve
from edgellm.models.store import ModelRecord, Store, validate_name

log = logging.getLogger(__name__)

FLOAT_LEVELS = ("f32", "f16", "bf16")


@dataclass(frozen=True)
class BaseInput:
    """The model a job starts from, resolved and parsed once and passed down (quantize, --budget, --recipe)."""

    resolved: Resolved
    info: GGUFInfo

    @property
    def path(self) -> Path:
        return self.resolved.path

    @property
    def label(self) -> str:
        return self.resolved.label


def open_input(ref: str | Path | BaseInput, store: Store) -> BaseInput:
    """`ref` (a store name, `catalog:level` or a path) resolved and validated with read_gguf; a BaseInput as it is."""
    if isinstance(ref, BaseInput):
        return ref
    resolved = resolve(str(ref), store=store)
    return BaseInput(resolved, read_gguf(resolved.path))


@dataclass
class OutputPlan:
    name: str
    path: Path
    replace: bool  # a registered model of that name is being replaced (--force)


def base_name(resolved: Resolved, info: GGUFInfo) -> str:
    """The name a derived file is named after: the store name, or a cleaned
    file stem with its level suffix dropped ("SmolLM2-135M.Q4_1.gguf" → "smollm2-135m")."""
    if resolved.record is not None:
        return resolved.record.name
    stem = resolved.path.name
    for suffix in (".gguf", ".GGUF"):
        stem = stem.removesuffix(suffix)
    if info.level:
        stem = re.sub(rf"[-._]{re.escape(info.level)}$", "", stem, flags=re.IGNORECASE)
    cleaned = "".join(c if c.isalnum() or c in "._+-" else "-" for c in stem).strip(".-_") or "model"
    return cleaned[:100].lower()


def plan_output(
    resolved: Resolved,
    info: GGUFInfo,
    level_key: str,
    *,
    output: Optional[Path | str],
    name: Optional[str],
    force: bool,
    store: Store,
) -> OutputPlan:
    """Pick the store name and file for a derived model; refuse to clobber."""
    if name is None:
        base: ModelRecord | str = resolved.record if resolved.record is not None else base_name(resolved, info)
        name = derived_name(base, level_key)
    validate_name(name)
    if output is not None:
        path = Path(output).expanduser()
        if path.is_dir():
            path = path / f"{name}.gguf"
        path = path.parent.resolve() / path.name
    else:
        path = store.model_folder(name) / f"{name}.gguf"
    if path.exists() and path.resolve() == resolved.path.resolve():
        raise UsageError(f"the output {path} is the input file; pick another -o or --name")
    if resolved.record is not None and resolved.record.name == name:
        raise UsageError(f"the output name '{name}' is the input model's own name; pick another --name")
    owner = next((m for m in store.list() if m.name != name and any(_same(p, path) for p in m.paths)), None)
    if owner is not None:
        raise ModelExists(f"{path} is the file of model '{owner.name}'; --force does not overwrite another model")
    existing = store.find(name)
    if existing is not None and not force:
        raise ModelExists(f"a model named '{name}' already exists ({existing.path}); use --force to replace it")
    if path.exists() and not force:
        if existing is None and _inside(path, store.models_dir):
            # a finished file whose registration never happened (killed between
            # rename and register): nothing refers to it, so it is not kept
            log.info("replacing unregistered leftover %s", path)
        else:
            raise ModelExists(f"{path} already exists; use --force to replace it")
    return OutputPlan(name=name, path=path, replace=existing is not None)


def check_writable(folder: Path) -> None:
    """Fail early with the OS's reason if the output folder cannot take a file."""

    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise QuantizeError(f"cannot create the output folder {folder}: {e.strerror or e}") from None
    probe = folder / f".edgellm-write-test.{os.getpid()}.partial"
    try:
        with open(probe, "wb"):
            pass
    except OSError as e:
        raise QuantizeError(f"cannot write to the output folder {folder}: {e.strerror or e}") from None
    finally:
        try:
            probe.unlink()
        except OSError:
            pass


def _same(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return False


def _inside(path: Path, folder: Path) -> bool:
    try:
        path.resolve().relative_to(folder.resolve())
        return True
    except ValueError:
        return False


def register_output(
    store: Store, plan: OutputPlan, info: GGUFInfo, sha: str, *, resolved: Resolved, source: str, extra: dict[str, Any]
) -> ModelRecord:
    """Register a finished, validated output with its lineage; a failure to
    register removes the file, so no unregistered output is left in the store."""
    try:
        return _register(store, plan, info, sha, resolved=resolved, source=source, extra=extra)
    except BaseException:
        plan.path.unlink(missing_ok=True)
        raise


def _register(
    store: Store, plan: OutputPlan, info: GGUFInfo, sha: str, *, resolved: Resolved, source: str, extra: dict[str, Any]
) -> ModelRecord:
    rel = store.relative(plan.path)
    parent = resolved.record.name if resolved.record is not None else None
    if parent is None:
        extra = {**extra, "parent_path": str(resolved.path.resolve())}
    catalog = resolved.record.catalog if resolved.record is not None else None
    info.path = plan.path
    rec = record_from_info(
        plan.name,
        info,
        [rel],
        sha,
        size_bytes=plan.path.stat().st_size,
        source=source,
        parent=parent,
        catalog=catalog,
        file_sha256={rel: sha},
        extra=extra,
    )
    return store.register(rec, replace=plan.replace)


def output_fields(rec: ModelRecord, plan: OutputPlan, out: GGUFInfo, sha: str) -> dict[str, Any]:
    """What a convert or quantize result says of its registered file, under the fields both results name alike."""
    return {
        "name": rec.name,
        "level": out.level,
        "path": plan.path,
        "size_bytes": out.size_bytes,
        "bpw": out.bpw,
        "tensor_types": out.tensor_types,
        "parent": rec.parent,
        "sha256": sha,
        "record": rec,
    }


def inherited_lineage(resolved: Resolved) -> dict[str, Any]:
    """Lineage facts a derived file must carry on: a base that was itself
    dequantized from a quantized file is not a true full-precision base."""
    rec = resolved.record
    if rec is None:
        return {}
    src = rec.extra.get("dequantized_from") or rec.extra.get("base_dequantized_from")
    return {"base_dequantized_from": src} if src else {}


def result_json(result: Any) -> dict[str, Any]:
    """A convert/quantize result dataclass as JSON: every field but the store
    record (its own `to_json` is the store's view), path as text, timings and
    bits per weight rounded."""
    d = {f.name: getattr(result, f.name) for f in fields(result) if f.name != "record"}
    d["path"] = str(d["path"])
    for key, digits in (("bpw", 4), ("seconds", 3), ("quantize_seconds", 3)):
        if key in d:
            d[key] = round(d[key], digits)
    return d
