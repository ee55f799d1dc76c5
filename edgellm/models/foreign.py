"""GGUF models already on disk in another tool's store: Ollama, LM Studio, the
Hugging Face cache.

Air-gapped sites usually hold their models in one of these; copying a 5 GB
file a second time wastes the disk they have, so `--link` registers the file
where it is (see `store.link_into_store`). Every file is treated as untrusted:
where the tool names a blob by its sha256 (Ollama, the HF cache), the content
must hash to that name, and every file passes `validate_for_import` like any
other import.

Where each tool keeps its models (the tool's own defaults and overrides):
  ollama    $OLLAMA_MODELS, else ~/.ollama/models: manifests/<registry>/<namespace>/<model>/<tag>
            (JSON; the layer with mediaType application/vnd.ollama.image.model) and blobs/sha256-<hex>
  lmstudio  <LM Studio home>/models/<publisher>/<model>/<file>.gguf, the home read from
            ~/.lmstudio-home-pointer, else ~/.lmstudio, else the older ~/.cache/lm-studio;
            settings.json's "downloadsFolder" when set. LM Studio has no environment variable.
  hf        $HF_HUB_CACHE, else $HF_HOME/hub, else ~/.cache/huggingface/hub:
            models--<owner>--<repo>/snapshots/<commit>/<path> -> ../../blobs/<sha256>
`root` (the CLI's --dir) overrides any of them.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from edgellm.errors import IntegrityError, ModelExists, ModelNotFound, UsageError
from edgellm.fsutil import sha256_file
from edgellm.gguf.reader import GGUF_MAGIC, split_set, validate_for_import
from edgellm.models.resolve import register_placed
from edgellm.models.store import ModelRecord, Store, copy_into_store, link_into_store, validate_name
from edgellm.progress import CancelToken, ProgressCallback, no_progress

log = logging.getLogger(__name__)

TOOLS = ("ollama", "lmstudio", "hf")
OLLAMA_MODEL_LAYER = "application/vnd.ollama.image.model"
_OLLAMA_REGISTRY = "registry.ollama.ai"
_SHA_RE = re.compile(r"^[0-9a-f]{64}$")
_MAX_MANIFEST = 1 << 20


@dataclass
class ForeignModel:
    """One model found in another tool's store."""

    tool: str
    name: str  # the tool's own name: "smollm2:135m", "publisher/model/file.gguf", "owner/repo/file.gguf"
    files: list[Path]  # as the tool keeps them (an HF snapshot entry is a symlink)
    expected_sha256: list[Optional[str]]  # per file, where the tool names the blob by it
    size_bytes: int
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def store_name(self) -> str:
        """The name edgellm registers it under by default (a valid store name)."""
        base = self.name
        if self.tool != "ollama":
            base = _stem(self.files[0].name)
        cleaned = re.sub(r"[^A-Za-z0-9._+-]+", "-", base).strip(".-_").lower()
        return re.sub(r"\.{2,}", ".", cleaned)[:128] or "model"

    def to_json(self) -> dict[str, Any]:
        return {
            "tool": self.tool,
            "name": self.name,
            "store_name": self.store_name,
            "path": str(self.files[0]),
            "files": [str(f) for f in self.files],
            "size_bytes": self.size_bytes,
            "sha256": self.expected_sha256[0],
            **self.extra,
        }


def _stem(filename: str) -> str:
    stem = re.sub(r"\.gguf$", "", filename, flags=re.IGNORECASE)
    return re.sub(r"-\d{5}-of-\d{5}$", "", stem)


# -- where each tool keeps its models ---------------------------------------------


def default_root(tool: str) -> Path:
    home = Path.home()
    if tool == "ollama":
        env = os.environ.get("OLLAMA_MODELS")
        return Path(env).expanduser() if env else home / ".ollama" / "models"
    if tool == "hf":
        env = os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE")
        if env:
            return Path(env).expanduser()
        hf_home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", str(home / ".cache")), "huggingface")
        return Path(hf_home).expanduser() / "hub"
    if tool == "lmstudio":
        return _lmstudio_models(home)
    raise UsageError(f"unknown tool '{tool}'; --from takes {', '.join(TOOLS)}")


def _lmstudio_models(home: Path) -> Path:
    lm_home = None
    pointer = home / ".lmstudio-home-pointer"
    try:
        first = pointer.read_text(encoding="utf-8").strip().splitlines()
        if first and Path(first[0]).expanduser().is_dir():
            lm_home = Path(first[0]).expanduser()
    except (OSError, UnicodeDecodeError):
        pass
    if lm_home is None:
        lm_home = next((p for p in (home / ".lmstudio", home / ".cache" / "lm-studio") if p.is_dir()), home / ".lmstudio")
    try:
        folder = json.loads((lm_home / "settings.json").read_text(encoding="utf-8")).get("downloadsFolder")
        if isinstance(folder, str) and folder and Path(folder).expanduser().is_dir():
            return Path(folder).expanduser()
    except (OSError, ValueError, AttributeError):
        pass
    return lm_home / "models"


