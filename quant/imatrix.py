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

A stored matrix is `<EDGELLM_HOME>/imatrix/<name>.gguf` plus `<name>.json`
(its lineage: model, text name and sha256, tokens, ctx, chunks). Both are
written to temp files and renamed, the JSON last: a killed job leaves no
entry, and a `.gguf` without its JSON is never listed.
"""

from __future__ import annotations

import ctypes
import glob
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
from edgellm.progress import CancelToken, Progress, ProgressCallback, RateMeter, no_progress
from quant.imatrix_file import Entry, IMatrix, encode, read_imatrix

log = logging.getLogger(__name__)

DEFAULT_CTX = 512
DEFAULT_BATCH = 2048  # llama-imatrix's default -b: 4 chunks of 512 per decode
CALIBRATION_LABEL = "edgellm-calibration.txt"
_MIN_ROWS = 16  # llama-imatrix ignores smaller batches


# -- ggml's tensor, as the eval callback hands it over ------------------------


class _Tensor(ctypes.Structure):
    """struct ggml_tensor of the pinned ggml.h (checked against ggml_tensor_overhead at start)."""

    _fields_ = [
        ("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4), ("nb", ctypes.c_size_t * 4),
        ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16), ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p), ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64), ("extra", ctypes.c_void_p), ("padding", ctypes.c_char * 8),
    ]


_GGML_OBJECT_SIZE = 32  # struct ggml_object: offs, size, next, type + 4 bytes padding


class _GGML:
    """The few libggml-base functions the collector needs, from llama-cpp-python's own lib folder."""

    def __init__(self) -> None:
        import llama_cpp

        libdir = Path(llama_cpp.__file__).resolve().parent / "lib"
        found = sorted(glob.glob(str(libdir / "libggml-base.*")) + glob.glob(str(libdir / "ggml-base.dll")))
        if not found:
            raise RuntimeFailure(f"libggml-base not found in {libdir}; reinstall with scripts/setup.sh")
        lib = ctypes.CDLL(found[0])
        lib.ggml_tensor_overhead.restype = ctypes.c_size_t
        lib.ggml_op_name.restype = ctypes.c_char_p
        lib.ggml_op_name.argtypes = [ctypes.c_int]
        lib.ggml_backend_buffer_is_host.restype = ctypes.c_bool
        lib.ggml_backend_buffer_is_host.argtypes = [ctypes.c_void_p]
        lib.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
        lib.ggml_backend_tensor_get.restype = None
        lib.ggml_nbytes.restype = ctypes.c_size_t
        lib.ggml_nbytes.argtypes = [ctypes.c_void_p]
        if lib.ggml_tensor_overhead() != _GGML_OBJECT_SIZE + ctypes.sizeof(_Tensor):
            raise RuntimeFailure("this llama.cpp build's ggml_tensor layout is not the pinned one; the importance "
                                 "matrix cannot be read safely")
        ops = {lib.ggml_op_name(i).decode(): i for i in range(48)}
        self.lib, self.mul_mat, self.mul_mat_id = lib, ops["MUL_MAT"], ops["MUL_MAT_ID"]


def _weight_name(raw: bytes) -> str:
    """filter_tensor_name: `CUDA0#blk.0.attn_k.weight#0` -> `blk.0.attn_k.weight`."""
    name = raw.decode("utf-8", "replace")
    if "#" in name:
        name = name.split("#", 2)[1]
    return name


