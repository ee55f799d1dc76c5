"""Importance matrices computed exactly as llama.cpp's `llama-imatrix` does.

Why in-process through the eval callback rather than the `llama-imatrix`
binary: the callback (`llama_context_params.cb_eval`) is part of the
libllama that llama-cpp-python already built at setup, so nothing else has
to be compiled on a user's machine (a second shared build of llama.cpp is
~8 minutes on 2 cores, which the fresh-machine demo cannot afford), and the
job gets edgellm's progress, cancel and atomic write like every other one.

The algorithm is tools/imatrix/imatrix.cpp of the pinned tree, step by step:
- the scheduler asks about every graph node; we take MUL_MAT nodes whose
  weight is a `blk.*` tensor and whose activations (src1) are F32 with at
  least 16 rows, and every MUL_MAT_ID (experts);
- for each such node, each activation row x adds x*x to the weight's
  per-column sums (float32, in row order: `np.add.accumulate` is the same
  sequential sum as the C loop) and the row count to its count;
- the text is tokenized once (BOS rule of the model, no special parsing),
  cut into chunks of n_ctx tokens, each chunk's first token replaced by BOS
  when the model adds one, and n_batch/n_ctx chunks (2048/512 = 4) go through
  one decode as parallel sequences, every position asking for logits (so the
  last layer sees all tokens, as in llama-imatrix);
- the output is llama-imatrix's GGUF (quant/imatrix_file.py).

One difference, on by default: the output layer's matrix gets an entry too
(`output.weight`, or `token_embd.weight` where the model ties it to the
embeddings). llama-imatrix takes `output.weight` only with --process-output
and a tied output never, so llama-quantize rounds the output unweighted.
Weighted, the gridless 135M's tied output in Q5_1 costs 0.0084 KLD in a probe
instead of 0.0153 (docs/quantize.md). The `blk.*` entries are llama-imatrix's
either way (`--no-process-output` gives its file exactly); llama-quantize
reads the extra entry as it reads any other.

A stored matrix is `<EDGELLM_HOME>/imatrix/<name>.gguf` plus `<name>.json`
(its lineage: model, text name and sha256, tokens, ctx, chunks). Both are
written to temp files and renamed, the JSON last: a killed job leaves no
entry, and a `.gguf` without its JSON is never listed.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Optional

import numpy as np

from edgellm import paths
from edgellm.errors import EvalError, ModelExists, ModelNotFound, QuantizeError, RuntimeFailure, UsageError
from edgellm.fsutil import atomic_path, atomic_write_text, remove_stale_partials, sha256_file
from edgellm.models.resolve import resolve
from edgellm.models.store import Store, validate_name
from edgellm.progress import CancelToken, Progress, ProgressCallback, RateMeter, no_progress
from quant._imatrix_collect import OUTPUT_NAMES, Collector
from quant.corpus import Text, load_text
from quant.imatrix_file import IMatrix, check_against_model, encode, read_imatrix
from quant.perplexity import ChunkPlan, LogitsRunner, plan_chunks

log = logging.getLogger(__name__)

DEFAULT_CTX = 512
DEFAULT_BATCH = 2048  # llama-imatrix's default -b: 4 chunks of 512 per decode
CALIBRATION_LABEL = "edgellm-calibration.txt"


# -- the calibration text -------------------------------------------------------


def calibration_text() -> Any:
    """The text shipped with the package (quant/data/calibration.txt; see its header for the licence)."""

    data = resources.files("quant").joinpath("data/calibration.txt").read_bytes()
    if data.endswith(b"\n"):  # as llama.cpp's -f reads a file
        data = data[:-1]
    return Text(data, CALIBRATION_LABEL, hashlib.sha256(data).hexdigest())


def calibration_path() -> Path:
    return Path(str(resources.files("quant").joinpath("data/calibration.txt")))


# -- computing ------------------------------------------------------------------


@dataclass
class ImatrixRecord:
    """A stored importance matrix and where it came from."""

    name: str
    file: str
    model: str
    model_sha256: str
    architecture: str
    text: str
    text_sha256: str
    text_tokens: int
    tokens: int  # tokens evaluated: chunks x ctx
    ctx: int
    chunks: int
    entries: int
    seconds: float = 0.0
    created: float = field(default_factory=time.time)
    output: bool = False  # has the output layer's entry (records from before it was collected: no)

    @property
    def path(self) -> Path:
        return Path(self.file)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def folder() -> Path:
    return paths.home() / "imatrix"


def compute_imatrix(
    model: str | Path,
    *,
    text: Optional[str | Path] = None,
    ctx: int = DEFAULT_CTX,
    chunks: Optional[int] = None,
    batch: int = DEFAULT_BATCH,
    name: Optional[str] = None,
    force: bool = False,
    threads: Optional[int] = None,
    output: bool = True,
    store: Any = None,
    on_progress: ProgressCallback = no_progress,
    cancel: Optional[CancelToken] = None,
) -> ImatrixRecord:
    """Compute MODEL's importance matrix on `text` (default: the shipped calibration text) and store it;
    `output`: with the output layer's entry (see the module docstring)."""

    if ctx < 16:
        raise UsageError(f"--ctx {ctx} is too small (at least 16)")
    if chunks is not None and chunks < 1:
        raise UsageError("--chunks must be at least 1")
    if threads is not None and threads < 1:
        raise UsageError("--threads must be at least 1")
    store = store or Store()
    resolved = resolve(str(model), store=store)
    label = resolved.record.name if resolved.record is not None else resolved.path.stem
    name = validate_name(name or f"{label}-imatrix")
    out_dir = folder()
    if out_dir.is_dir():
        remove_stale_partials(out_dir)  # a killed writer's temp file
    target, meta = out_dir / f"{name}.gguf", out_dir / f"{name}.json"
    if meta.exists() and not force:
        raise ModelExists(f"an importance matrix named '{name}' already exists (use --name or --force)")
    txt = calibration_text() if text is None else load_text(text=text)
    if cancel is not None:
        cancel.check()

    t0 = time.perf_counter()
    runner = _Runner(resolved.path, ctx=ctx, batch=batch, threads=threads, output=output, cancel=cancel)
    try:
        tokens = runner.tokenize(txt.data)
        try:
            plan = plan_chunks(len(tokens), ctx, chunks, batch)
        except EvalError as e:
            raise EvalError(str(e).replace("perplexity", "an importance matrix")) from None
        collector = runner.run(tokens, plan, on_progress=on_progress, cancel=cancel, task=f"imatrix {label}")
    finally:
        runner.close()
    m = collector.result([txt.label])
    arch = runner.info.architecture
    model_sha = model_sha256(resolved)
    rec = ImatrixRecord(
        name=name,
        file=str(target),
        model=label,
        model_sha256=model_sha,
        architecture=arch,
        text=txt.label,
        text_sha256=txt.sha256,
        text_tokens=int(len(tokens)),
        tokens=plan.n_chunk * ctx,
        ctx=ctx,
        chunks=plan.n_chunk,
        entries=len(m.entries),
        seconds=round(time.perf_counter() - t0, 3),
        output=any(n in OUTPUT_NAMES for n in m.entries),
    )
    if cancel is not None:
        cancel.check()
    with atomic_path(target) as tmp:
        tmp.write_bytes(encode(m))
    try:
        atomic_write_text(meta, json.dumps(rec.to_json(), indent=1, sort_keys=True) + "\n")
    except BaseException:
        # a second Ctrl-C (or a full disk) between the two renames: no matrix without its record
        target.unlink(missing_ok=True)
        raise
    return rec