def discover(tool: str, root: Optional[Path] = None) -> list[ForeignModel]:
    """Every GGUF model in `tool`'s store, sorted by name. A missing store is an error."""
    if tool not in TOOLS:
        raise UsageError(f"unknown tool '{tool}'; --from takes {', '.join(TOOLS)}")
    root = Path(root).expanduser() if root else default_root(tool)
    if not root.is_dir():
        raise ModelNotFound(f"no {LABELS[tool]} store at {root}{_HINT[tool]}")
    found = {"ollama": _ollama, "lmstudio": _lmstudio, "hf": _hf}[tool](root)
    return sorted(found, key=lambda m: m.name)


LABELS = {"ollama": "Ollama", "lmstudio": "LM Studio", "hf": "Hugging Face cache"}
_HINT = {
    "ollama": " (set OLLAMA_MODELS or pass --dir)",
    "lmstudio": " (pass --dir with LM Studio's models folder)",
    "hf": " (set HF_HUB_CACHE or HF_HOME, or pass --dir)",
}


def _ollama(root: Path) -> list[ForeignModel]:
    out = []
    manifests = root / "manifests"
    for mf in sorted(p for p in manifests.rglob("*") if p.is_file()) if manifests.is_dir() else []:
        parts = mf.relative_to(manifests).parts
        if len(parts) != 4:
            continue  # <registry>/<namespace>/<model>/<tag>; anything else is not a manifest
        try:
            if mf.stat().st_size > _MAX_MANIFEST:
                continue
            data = json.loads(mf.read_text(encoding="utf-8"))
            layers = [lay for lay in data.get("layers", []) if lay.get("mediaType") == OLLAMA_MODEL_LAYER]
        except (OSError, ValueError, AttributeError, TypeError):
            log.warning("skipping unreadable Ollama manifest %s", mf)
            continue
        if not layers:
            continue
        digest = str(layers[0].get("digest", ""))
        algo, _, hexd = digest.partition(":")
        if algo != "sha256" or not _SHA_RE.match(hexd):
            log.warning("skipping %s: model layer digest %r is not sha256", mf, digest[:80])
            continue
        blob = next((b for b in (root / "blobs" / f"sha256-{hexd}", root / "blobs" / f"sha256:{hexd}") if b.exists()), None)
        if blob is None:
            log.warning("skipping %s: its model blob sha256-%s is missing", mf, hexd[:12])
            continue
        registry, namespace, model, tag = parts
        name = f"{model}:{tag}"
        if namespace != "library" or registry != _OLLAMA_REGISTRY:
            name = f"{namespace}/{name}" if registry == _OLLAMA_REGISTRY else f"{registry}/{namespace}/{name}"
        out.append(
            ForeignModel(
                "ollama", name, [blob], [hexd], blob.stat().st_size, {"manifest": str(mf), "layer_size": layers[0].get("size")}
            )
        )
    return out


def _gguf_sets(files: list[Path]) -> list[list[Path]]:
    """Model files grouped into split sets (first shard only); projectors skipped."""
    sets, seen = [], set()
    for f in sorted(files):
        if "mmproj" in f.name.lower() or f in seen:
            continue  # a vision projector is not a model on its own
        shards = split_set(f)
        if shards[0] != f:
            continue  # reached through its first shard
        seen.update(shards)
        sets.append(shards)
    return sets


def _lmstudio(root: Path) -> list[ForeignModel]:
    files = [p for p in root.rglob("*") if p.suffix.lower() == ".gguf" and p.is_file()]
    out = []
    for shards in _gguf_sets(files):
        if not all(s.is_file() for s in shards):
            continue
        name = "/".join(shards[0].relative_to(root).parts)
        out.append(ForeignModel("lmstudio", name, shards, [None] * len(shards), sum(s.stat().st_size for s in shards)))
    return out


def _hf(root: Path) -> list[ForeignModel]:
    out = []
    for repo_dir in sorted(root.glob("models--*--*")):
        repo = repo_dir.name.removeprefix("models--").replace("--", "/", 1)
        try:
            main = (repo_dir / "refs" / "main").read_text(encoding="utf-8").strip()
        except OSError:
            main = ""
        snaps = sorted((repo_dir / "snapshots").glob("*"), key=lambda s: s.name != main)  # main's first
        seen: set[str] = set()
        for snap in snaps:
            files = [p for p in snap.rglob("*") if p.suffix.lower() == ".gguf" and p.exists()]
            for shards in _gguf_sets(files):
                rel = "/".join(shards[0].relative_to(snap).parts)
                if rel in seen or not all(s.exists() for s in shards):
                    continue
                seen.add(rel)
                shas = [s.resolve().name if _SHA_RE.match(s.resolve().name) else None for s in shards]
                out.append(
                    ForeignModel(
                        "hf", f"{repo}/{rel}", shards, shas, sum(s.stat().st_size for s in shards), {"revision": snap.name}
                    )
                )
    return out