class Collector:
    """IMatrixCollector::collect_imatrix, in numpy. Used as the context's cb_eval."""

    def __init__(self, chunk_size: int, process_output: bool = False) -> None:
        self.g = _GGML()
        self.chunk_size = chunk_size
        self.process_output = process_output
        self.values: dict[str, np.ndarray] = {}  # float32 (n_mat, cols)
        self.counts: dict[str, np.ndarray] = {}  # int64 (n_mat,)
        self.last_chunk = 0
        self.error: Optional[BaseException] = None
        self.callback = _eval_callback_type()(self._callback)

    def _callback(self, t_ptr: int, ask: bool, _ud: Any) -> bool:
        try:
            t = _Tensor.from_address(t_ptr)
            if ask:
                return self._wanted(t)
            self._collect(t)
            return True
        except BaseException as e:  # an exception must not cross into C; report it after the decode
            self.error = self.error or e
            return False

    def _wanted(self, t: _Tensor) -> bool:
        if t.op == self.g.mul_mat_id:
            return True
        if t.op != self.g.mul_mat:
            return False
        src0, src1 = _Tensor.from_address(t.src[0]), _Tensor.from_address(t.src[1])
        if src1.ne[1] < _MIN_ROWS or src1.type != 0:
            return False
        name = _weight_name(src0.name)
        return name.startswith("blk.") or (self.process_output and name == "output.weight")

    def _view(self, x: _Tensor, x_ptr: int, dtype: Any, keep: list) -> np.ndarray:
        """x's data as a (ne3, ne2, ne1, ne0) array, copied to host memory first when it lives elsewhere."""
        g = self.g.lib
        nbytes = g.ggml_nbytes(x_ptr)
        if x.buffer and not g.ggml_backend_buffer_is_host(x.buffer):
            buf = np.empty(nbytes, np.uint8)
            g.ggml_backend_tensor_get(x_ptr, buf.ctypes.data, 0, nbytes)
            keep.append(buf)
            base: Any = buf
        else:
            base = (ctypes.c_char * nbytes).from_address(x.data)
        shape = (x.ne[3], x.ne[2], x.ne[1], x.ne[0])
        strides = (x.nb[3], x.nb[2], x.nb[1], x.nb[0])
        return np.ndarray(shape, dtype, buffer=base, strides=strides)

    def _collect(self, t: _Tensor) -> None:
        src0 = _Tensor.from_address(t.src[0])
        src1 = _Tensor.from_address(t.src[1])
        name = _weight_name(src0.name)
        keep: list = []
        x = self._view(src1, t.src[1], np.float32, keep)
        ne0 = src1.ne[0]
        if t.op == self.g.mul_mat_id:
            ids_t = _Tensor.from_address(t.src[2])
            ids = self._view(ids_t, t.src[2], np.int32, keep)[0, 0]  # (n_tokens, n_ids)
            n_as = src0.ne[2]
            vals, counts = self._entry(name, n_as, ne0)
            n_tokens, n_ids = ids.shape
            # llama-imatrix walks idx outer, token inner: gather the rows in that order
            idx = np.repeat(np.arange(n_ids), n_tokens)
            row = np.tile(np.arange(n_tokens), n_ids)
            ex = ids[row, idx]
            rows = x[0, row, idx % src1.ne[1]]
            if (ex < 0).any() or (ex >= n_as).any():
                raise RuntimeFailure(f"expert id out of range in {name}")
            for e in np.unique(ex):
                _accumulate(vals[e], rows[ex == e])
                counts[e] += int(np.count_nonzero(ex == e))
            self._check(name, vals)
            for e in range(n_as):
                self._note_chunk(int(counts[e]))
            return
        n_mat = src0.ne[2] * src0.ne[3]
        vals, counts = self._entry(name, n_mat, ne0)
        for i3 in range(src1.ne[3]):
            for i2 in range(src1.ne[2]):
                mat_id = (i3 % src0.ne[3]) * src0.ne[2] + (i2 % src0.ne[2])
                _accumulate(vals[mat_id], x[i3, i2])
        self._check(name, vals)
        counts[:] += (src1.ne[1] * src1.ne[2] * src1.ne[3]) // n_mat
        self._note_chunk(int(counts[0]))

    def _entry(self, name: str, n_mat: int, ne0: int) -> tuple[np.ndarray, np.ndarray]:
        vals = self.values.get(name)
        if vals is None:
            vals = self.values[name] = np.zeros((n_mat, ne0), np.float32)
            self.counts[name] = np.zeros(n_mat, np.int64)
        elif vals.shape != (n_mat, ne0):
            raise RuntimeFailure(f"inconsistent size for {name}: {vals.shape} vs {(n_mat, ne0)}")
        return vals, self.counts[name]

    @staticmethod
    def _check(name: str, vals: np.ndarray) -> None:
        if not np.isfinite(vals).all():
            raise EvalError(f"non-finite activations in {name}: the model's weights or the text are broken")

    def _note_chunk(self, count: int) -> None:
        self.last_chunk = max(self.last_chunk, count // self.chunk_size)

    def result(self, datasets: list[str]) -> IMatrix:
        entries = {n: Entry(self.values[n], self.counts[n]) for n in self.values}
        return IMatrix(entries, datasets, self.last_chunk, self.chunk_size)


def _accumulate(acc: np.ndarray, rows: np.ndarray) -> None:
    """acc[j] += x[j]*x[j] for each row in order, in float32, as the C loop does."""
    buf = np.empty((rows.shape[0] + 1, acc.shape[0]), np.float32)
    buf[0] = acc
    np.multiply(rows, rows, out=buf[1:])
    acc[:] = np.add.accumulate(buf, axis=0)[-1]


def _eval_callback_type() -> Any:
    import llama_cpp

    return llama_cpp.ggml_backend_sched_eval_callback


# -- the calibration text -------------------------------------------------------


def calibration_text() -> Any:
    """The text shipped with the package (quant/data/calibration.txt; see its header for the licence)."""
    from quant.perplexity import Text

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
    store: Any = None,
    on_progress: ProgressCallback = no_progress,
    cancel: Optional[CancelToken] = None,
) -> ImatrixRecord:
    """Compute MODEL's importance matrix on `text` (default: the shipped calibration text) and store it."""
    from edgellm.models.resolve import resolve
    from edgellm.models.store import Store, validate_name
    from quant.perplexity import load_text, plan_chunks

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
    remove_stale_partials(out_dir) if out_dir.is_dir() else None
    target, meta = out_dir / f"{name}.gguf", out_dir / f"{name}.json"
    if meta.exists() and not force:
        raise ModelExists(f"an importance matrix named '{name}' already exists (use --name or --force)")
    txt = calibration_text() if text is None else load_text(text=text)
    if cancel is not None:
        cancel.check()

    t0 = time.perf_counter()
    runner = _Runner(resolved.path, ctx=ctx, batch=batch, threads=threads)
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
    arch = runner.architecture
    model_sha = (resolved.record.sha256 if resolved.record is not None and len(resolved.record.sha256) == 64
                 else sha256_file(resolved.path))
    rec = ImatrixRecord(
        name=name, file=str(target), model=label, model_sha256=model_sha, architecture=arch, text=txt.label,
        text_sha256=txt.sha256, text_tokens=int(len(tokens)), tokens=plan.n_chunk * ctx, ctx=ctx, chunks=plan.n_chunk,
        entries=len(m.entries), seconds=round(time.perf_counter() - t0, 3),
    )
    if cancel is not None:
        cancel.check()
    with atomic_path(target) as tmp:
        tmp.write_bytes(encode(m))
    atomic_write_text(meta, json.dumps(rec.to_json(), indent=1, sort_keys=True) + "\n")
    return rec


