"""A row's product with the weights does not depend on the rows beside it (issue #26, lossless drafts).

At temperature 0 a reply with `--draft` is the reply without only if a token decoded
alone and the same token in a verify batch (or beside other sequences) get the very
same logits. Stock ggml breaks that twice on the K-quants users run (Q4_K_M is Q4_K
and Q6_K): the tiled K-quant matmul takes batches of 8+ rows and sums in another order
than the one-row kernel, and on CPUs that repack Q4_K the one-row kernel summed each
super block in integers first while the 4-row one sums every pair of sub blocks in
float. scripts/patches/ggml-cpu-matmul-batch-invariant.patch adds one switch for both
(the tiled floor moves to FA_TILE rows; the one-row kernel sums as the 4-row one), which
every edgellm runtime turns on and llama.cpp's tools leave off. These tests drive the
real libggml-cpu of this build through its C API: a graph of one MUL_MAT, and the
exported repack kernels.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from edgellm.engine import backends
from edgellm.engine.speculative import FA_TILE

GGML_TYPE_F32, GGML_TYPE_Q4_1, GGML_TYPE_Q8_0, GGML_TYPE_Q4_K, GGML_TYPE_Q6_K = 0, 3, 8, 12, 14


class _InitParams(ctypes.Structure):
    _fields_ = [("mem_size", ctypes.c_size_t), ("mem_buffer", ctypes.c_void_p), ("no_alloc", ctypes.c_bool)]


@pytest.fixture(scope="module")
def ggml() -> Iterator[tuple[ctypes.CDLL, ctypes.CDLL]]:
    yield _loaded()


def _loaded() -> tuple[ctypes.CDLL, ctypes.CDLL]:
    lib = backends.lib_dir()
    assert lib is not None and (lib / "libggml-cpu.so").exists(), "the host-flags build is what the suite runs on"
    base, cpu = backends._load_lib(lib, "libggml-base.so"), backends._load_lib(lib, "libggml-cpu.so")
    vp = ctypes.c_void_p
    base.ggml_init.restype, base.ggml_init.argtypes = vp, [_InitParams]
    base.ggml_new_tensor_2d.restype = vp
    base.ggml_new_tensor_2d.argtypes = [vp, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
    base.ggml_mul_mat.restype, base.ggml_mul_mat.argtypes = vp, [vp, vp, vp]
    base.ggml_new_graph.restype, base.ggml_new_graph.argtypes = vp, [vp]
    base.ggml_build_forward_expand.argtypes = [vp, vp]
    base.ggml_get_data.restype, base.ggml_get_data.argtypes = vp, [vp]
    base.ggml_free.argtypes = [vp]
    base.ggml_quantize_chunk.restype = ctypes.c_size_t
    base.ggml_quantize_chunk.argtypes = [ctypes.c_int, vp, vp, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, vp]
    cpu.ggml_graph_compute_with_ctx.argtypes = [vp, vp, ctypes.c_int]
    assert backends.keep_batch_invariant(FA_TILE), "this build lacks scripts/patches"
    return base, cpu


def _set_small_batch_invariant(rows: int) -> None:
    fn = backends.cpu_proc("ggml_backend_cpu_set_small_batch_invariant")
    assert fn
    ctypes.CFUNCTYPE(None, ctypes.c_int64)(fn)(rows)


def _matmul(ggml, typ: int, weights: np.ndarray, x: np.ndarray) -> np.ndarray:
    """weights (M, K) quantized to `typ` by ggml, times the rows of x (n, K), on 2 threads: (n, M)."""
    base, cpu = ggml
    m, k = weights.shape
    n = x.shape[0]
    ctx = base.ggml_init(_InitParams(1 << 27, None, False))
    try:
        w = base.ggml_new_tensor_2d(ctx, typ, k, m)
        base.ggml_quantize_chunk(typ, weights.ctypes.data, base.ggml_get_data(w), 0, m, k, None)
        t = base.ggml_new_tensor_2d(ctx, GGML_TYPE_F32, k, n)
        ctypes.memmove(base.ggml_get_data(t), np.ascontiguousarray(x, dtype=np.float32).ctypes.data, 4 * k * n)
        y = base.ggml_mul_mat(ctx, w, t)
        graph = base.ggml_new_graph(ctx)
        base.ggml_build_forward_expand(graph, y)
        cpu.ggml_graph_compute_with_ctx(ctx, graph, 2)
        return np.ctypeslib.as_array((ctypes.c_float * (m * n)).from_address(base.ggml_get_data(y))).reshape(n, m).copy()
    finally:
        base.ggml_free(ctx)


@pytest.mark.parametrize(
    "typ",
    [GGML_TYPE_Q6_K, GGML_TYPE_Q4_K, GGML_TYPE_Q4_1, GGML_TYPE_Q8_0],
    ids=["q6_K", "q4_K", "q4_1 (the default model)", "q8_0 (a draft model's target)"],
)
def test_a_quantized_row_in_a_verify_batch_multiplies_as_it_does_alone(ggml, typ):
    # the shapes of the 1.93B widened model's attn_v and ffn_down (issue #24). Q6_K and Q4_1 rows
    # of a batch go through one kernel per weight row for up to 16 tokens
    # (scripts/patches/ggml-cpu-x86-small-batch-dots.patch): the first and the last row of a batch
    # are each checked against the same token alone. Q8_0's 5-7 tokens go through one pass over each
    # block of 4 weight rows (scripts/patches/ggml-cpu-x86-q0-gemm-one-pass.patch), 4 columns and a rest
    rng = np.random.default_rng(7)
    for m, k in ((768, 2304), (2304, 6144)):
        weights = rng.normal(0, 0.02, (m, k)).astype(np.float32)
        x = rng.normal(0, 1, (FA_TILE - 1, k)).astype(np.float32)
        first = _matmul(ggml, typ, weights, x[:1])[0]
        for n in (2, 4, 5, 7, 8, 16, 17, FA_TILE - 1):
            batch = _matmul(ggml, typ, weights, x[:n])
            last = _matmul(ggml, typ, weights, x[n - 1 : n])[0]
            for alone, row in ((first, batch[0]), (last, batch[-1])):
                assert np.array_equal(alone, row), (m, k, n, float(np.abs(alone - row).max()))


def test_the_stock_floor_of_8_rows_is_what_broke_it(ggml):
    # the same product with ggml's own behaviour back (what llama.cpp's tools run): 8 rows take
    # the tiled kernel and row 0 moves
    rng = np.random.default_rng(7)
    weights = rng.normal(0, 0.02, (768, 2304)).astype(np.float32)
    x = rng.normal(0, 1, (8, 2304)).astype(np.float32)
    alone = _matmul(ggml, GGML_TYPE_Q6_K, weights, x[:1])[0]
    try:
        _set_small_batch_invariant(0)
        row = _matmul(ggml, GGML_TYPE_Q6_K, weights, x)[0]
    finally:
        _set_small_batch_invariant(FA_TILE)
    assert not np.array_equal(alone, row)
    assert np.allclose(alone, row, rtol=1e-4, atol=1e-4)  # the same product, rounded otherwise


def _q4_k_x8(rng: np.random.Generator, n_blocks: int, n_groups: int) -> bytes:
    # block_q4_Kx8, the repacked layout: 8 d (f16), 8 dmin (f16), 96 bytes of scales, 1024 of quants
    out = bytearray()
    for _ in range(n_groups * n_blocks):
        out += np.abs(rng.normal(0, 0.01, 16)).astype(np.float16).tobytes()
        out += rng.integers(0, 256, 96 + 1024, dtype=np.uint8).tobytes()
    return bytes(out)


def _repacked_q4_k(cpu: ctypes.CDLL, rows: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """Rows of a product through the repacked Q4_K kernels: (each row alone by the gemv, the rows by the gemm)."""
    vp = ctypes.c_void_p
    for name in ("ggml_gemv_q4_K_8x8_q8_K", "ggml_gemm_q4_K_8x8_q8_K"):
        getattr(cpu, name).argtypes = [ctypes.c_int, vp, ctypes.c_size_t, vp, vp, ctypes.c_int, ctypes.c_int]
    cpu.quantize_row_q8_K.argtypes = [vp, vp, ctypes.c_int64]
    cpu.ggml_quantize_mat_q8_K_4x8.argtypes = [vp, vp, ctypes.c_int64]
    rng = np.random.default_rng(3)
    n_blocks, cols = 9, 64  # 2304 inputs, as the 1.93B model's hidden size
    k = 256 * n_blocks
    weights = ctypes.create_string_buffer(_q4_k_x8(rng, n_blocks, cols // 8))
    x = rng.normal(0, 1, (rows, k)).astype(np.float32)
    packed = ctypes.create_string_buffer(1168 * n_blocks * rows // 4)  # block_q8_Kx4 per 4 rows
    for g in range(rows // 4):
        cpu.ggml_quantize_mat_q8_K_4x8(x[4 * g :].ctypes.data, ctypes.byref(packed, 1168 * n_blocks * g), k)
    batch = np.zeros((rows, cols), np.float32)
    cpu.ggml_gemm_q4_K_8x8_q8_K(k, batch.ctypes.data, cols, weights, packed, rows, cols)
    alone = np.zeros((rows, cols), np.float32)
    for r in range(rows):
        q = ctypes.create_string_buffer(292 * n_blocks)  # block_q8_K
        cpu.quantize_row_q8_K(x[r].ctypes.data, q, k)
        cpu.ggml_gemv_q4_K_8x8_q8_K(k, alone[r].ctypes.data, cols, weights, q, 1, cols)
    return alone, batch


@pytest.mark.parametrize("rows", [4, 8, 12, 16, 28])
def test_the_repacked_q4_k_one_row_kernel_sums_as_the_four_row_one(ggml, rows):
    # the kernels llama.cpp runs for the Q4_K weights it repacks (x86 with AVX2): a verify batch
    # of 4+ rows takes the gemm, a lone token the gemv. With AVX-512 the gemm has a loop per
    # 4 rows and one per 8, 12 or 16 (scripts/patches/ggml-cpu-x86-q4k-gemm-row-groups.patch);
    # 28 rows take the 16- and the 12-row ones
    _base, cpu = ggml
    alone, batch = _repacked_q4_k(cpu, rows)
    assert np.array_equal(alone, batch), float(np.abs(alone - batch).max())


def test_ggmls_own_one_row_kernel_rounds_otherwise(ggml):
    _base, cpu = ggml
    _alone, batch = _repacked_q4_k(cpu)
    try:
        _set_small_batch_invariant(0)  # ggml's own gemv: the same products, rounded otherwise
        stock, _ = _repacked_q4_k(cpu)
    finally:
        _set_small_batch_invariant(FA_TILE)
    assert not np.array_equal(stock, batch) and np.allclose(stock, batch, rtol=1e-4, atol=1e-3)


def _kernel_outputs(ggml) -> str:
    """A digest of what generation's one-row kernels give: the repacked Q4_K gemv summing both ways
    (edgellm's and llama.cpp's tools'), and Q6_K's and Q8_0's row products at the 1.93B model's shapes."""
    _base, cpu = ggml
    h = hashlib.sha256()
    h.update(_repacked_q4_k(cpu)[0].tobytes())
    try:
        _set_small_batch_invariant(0)
        h.update(_repacked_q4_k(cpu)[0].tobytes())
    finally:
        _set_small_batch_invariant(FA_TILE)
    rng = np.random.default_rng(11)
    for typ in (GGML_TYPE_Q6_K, GGML_TYPE_Q8_0):
        for m, k in ((768, 2304), (2304, 6144)):
            weights = rng.normal(0, 0.02, (m, k)).astype(np.float32)
            h.update(_matmul(ggml, typ, weights, rng.normal(0, 1, (1, k)).astype(np.float32)).tobytes())
    return h.hexdigest()


def test_the_faster_one_row_kernels_give_the_stock_kernels_bytes(ggml):
    # scripts/patches/ggml-cpu-token-kernels.patch: one token's Q4_K (repacked, AVX-512 VNNI) and Q6_K
    # (AVX-512) products, and software prefetch in those and Q8_0's, 1.3x the tokens/s on Intel cores
    # (docs/scale.md). They must round exactly as the stock loops, or a reply would change with the
    # CPU. GGML_CPU_STOCK_GEMV=1 runs the stock loops; the kernels read it once per process, hence the
    # child. (On a CPU without AVX-512 only the prefetch differs.)
    mine = _kernel_outputs(ggml)
    code = "import sys; sys.path.insert(0, sys.argv[1]); import test_batch_invariance as t; print(t._kernel_outputs(t._loaded()))"
    child = subprocess.run(
        [sys.executable, "-c", code, str(Path(__file__).parent)],
        env={**os.environ, "GGML_CPU_STOCK_GEMV": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.strip() == mine


# -- attention: one query row over the cached cells ---------------------------------------------------

GGML_TYPE_F16 = 1


def _attention(ggml, q: np.ndarray, k: np.ndarray, v: np.ndarray, mask: np.ndarray, scale: float) -> np.ndarray:
    """ggml's FLASH_ATTN_EXT on 2 threads: q (n, H, D) f32, k and v (n_kv, Hkv, D) stored as f16, mask (n, n_kv)
    of 0 and -inf; returns (n, H, D)."""
    base, cpu = ggml
    vp = ctypes.c_void_p
    base.ggml_new_tensor_3d.restype = vp
    base.ggml_new_tensor_3d.argtypes = [vp, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64]
    base.ggml_flash_attn_ext.restype = vp
    base.ggml_flash_attn_ext.argtypes = [vp, vp, vp, vp, vp, ctypes.c_float, ctypes.c_float, ctypes.c_float]
    n, heads, d = q.shape
    n_kv, heads_kv, _ = k.shape
    ctx = base.ggml_init(_InitParams(1 << 27, None, False))
    try:

        def tensor(typ, arr, *ne):
            t = base.ggml_new_tensor_3d(ctx, typ, *ne) if len(ne) == 3 else base.ggml_new_tensor_2d(ctx, typ, *ne)
            a = np.ascontiguousarray(arr)
            ctypes.memmove(base.ggml_get_data(t), a.ctypes.data, a.nbytes)
            return t

        tq = tensor(GGML_TYPE_F32, q.transpose(1, 0, 2).astype(np.float32), d, n, heads)
        tk = tensor(GGML_TYPE_F16, k.transpose(1, 0, 2).astype(np.float16), d, n_kv, heads_kv)
        tv = tensor(GGML_TYPE_F16, v.transpose(1, 0, 2).astype(np.float16), d, n_kv, heads_kv)
        tm = tensor(GGML_TYPE_F16, mask.astype(np.float16), n_kv, n)
        y = base.ggml_flash_attn_ext(ctx, tq, tk, tv, tm, scale, 0.0, 0.0)
        graph = base.ggml_new_graph(ctx)
        base.ggml_build_forward_expand(graph, y)
        cpu.ggml_graph_compute_with_ctx(ctx, graph, 2)
        out = (ctypes.c_float * (n * heads * d)).from_address(base.ggml_get_data(y))
        return np.ctypeslib.as_array(out).reshape(n, heads, d).copy()
    finally:
        base.ggml_free(ctx)


def _cells(rng: np.random.Generator, n_kv: int, heads_kv: int = 3, d: int = 64) -> tuple[np.ndarray, np.ndarray]:
    return rng.normal(0, 1, (n_kv, heads_kv, d)).astype(np.float16), rng.normal(0, 1, (n_kv, heads_kv, d)).astype(np.float16)


def test_a_query_row_attends_alone_as_in_a_batch_whatever_the_masked_cells_hold(ggml):
    # scripts/patches/ggml-cpu-x86-fa-rows.patch: a row takes its cells in blocks of 16 from the
    # first; the 8 rows of a verify step (causal) against each row alone over the cells it sees,
    # and alone again with 100 more cells past them, masked and holding NaN (a KV stream's unused
    # cells hold whatever was there)
    rng = np.random.default_rng(5)
    n_kv, n = 757, 8
    k, v = _cells(rng, n_kv)
    q = rng.normal(0, 1, (n, 9, 64)).astype(np.float32)
    seen = n_kv - n + 1 + np.arange(n)  # row i sees cells [0, seen[i])
    mask = np.where(np.arange(n_kv)[None, :] < seen[:, None], 0.0, -np.inf)
    batch = _attention(ggml, q, k, v, mask, 0.125)
    junk = np.full((100, 3, 64), np.nan, dtype=np.float16)
    for i in range(n):
        alone = _attention(ggml, q[i : i + 1], k, v, mask[i : i + 1], 0.125)[0]
        assert np.array_equal(alone, batch[i]), (i, float(np.abs(alone - batch[i]).max()))
        longer = _attention(
            ggml,
            q[i : i + 1],
            np.concatenate([k, junk]),
            np.concatenate([v, junk]),
            np.concatenate([mask[i : i + 1], np.full((1, 100), -np.inf)], axis=1),
            0.125,
        )[0]
        assert np.array_equal(longer, alone), i


def test_a_query_rows_attention_is_the_exact_softmax_to_f32_rounding(ggml):
    # against float64 over the same f16 cells. The stock loop summed V in f16 (about 1e-3 off at
    # these sizes), the patched one in f32
    rng = np.random.default_rng(6)
    for n_kv in (1, 15, 16, 17, 300, 1500):
        k, v = _cells(rng, n_kv)
        q = rng.normal(0, 1, (3, 9, 64)).astype(np.float32)
        mask = np.zeros((3, n_kv))
        mask[1, 1::3] = -np.inf  # every third cell hidden from row 1
        got = _attention(ggml, q, k, v, mask, 0.125)
        for i in range(3):
            for h in range(9):
                kk, vv = k[:, h // 3].astype(np.float64), v[:, h // 3].astype(np.float64)
                s = kk @ q[i, h].astype(np.float64) * 0.125 + mask[i]
                p = np.exp(s - s.max())
                want = (p @ vv) / p.sum()
                assert np.abs(got[i, h] - want).max() < 2e-5, (n_kv, i, h, float(np.abs(got[i, h] - want).max()))
