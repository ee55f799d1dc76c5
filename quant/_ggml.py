"""The ggml functions edgellm calls through ctypes, in one place.

libggml-base is loaded from llama-cpp-python's own lib folder, so the
functions are those of the very build that loads the models. Used by the
importance-matrix collector (quant/_imatrix_collect.py: reading the tensors
the eval callback hands over) and the --budget search (quant/budget.py and
quant/sensitivity.py: llama.cpp's own quantizer, `ggml_quantize_chunk`, and
each type's `to_float` to read a quantization back).

`struct ggml_tensor` is declared as in the pinned ggml.h; `GGML()` checks its
size against `ggml_tensor_overhead()` so another build is refused instead of
misread.
"""

from __future__ import annotations

import ctypes
from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache
from typing import Optional

import numpy as np

from edgellm.errors import RuntimeFailure
from quant.rounding import base_library, set_rounding


class Tensor(ctypes.Structure):
    """struct ggml_tensor of the pinned ggml.h (checked against ggml_tensor_overhead at load)."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * 4),
        ("nb", ctypes.c_size_t * 4),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * 16),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * 10),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * 64),
        ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


class _Traits(ctypes.Structure):
    _fields_ = [
        ("type_name", ctypes.c_char_p),
        ("blck_size", ctypes.c_int64),
        ("blck_size_interleave", ctypes.c_int64),
        ("type_size", ctypes.c_size_t),
        ("is_quantized", ctypes.c_bool),
        ("to_float", ctypes.c_void_p),
        ("from_float_ref", ctypes.c_void_p),
    ]


_OBJECT_SIZE = 32  # struct ggml_object: offs, size, next, type + 4 bytes padding
_TO_FLOAT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64)
GGML_TYPE_F32, GGML_TYPE_F16 = 0, 1


class GGML:
    """libggml-base with the signatures declared; one per process (`ggml()`)."""

    def __init__(self) -> None:
        lib = base_library()
        lib.ggml_tensor_overhead.restype = ctypes.c_size_t
        lib.ggml_op_name.restype = ctypes.c_char_p
        lib.ggml_op_name.argtypes = [ctypes.c_int]
        lib.ggml_backend_buffer_is_host.restype = ctypes.c_bool
        lib.ggml_backend_buffer_is_host.argtypes = [ctypes.c_void_p]
        lib.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
        lib.ggml_backend_tensor_get.restype = None
        lib.ggml_nbytes.restype = ctypes.c_size_t
        lib.ggml_nbytes.argtypes = [ctypes.c_void_p]
        lib.ggml_quantize_chunk.restype = ctypes.c_size_t
        lib.ggml_quantize_chunk.argtypes = [
            ctypes.c_int,
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_int64,
            ctypes.c_void_p,
        ]
        lib.ggml_row_size.restype = ctypes.c_size_t
        lib.ggml_row_size.argtypes = [ctypes.c_int, ctypes.c_int64]
        lib.ggml_get_type_traits.restype = ctypes.POINTER(_Traits)
        lib.ggml_get_type_traits.argtypes = [ctypes.c_int]
        if lib.ggml_tensor_overhead() != _OBJECT_SIZE + ctypes.sizeof(Tensor):
            raise RuntimeFailure(
                "this llama.cpp build's ggml_tensor layout is not the pinned one; its tensors cannot be read safely"
            )
        ops = {lib.ggml_op_name(i).decode(): i for i in range(48)}
        self.lib = lib
        self.mul_mat, self.mul_mat_id, self.get_rows = ops["MUL_MAT"], ops["MUL_MAT_ID"], ops["GET_ROWS"]

    def row_size(self, type_id: int, cols: int) -> int:
        return int(self.lib.ggml_row_size(type_id, cols))

    def quantize(self, type_id: int, rows: np.ndarray, imatrix: Optional[np.ndarray]) -> np.ndarray:
        """`rows` (float32, C-contiguous, n x cols) in `type_id`, as llama_model_quantize rounds them
        (ggml_quantize_chunk with the tensor's importance entry, or none)."""
        n, cols = rows.shape
        dst = np.empty(self.row_size(type_id, cols) * n, np.uint8)
        self.lib.ggml_quantize_chunk(
            type_id, rows.ctypes.data, dst.ctypes.data, 0, n, cols, imatrix.ctypes.data if imatrix is not None else None
        )
        return dst

    @contextmanager
    def rounding(self, rounding: str) -> Iterator[None]:
        """Quantize as `rounding` says inside the block (process-wide: every thread rounds alike)."""
        was = set_rounding(self.lib, rounding)
        try:
            yield
        finally:
            set_rounding(self.lib, was)

    def to_float(self, type_id: int, data: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
        """`data` (a quantized block array of `shape` values) read back as float32, with ggml's own to_float."""
        out = np.empty(shape, np.float32)
        _TO_FLOAT(self.lib.ggml_get_type_traits(type_id).contents.to_float)(data.ctypes.data, out.ctypes.data, out.size)
        return out


@lru_cache(maxsize=1)
def ggml() -> GGML:
    return GGML()