class _Runner:
    """The model, a context whose cb_eval is a Collector, and llama-imatrix's chunk loop."""

    def __init__(self, path: Path, *, ctx: int, batch: int, threads: Optional[int]) -> None:
        from edgellm.engine.runtime import default_threads, silence_native_stderr
        from edgellm.gguf.reader import check_tensor_data, read_gguf
        from quant.perplexity import DEFAULT_UBATCH, _Batch, _quiet_llama

        info = read_gguf(path)
        check_tensor_data(path)
        self.architecture = info.architecture
        self.path, self.ll = path, _quiet_llama()
        ll = self.ll
        self.n_ctx = ctx
        self.n_seq = max(1, batch // ctx)
        self.n_batch = min(batch, self.n_seq * ctx)
        self.collector = Collector(chunk_size=ctx)
        mp = ll.llama_model_default_params()
        mp.n_gpu_layers = 0
        self.ctx = None
        with silence_native_stderr():
            self.model = ll.llama_model_load_from_file(str(path).encode(), mp)
        if not self.model:
            raise RuntimeFailure(f"llama.cpp could not load {path.name}")
        cp = ll.llama_context_default_params()
        cp.n_ctx = ctx * self.n_seq
        cp.n_batch = self.n_batch
        cp.n_ubatch = min(DEFAULT_UBATCH, self.n_batch)
        cp.n_seq_max = self.n_seq
        cp.n_threads = cp.n_threads_batch = threads or default_threads()
        cp.no_perf = True
        cp.cb_eval = self.collector.callback
        cp.cb_eval_user_data = None
        with silence_native_stderr():
            self.ctx = ll.llama_init_from_model(self.model, cp)
        if not self.ctx:
            self.close()
            raise RuntimeFailure(f"llama.cpp could not create a context of {ctx * self.n_seq} tokens for {path.name}")
        self.vocab = ll.llama_model_get_vocab(self.model)
        self.add_bos = bool(ll.llama_vocab_get_add_bos(self.vocab))
        self.bos = int(ll.llama_vocab_bos(self.vocab))
        self.batch = _Batch(self.n_batch)

    def tokenize(self, data: bytes) -> np.ndarray:
        from quant.perplexity import tokenize

        return tokenize(self.ll, self.vocab, data)

    def run(self, tokens: np.ndarray, plan: Any, *, on_progress: ProgressCallback, cancel: Optional[CancelToken],
            task: str) -> Collector:
        ll, b, n_ctx = self.ll, self.batch, self.n_ctx
        num_batches = (n_ctx + self.n_batch - 1) // self.n_batch
        mem = ll.llama_get_memory(self.ctx)
        meter = RateMeter()
        on_progress(Progress(task, 0, plan.n_chunk, "chunk", message="first chunk"))
        for i in range(0, plan.n_chunk, self.n_seq):
            if cancel is not None:
                cancel.check()
            start, n_seq_batch = i * n_ctx, min(self.n_seq, plan.n_chunk - i)
            ll.llama_memory_clear(mem, True)
            for j in range(num_batches):
                size = min(n_ctx - j * self.n_batch, self.n_batch)
                n = 0
                for seq in range(n_seq_batch):
                    s = start + j * self.n_batch + seq * n_ctx
                    b.token[n:n + size] = tokens[s:s + size]
                    if self.add_bos and j == 0:
                        b.token[n] = self.bos
                    b.pos[n:n + size] = np.arange(j * self.n_batch, j * self.n_batch + size, dtype=np.int32)
                    b.seq[n:n + size] = seq
                    b.logits[n:n + size] = 1  # all outputs, as llama-imatrix: the last layer sees every token
                    n += size
                b.struct.n_tokens = n
                rc = ll.llama_decode(self.ctx, b.struct)
                if self.collector.error is not None:
                    raise self.collector.error
                if rc != 0:
                    raise RuntimeFailure(f"llama.cpp failed to decode chunk {i + 1} of {self.path.name} (code {rc})")
            done = i + n_seq_batch
            on_progress(Progress(task, done, plan.n_chunk, "chunk", rate=meter.update(done)))
        return self.collector

    def close(self) -> None:
        if self.ctx:
            self.ll.llama_free(self.ctx)
            self.ctx = None
        if getattr(self, "model", None):
            self.ll.llama_model_free(self.model)
            self.model = None


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


def get_imatrix(name: str) -> ImatrixRecord:
    for rec in list_imatrices():
        if rec.name == name:
            return rec
    raise ModelNotFound(f"no importance matrix named '{name}' (see `edgellm imatrix --list`)")


@dataclass
class ImatrixChoice:
    """The matrix a quantization uses: its file, as read, and its record when it is a stored one."""

    path: Path
    matrix: IMatrix
    record: Optional[ImatrixRecord]
    sha256: str

    def lineage(self) -> dict[str, Any]:
        d: dict[str, Any] = {"file": str(self.path), "sha256": self.sha256, "chunks": self.matrix.chunk_count,
                             "chunk_size": self.matrix.chunk_size, "datasets": self.matrix.datasets}
        if self.record is not None:
            d.update(name=self.record.name, model=self.record.model, text=self.record.text,
                     text_sha256=self.record.text_sha256, tokens=self.record.tokens)
        return d


def choose_imatrix(ref: str, resolved: Any, *, store: Any = None, on_progress: ProgressCallback = no_progress,
                   cancel: Optional[CancelToken] = None) -> ImatrixChoice:
    """`--imatrix NAME|FILE|auto` for the model `resolved`, checked against it.

    auto: the newest stored matrix made from this very file (same sha256), else
    one computed now on the shipped calibration text and stored.
    """
    from quant.imatrix_file import check_against_model

    label = resolved.label
    record: Optional[ImatrixRecord] = None
    if ref == "auto":
        sha = (resolved.record.sha256 if resolved.record is not None and len(resolved.record.sha256) == 64
               else sha256_file(resolved.path))
        mine = [r for r in list_imatrices() if r.model_sha256 == sha]
        if mine:
            record = max(mine, key=lambda r: r.created)
        else:
            record = compute_imatrix(resolved.path if resolved.record is None else resolved.record.name, store=store,
                                     force=True, on_progress=on_progress, cancel=cancel)
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
    return (f"{rec.name}: importance matrix of {rec.model} on {rec.text} ({rec.chunks} chunks x {rec.ctx} tokens), "
            f"{rec.entries} entries, {rec.seconds:.1f} s\n  {rec.file}")


__all__ = ["compute_imatrix", "choose_imatrix", "list_imatrices", "get_imatrix", "calibration_text", "Collector",
           "ImatrixRecord", "ImatrixChoice", "describe", "QuantizeError"]


def calibration_warnings(names: list[str], text_sha256: str, store: Any) -> list[str]:
    """For `eval`: the models among `names` whose importance matrix (or whose --budget recipe's
    matrix) was computed on the very text being evaluated, so their scores flatter them."""
    out = []
    for n in names:
        rec = store.find(n)
        if rec is None:
            continue
        for what, lineage in (("importance matrix", rec.extra.get("imatrix")),
                              ("recipe's importance matrix", (rec.extra.get("recipe") or {}).get("imatrix"))):
            if isinstance(lineage, dict) and lineage.get("text_sha256") == text_sha256:
                out.append(f"{n}: its {what} was computed on this evaluation text ({lineage.get('text')}, sha256 "
                           f"{text_sha256[:12]}...): its scores are optimistic; evaluate on another text")
                break
    return out