def select(tool: str, models: list[ForeignModel], wanted: list[str]) -> list[ForeignModel]:
    """The models named in `wanted` (the tool's name, or the store name it would get)."""
    chosen: list[ForeignModel] = []
    for w in wanted:
        hits = [
            m for m in models if w in (m.name, m.store_name) or (tool == "ollama" and ":" not in w and m.name == f"{w}:latest")
        ]
        if not hits:
            raise ModelNotFound(f"no model '{w}' in the {LABELS[tool]} store; run without a name to list them")
        chosen.extend(h for h in hits[:1] if h not in chosen)
    return chosen


# -- registering ----------------------------------------------------------------------


def verify_blob(
    model: ForeignModel, *, on_progress: ProgressCallback = no_progress, cancel: Optional[CancelToken] = None
) -> list[str]:
    """sha256 of every file, refusing one whose content does not match the name the tool gave it."""
    shas = []
    for f, want in zip(model.files, model.expected_sha256, strict=False):
        got = sha256_file(f.resolve(), on_progress=on_progress, cancel=cancel, task=f"verify {model.name}")
        if want and got != want:
            raise IntegrityError(_mismatch(model, f, got, want))
        shas.append(got)
    return shas


def _mismatch(model: ForeignModel, f: Path, got: str, want: str) -> str:
    blob = f.resolve()
    return (
        f"{LABELS[model.tool]} blob {blob} is named for sha256 {want[:12]}... but its content hashes to "
        f"{got[:12]}...; the file is damaged or was changed, refusing '{model.name}'"
    )


def import_foreign(
    model: ForeignModel,
    *,
    link: bool = False,
    name: Optional[str] = None,
    store: Optional[Store] = None,
    on_progress: ProgressCallback = no_progress,
    cancel: Optional[CancelToken] = None,
) -> ModelRecord:
    """Verify, validate and register one model; copied into the store, or linked with `link`.

    Raises IntegrityError (content does not match the tool's sha256), GGUFError
    (not a valid GGUF, tensors that do not tile), ModelExists, InsufficientResources
    (copying), Cancelled. On any failure nothing is registered and nothing is left in the store.
    """

    store = store or Store()
    name = validate_name(name or model.store_name)
    if store.find(name):
        raise ModelExists(f"a model named '{name}' already exists (use --name to pick another)")
    for f in model.files:
        with open(f, "rb") as fh:
            if fh.read(4) != GGUF_MAGIC:
                raise UsageError(
                    f"{LABELS[model.tool]} model '{model.name}' ({f.resolve()}) is not a GGUF file; edgellm runs GGUF only"
                )
    # Cheap refusals first: the tool's own sha256 before the full validation pass.
    shas = verify_blob(model, on_progress=on_progress, cancel=cancel) if (link or any(model.expected_sha256)) else []
    info = validate_for_import([f.resolve() for f in model.files])
    placed: list[Path] = []
    try:
        modes, file_shas, total = set(), {}, 0
        for i, f in enumerate(model.files):
            filename = f"{name}.gguf" if model.tool == "ollama" else f.name  # an Ollama blob has no file name
            if link:
                entry, mode = link_into_store(store, f, name, filename=filename)
                sha, n = shas[i], f.resolve().stat().st_size
                if mode == "hardlink":
                    placed.append(store.models_dir / entry)
            else:
                mode = "copy"
                target, n, sha = copy_into_store(
                    store, f.resolve(), name, filename=filename, on_progress=on_progress, cancel=cancel
                )
                placed.append(target)
                entry = store.relative(target)
                want = model.expected_sha256[i]
                if want and sha != want:  # changed between the check and the copy
                    raise IntegrityError(_mismatch(model, f, sha, want))
            modes.add(mode)
            file_shas[entry] = sha
            total += n
        extra: dict[str, Any] = {"foreign": {"tool": model.tool, "name": model.name, "path": str(model.files[0].resolve())}}
        if link:
            extra["link"] = {
                "mode": "reference" if "reference" in modes else "hardlink",
                "tool": model.tool,
                "origin": str(model.files[0].resolve()),
            }
        return register_placed(store, name, info, file_shas, total, source=f"{model.tool}:{model.name}", extra=extra)
    except BaseException:
        if not store.find(name):  # not a same-named model another process registered meanwhile
            for p in placed:
                p.unlink(missing_ok=True)  # our copy or our link; the tool's own file is never touched
            folder = store.models_dir / name
            if folder.is_dir() and not any(folder.iterdir()):
                folder.rmdir()
        raise


__all__ = ["TOOLS", "ForeignModel", "default_root", "discover", "select", "import_foreign", "verify_blob"]
