"""llama-imatrix's collector (IMatrixCollector::collect_imatrix), as the context's eval callback.

See quant/imatrix.py for the algorithm as a whole; this module is the part
that reads ggml's tensors (through quant/_ggml.py's bindings).
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any, Optional

import numpy as np

from edgellm.errors import EvalError, RuntimeFailure
from quant._ggml import GGML, ggml
from quant._ggml import Tensor as _Tensor
from quant.imatrix_file import Entry, IMatrix

_MIN_ROWS = 16  # llama-imatrix ignores smaller batches
# the output layer's matrix: a model with tied embeddings multiplies by token_embd (its only matmul: the
# embedding itself is a row lookup), and llama-quantize looks the entry up under that name
OUTPUT_NAMES = ("output.weight", "token_embd.weight")


def _weight_name(raw: bytes) -> str:
    """filter_tensor_name: `CUDA0#blk.0.attn_k.weight#0` -> `blk.0.attn_k.weight`."""
    name = raw.decode("utf-8", "replace")
    if "#" in name:
        name = name.split("#", 2)[1]
    return name


class Collector:
    """IMatrixCollector::collect_imatrix, in numpy. Used as the context's cb_eval."""

    def __init__(self, chunk_size: int, process_output: bool = False) -> None:
        self.g: GGML = ggml()
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
        # llama-imatrix's --process-output takes output.weight only, so a tied model's output got no entry
        return name.startswith("blk.") or (self.process_output and name in OUTPUT_NAMES)

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


_scratch = threading.local()


def _accumulate(acc: np.ndarray, rows: np.ndarray) -> None:
    """acc[j] += x[j]*x[j] for each row in order, in float32, as the C loop does.

    A reduction over axis 0 of a C-ordered array adds whole rows into the result one after another, so each
    column is summed in the C loop's order (no pairwise summation). The rows' squares go into one scratch
    buffer kept per thread: a fresh array per matmul (tens of MB at 2304-wide rows) cost more in page faults
    than the arithmetic, and made `imatrix` ~1.25x llama-imatrix's time."""
    n, cols = rows.shape[0] + 1, acc.shape[0]
    flat = getattr(_scratch, "buf", None)
    if flat is None or flat.size < n * cols:
        flat = _scratch.buf = np.empty(n * cols, np.float32)
    buf = flat[: n * cols].reshape(n, cols)
    buf[0] = acc
    np.multiply(rows, rows, out=buf[1:])
    np.add.reduce(buf, axis=0, out=acc)


def _eval_callback_type() -> Any:
    import llama_cpp

    return llama_cpp.ggml_backend_sched_eval_callback