class _Runner(LogitsRunner):
    """The model, a context whose cb_eval is a Collector, and llama-imatrix's chunk loop."""

    def __init__(
        self,
        path: Path,
        *,
        ctx: int,
        batch: int,
        threads: Optional[int],
        output: bool,
        cancel: Optional[CancelToken] = None,
        collector: Optional[Collector] = None,
    ) -> None:
        # quant/feedback.py hands in its own (a covariance instead of the diagonal)
        self.collector = collector or Collector(chunk_size=ctx, process_output=output)
        self.cancel = cancel
        n_seq = max(1, batch // ctx)
        super().__init__(path, n_ctx=ctx, n_seq=n_seq, n_batch=min(batch, n_seq * ctx), threads=threads)

    def _tune(self, mp: Any, cp: Any) -> None:
        cp.cb_eval = self.collector.callback
        cp.cb_eval_user_data = None
        # a decode of 4 chunks can take a minute on a busy 2-core machine: Ctrl-C stops it between graph nodes
        cancel = self.cancel
        self._abort = self._ll.ggml_abort_callback(lambda _data: bool(cancel is not None and cancel.cancelled))
        cp.abort_callback = self._abort
        cp.abort_callback_data = None

    def run(
        self, tokens: np.ndarray, plan: ChunkPlan, *, on_progress: ProgressCallback, cancel: Optional[CancelToken], task: str
    ) -> Collector:
        ll, b, n_ctx = self._ll, self._batch, self.n_ctx
        num_batches = (n_ctx + plan.n_batch - 1) // plan.n_batch
        mem = ll.llama_get_memory(self.ctx)
        meter = RateMeter()
        on_progress(Progress(task, 0, plan.n_chunk, "chunk", message="first chunk"))
        for i in range(0, plan.n_chunk, plan.n_seq):
            if cancel is not None:
                cancel.check()
            start, n_seq_batch = i * n_ctx, min(plan.n_seq, plan.n_chunk - i)
            ll.llama_memory_clear(mem, True)
            for j in range(num_batches):
                # all outputs (first_output 0), as llama-imatrix: the last layer sees every token
                b.fill_chunks(tokens, plan, start=start, j=j, n_seq=n_seq_batch, first_output=0)
                rc = ll.llama_decode(self.ctx, b.struct)
                if self.collector.error is not None:
                    raise self.collector.error
                if self.cancel is not None:
                    self.cancel.check()
                if rc != 0:
                    raise RuntimeFailure(f"llama.cpp failed to decode chunk {i + 1} of {self.path.name} (code {rc})")
            done = i + n_seq_batch
            on_progress(Progress(task, done, plan.n_chunk, "chunk", rate=meter.update(done)))
        return self.collector


# -- the stored matrices --------------------------------------------------------


def list_imatrices() -> list[ImatrixRecord]:
    out = []
    d = folder()
    for meta in sorted(d.glob("*.json")) if d.is_dir() else []:
        try:
            rec = ImatrixRecord(**json.loads(meta.read_text(encoding="utf-8")))
        except (ValueError, TypeError, OSError):
            log.warning("ignoring unreadable imatrix record %s", meta)
            continue
        if rec.path.is_file():
            out.append(rec)
    return out


def model_sha256(resolved: Any) -> str:
    """A resolved model's sha256, what a matrix is tied to: its store record's when whole, else hashed now."""
    rec = resolved.record
    return rec.sha256 if rec is not None and len(rec.sha256) == 64 else sha256_file(resolved.path)


def stored_for(sha256: str) -> list[ImatrixRecord]:
    """The stored matrices of the model with this sha256, newest first: `--imatrix auto` takes the first."""
    return sorted((r for r in list_imatrices() if r.model_sha256 == sha256), key=lambda r: r.created, reverse=True)


def get_imatrix(name: str) -> ImatrixRecord:
    for rec in list_imatrices():
        if rec.name == name:
            return rec
    raise ModelNotFound(f"no importance matrix named '{name}' (see `edgellm imatrix --list`)")


def delete_imatrix(name: str) -> ImatrixRecord:
    """Remove the stored matrix `name` (its .gguf and its .json); the record it had."""

    rec = get_imatrix(name)  # an unknown name is ModelNotFound, whatever it looks like
    validate_name(name)  # the files are named from it: nothing outside the folder
    # the JSON first, the reverse of compute_imatrix's order: what is left by a crash between is never listed
    (folder() / f"{name}.json").unlink(missing_ok=True)
    (folder() / f"{name}.gguf").unlink(missing_ok=True)
    return rec


@dataclass
class ImatrixChoice:
    """The matrix a quantization uses: its file, as read, and its record when it is a stored one."""

    path: Path
    matrix: IMatrix
    record: Optional[ImatrixRecord]
    sha256: str

    def lineage(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "file": str(self.path),
            "sha256": self.sha256,
            "chunks": self.matrix.chunk_count,
            "chunk_size": self.matrix.chunk_size,
            "datasets": self.matrix.datasets,
        }
        if self.record is not None:
            d.update(
                name=self.record.name,
                model=self.record.model,
                text=self.record.text,
                text_sha256=self.record.text_sha256,
                tokens=self.record.tokens,
            )
        return d


def choose_imatrix(
    ref: str,
    resolved: Any,
    *,
    store: Any = None,
    on_progress: ProgressCallback = no_progress,
    cancel: Optional[CancelToken] = None,
) -> ImatrixChoice:
    """`--imatrix NAME|FILE|auto` for the model `resolved`, checked against it.

    auto: the newest stored matrix made from this very file (same sha256), else
    one computed now on the shipped calibration text and stored.
    """

    label = resolved.label
    record: Optional[ImatrixRecord] = None
    if ref == "auto":
        mine = stored_for(model_sha256(resolved))
        if mine:
            record = mine[0]
        else:
            record = compute_imatrix(
                resolved.path if resolved.record is None else resolved.record.name,
                store=store,
                force=True,
                on_progress=on_progress,
                cancel=cancel,
            )
        path = record.path
    elif os.sep in ref or ref.endswith(".gguf") or ref.endswith(".dat") or Path(ref).is_file():
        path = Path(ref).expanduser()
    else:
        record = get_imatrix(ref)
        path = record.path
    matrix = read_imatrix(path)
    check_against_model(matrix, resolved.path, label=record.name if record else path.name, model_label=label)
    return ImatrixChoice(path=path, matrix=matrix, record=record, sha256=sha256_file(path))


def describe(rec: ImatrixRecord) -> str:
    return (
        f"{rec.name}: importance matrix of {rec.model} on {rec.text} ({rec.chunks} chunks x {rec.ctx} tokens), "
        f"{rec.entries} entries{' (with the output layer)' if rec.output else ''}, {rec.seconds:.1f} s\n  {rec.file}"
    )


__all__ = [
    "compute_imatrix",
    "choose_imatrix",
    "list_imatrices",
    "get_imatrix",
    "delete_imatrix",
    "calibration_text",
    "Collector",
    "ImatrixRecord",
    "ImatrixChoice",
    "describe",
    "QuantizeError",
]


def calibration_warnings(names: list[str], text_sha256: str, store: Any) -> list[str]:
    """For `eval`: the models among `names` whose importance matrix (or whose --budget recipe's
    matrix) was computed on the very text being evaluated, so their scores flatter them."""
    out = []
    for n in names:
        rec = store.find(n)
        if rec is None:
            continue
        for what, lineage in (
            ("importance matrix", rec.extra.get("imatrix")),
            ("recipe's importance matrix", (rec.extra.get("recipe") or {}).get("imatrix")),
        ):
            if isinstance(lineage, dict) and lineage.get("text_sha256") == text_sha256:
                out.append(
                    f"{n}: its {what} was computed on this evaluation text ({lineage.get('text')}, sha256 "
                    f"{text_sha256[:12]}...): its scores are optimistic; evaluate on another text"
                )
                break
    return out
