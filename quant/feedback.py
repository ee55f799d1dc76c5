"""Error feedback: GPTQ's column-by-column rounding for the matrices a `--budget` file holds in plain-scale types.

Why: llama.cpp rounds each block for its own importance-weighted error, and the importance matrix is only the
diagonal of H = X^T X, the covariance of the matmul's inputs on the calibration text. The error a matmul's
output carries is E H E^T with the whole of H. Rounding one input column at a time and moving what it missed
onto the columns not yet rounded (through the Cholesky factor of H^-1, as GPTQ does) cuts that error. Each
block keeps the scales llama.cpp's own quantizer chose for the (already corrected) values it covers, so the
result is a plain GGUF of the same types, sizes and layout: only the integers inside the blocks differ.

The shipped calibration text is ~5k tokens, so H's off-diagonal is noisy: a first version without shrinkage
(a whole block rounded at a time) cut the proxy error to 0.47x on the calibration text and only to 0.99x on
held-out text. Doubling H's diagonal (shrinking toward the importance matrix, which rounding already honours)
kept ~0.86x on held-out text for Q5_1 and 0.4-0.7x for Q8_0. H now also sums 10k tokens the model writes
itself (quant/selfgen.py), and with them half that shrinkage does best on both tuning texts (docs/quantize.md,
"Error feedback").

Only types whose blocks map a level index k to a*k + b (a, b per block or sub-block) can be rewritten
(`PACKERS`), and of those the ones measured to gain (`FED_BACK`); the rest are left as llama.cpp wrote them.
The matrices' inputs come from one pass of the model over the calibration text (the importance matrix's text
and chunks) and the tokens it wrote (`covariances`).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np

from edgellm.engine.memory import available_ram
from edgellm.errors import InsufficientResources, RuntimeFailure
from edgellm.gguf.layout import read_tensors
from edgellm.progress import CancelToken, Progress, ProgressCallback, no_progress
from edgellm.units import human_size
from quant._ggml import Tensor as _Tensor
from quant._ggml import ggml
from quant._imatrix_collect import Collector, _weight_name
from quant.imatrix_file import IMatrix

SHRINK = 0.5  # H's diagonal is multiplied by 1 + SHRINK (see the module docstring)
DAMP = 0.01  # plus DAMP x its mean, GPTQ's own damping, so that an unused input column stays invertible


@dataclass(frozen=True)
class Packer:
    """How one type stores its level indices: block size, bytes per block, number of levels, and the setter."""

    block: int
    size: int
    levels: int
    put: Callable[[np.ndarray, np.ndarray], None]  # (blocks uint8 (n, size), levels int (n, block)) in place


def _put_q8_0(b: np.ndarray, k: np.ndarray) -> None:
    b[:, 2:34] = (k - 128).astype(np.int8).view(np.uint8)


def _put_nibbles(off: int, high: bool) -> Callable[[np.ndarray, np.ndarray], None]:
    """Q4_0/Q4_1 (low nibbles of k[j] and k[j+16] in byte j) and Q5_0/Q5_1 (bit 4 of each k in a 32-bit qh)."""

    def put(b: np.ndarray, k: np.ndarray) -> None:
        k = k.astype(np.uint32)
        o = off
        if high:
            qh = np.zeros(len(k), np.uint32)
            for j in range(32):
                qh |= ((k[:, j] >> 4) & 1) << np.uint32(j)
            b[:, o : o + 4] = qh.astype("<u4").view(np.uint8).reshape(-1, 4)
            o += 4
        b[:, o : o + 16] = ((k[:, :16] & 15) | ((k[:, 16:] & 15) << 4)).astype(np.uint8)

    return put


def _put_q6_k(b: np.ndarray, k: np.ndarray) -> None:
    """dequantize_row_q6_K's layout: per 128 values, ql holds low nibbles of l and l+64 (l < 64), qh 2 bits of 4."""
    k = k.astype(np.uint8)
    for half in range(2):
        q = k[:, half * 128 : half * 128 + 128]
        ql = b[:, half * 64 : half * 64 + 64]
        ql[:, :32] = (q[:, 0:32] & 15) | ((q[:, 64:96] & 15) << 4)
        ql[:, 32:] = (q[:, 32:64] & 15) | ((q[:, 96:128] & 15) << 4)
        b[:, 128 + half * 32 : 128 + half * 32 + 32] = (
            (q[:, 0:32] >> 4) | ((q[:, 32:64] >> 4) << 2) | ((q[:, 64:96] >> 4) << 4) | ((q[:, 96:128] >> 4) << 6)
        )


def _put_k(qs_at: int, high: bool) -> Callable[[np.ndarray, np.ndarray], None]:
    """Q4_K (and with `high`, Q5_K): per 64 values, byte l of 32 holds value l's low nibble and value l+32's
    high one; Q5_K's qh[l] holds bit 4 of value 64c+l in bit 2c and of 64c+32+l in bit 2c+1."""

    def put(b: np.ndarray, k: np.ndarray) -> None:
        k = k.astype(np.uint8)
        qh = np.zeros((len(k), 32), np.uint8)
        for c in range(4):
            lo, hi = k[:, 64 * c : 64 * c + 32], k[:, 64 * c + 32 : 64 * c + 64]
            b[:, qs_at + 32 * c : qs_at + 32 * c + 32] = (lo & 15) | ((hi & 15) << 4)
            qh |= ((lo >> 4) & 1) << (2 * c) | ((hi >> 4) & 1) << (2 * c + 1)
        if high:
            b[:, 16:48] = qh

    return put


# ggml type id -> packer (ggml.h's enum: Q4_0 2, Q4_1 3, Q5_0 6, Q5_1 7, Q8_0 8, Q4_K 12, Q5_K 13, Q6_K 14)
PACKERS = {
    2: Packer(32, 18, 16, _put_nibbles(2, False)),
    3: Packer(32, 20, 16, _put_nibbles(4, False)),
    6: Packer(32, 22, 32, _put_nibbles(2, True)),
    7: Packer(32, 24, 32, _put_nibbles(4, True)),
    8: Packer(32, 34, 256, _put_q8_0),
    12: Packer(256, 144, 16, _put_k(16, False)),
    13: Packer(256, 176, 32, _put_k(48, True)),
    14: Packer(256, 210, 64, _put_q6_k),
}
TYPE_NAMES = {"Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}
# the types a file's matrices are fed back in. Q4_K and Q5_K are packed (and tested) but left out: on the gridless
# 135M model their 1,536-wide ffn_down made the Q4_K_M-size file worse (KLD 0.02596 -> 0.02661) and the Q5_K_M-size
# one no better (0.02175 -> 0.02170), while the types below gained at every size (docs/quantize.md, "Error feedback")
FED_BACK = frozenset({"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q6_K"})


# matrices that multiply the same input (a layer's q, k and v; its gate and up): one covariance serves them all
_SHARED_INPUT = re.compile(r"\.(attn_q|attn_k|attn_v|ffn_gate|ffn_up)\.weight$")


def input_key(name: str) -> str:
    m = _SHARED_INPUT.search(name)
    if m is None:
        return name
    return name[: m.start()] + (".attn_in" if m.group(1).startswith("attn") else ".ffn_in")


class _CovCollector(Collector):
    """The importance collector's hook, keeping X^T X for the named matrices' inputs instead of its diagonal.

    Each input is summed once, at the first of the matrices sharing it that the graph hands over (its owner):
    at 1.93B a layer's covariances take 0.4 GB instead of 1.1 GB."""

    def __init__(self, chunk_size: int, names: Iterable[str]) -> None:
        super().__init__(chunk_size, process_output=True)
        self.keys = {n: input_key(n) for n in names}
        self.owner: dict[str, str] = {}  # input key -> the matrix whose callback sums it
        self.cov: dict[str, np.ndarray] = {}  # by input key
        self.rows: dict[str, int] = {}

    def _wanted(self, t: _Tensor) -> bool:
        if t.op != self.g.mul_mat or not super()._wanted(t):
            return False
        name = _weight_name(_Tensor.from_address(t.src[0]).name)
        key = self.keys.get(name)
        return key is not None and self.owner.setdefault(key, name) == name

    def _collect(self, t: _Tensor) -> None:
        src1 = _Tensor.from_address(t.src[1])
        key = self.keys[_weight_name(_Tensor.from_address(t.src[0]).name)]
        keep: list = []
        x = self._view(src1, t.src[1], np.float32, keep)
        acc = self.cov.get(key)
        if acc is None:
            acc = self.cov[key] = np.zeros((src1.ne[0], src1.ne[0]))
        for i3 in range(src1.ne[3]):
            for i2 in range(src1.ne[2]):
                xs = np.asarray(x[i3, i2])
                acc += xs.T @ xs  # float32 products of one batch, summed over batches in float64
                self.rows[key] = self.rows.get(key, 0) + xs.shape[0]
        self._check(key, acc)

    def per_matrix(self) -> dict[str, np.ndarray]:
        by_key = {k: h / max(1, self.rows[k]) for k, h in self.cov.items()}
        return {n: by_key[k] for n, k in self.keys.items() if k in by_key}


def covariances(
    model_path: Path,
    names: Iterable[str],
    *,
    threads: Optional[int],
    on_progress: ProgressCallback,
    cancel: Optional[CancelToken],
    written: np.ndarray,
) -> dict[str, np.ndarray]:
    """H / n for each named matrix, from one pass over the shipped calibration text (the importance matrix's text and
    chunks) and `written`, the tokens the model wrote itself (quant.selfgen.generate: whole chunks of the same length)."""
    from quant.imatrix import DEFAULT_BATCH, DEFAULT_CTX, _Runner, calibration_text
    from quant.perplexity import plan_chunks

    collector = _CovCollector(DEFAULT_CTX, names)
    runner = _Runner(
        model_path, ctx=DEFAULT_CTX, batch=DEFAULT_BATCH, threads=threads, output=True, cancel=cancel, collector=collector
    )
    try:
        text = runner.tokenize(calibration_text().data)
        # the calibration text's whole chunks, then the model's own: the pass drops a partial last chunk
        whole = len(text) // DEFAULT_CTX * DEFAULT_CTX
        tokens = np.concatenate([np.asarray(text[:whole], np.int32), written])
        plan = plan_chunks(len(tokens), DEFAULT_CTX, None, DEFAULT_BATCH)
        runner.run(tokens, plan, on_progress=on_progress, cancel=cancel, task="error feedback: inputs")
    finally:
        runner.close()
    return collector.per_matrix()


def _factor(h: np.ndarray) -> np.ndarray:
    """The upper Cholesky factor U of the shrunk, damped H's inverse (GPTQ's `Hinv`: U^T U = H^-1).

    With J the order-reversing permutation and L L^T = J H J, U = J L^-1 J: one Cholesky and one triangular
    inverse instead of a full inverse and a second Cholesky, 2.8x faster on a 6144-wide input (7.9 s -> 2.9 s)."""
    h = h.copy()
    cols = len(h)
    dead = np.diag(h) <= 0
    h[dead, dead] = 1.0  # an input the calibration text never sets: nothing to feed back
    h[np.diag_indices(cols)] *= 1.0 + SHRINK
    h[np.diag_indices(cols)] += DAMP * float(np.mean(np.diag(h)))
    try:
        low = np.linalg.cholesky(h[::-1, ::-1])
    except np.linalg.LinAlgError:
        raise RuntimeFailure("error feedback: the inputs' covariance is not positive definite") from None
    return np.ascontiguousarray(_lower_inverse(low)[::-1, ::-1])


def _lower_inverse(low: np.ndarray) -> np.ndarray:
    """A lower-triangular matrix's inverse by halves (numpy has no trtri): [[A, 0], [B, C]]^-1 has
    A^-1 and C^-1 on its diagonal and -C^-1 B A^-1 below, so the work is matrix products."""
    n = len(low)
    if n <= 256:
        return np.linalg.inv(low)
    m = n // 2
    a, c = _lower_inverse(low[:m, :m]), _lower_inverse(low[m:, m:])
    out = np.zeros_like(low)
    out[:m, :m], out[m:, m:] = a, c
    out[m:, :m] = -c @ (low[m:, :m] @ a)
    return out


def feed_back(
    type_id: int,
    w: np.ndarray,
    h: np.ndarray,
    imp: Optional[np.ndarray],
    cancel: Optional[CancelToken] = None,
    factor: Optional[np.ndarray] = None,
) -> bytes:
    """`w` (rows x cols float32) in `type_id`, rounded column by column with error feedback; the row-major blocks.
    `factor`: `_factor(h)` already computed (matrices sharing an input share it)."""
    p, g = PACKERS[type_id], ggml()
    rows, cols = w.shape
    # columns as contiguous rows: the loop below reads and corrects one input column at a time
    wt = np.ascontiguousarray(np.asarray(w, np.float32).T)
    u = (_factor(h) if factor is None else factor).astype(np.float32)
    nb = cols // p.block
    out = np.empty((rows, nb * p.size), np.uint8)
    for s in range(0, cols, p.block):
        if cancel is not None:
            cancel.check()
        e, bi = s + p.block, s // p.block
        slab = np.ascontiguousarray(wt[s:e].T)
        if p.block == 32 and imp is not None:
            blocks = _legacy_blocks(type_id, slab, np.mean(np.square(wt, dtype=np.float64), axis=0), imp[s:e], p)
        else:
            sub = None if imp is None else np.ascontiguousarray(imp[s:e])
            blocks = g.quantize(type_id, slab, sub).reshape(rows, p.size)
        # each value is a*k + b for its level k: read a and b back through ggml's own to_float
        v = []
        for k in (0, 1):
            b = blocks.copy()
            p.put(b, np.full((rows, p.block), k))
            v.append(np.ascontiguousarray(g.to_float(type_id, b, (rows, p.block)).T))
        a, b0 = v[1] - v[0], v[0]
        a_safe = np.where(a == 0, 1.0, a)
        levels = np.zeros((p.block, rows), np.int64)
        err = np.zeros((p.block, rows), np.float32)
        # GPTQ's lazy updates at two levels: a column corrects the rest of its 32-column group at once, a group
        # the rest of its block, a block the rest of the row (one matmul each), so no step writes a wide outer product
        for g0 in range(s, e, 32):
            g1 = g0 + 32
            for j in range(g0, g1):
                c = j - s
                k = np.clip(np.rint((wt[j] - b0[c]) / a_safe[c]), 0, p.levels - 1)
                k[a[c] == 0] = 0
                levels[c] = k
                err[c] = (wt[j] - (a[c] * k + b0[c])) / u[j, j]
                if j + 1 < g1:
                    wt[j + 1 : g1] -= np.outer(u[j, j + 1 : g1], err[c])
            if g1 < e:
                wt[g1:e] -= u[g0:g1, g1:e].T @ err[g0 - s : g1 - s]
        if e < cols:
            wt[e:] -= u[s:e, e:].T @ err
        p.put(blocks, np.ascontiguousarray(levels.T))
        out[:, bi * p.size : (bi + 1) * p.size] = blocks
    return out.tobytes()


def _legacy_blocks(type_id: int, slab: np.ndarray, ms: np.ndarray, imp: np.ndarray, p: Packer) -> np.ndarray:
    """The block at column `s` as llama.cpp rounds it within its whole row, quantizing only a few blocks.

    With an importance matrix the 32-value types weight each value by imp * sqrt(sigma2 + x^2), sigma2 being
    twice the whole row's mean square (quantize_row_q4_0_impl and its siblings): quantizing the whole row for
    every block made a 135M file's feedback take ~4 minutes. The block is quantized beside constant filler
    blocks whose values give the short row the long row's mean square, so sigma2 is the same up to float
    rounding (on the 135M model 99.5-99.9% of the rows' blocks come out byte-identical to whole-row quantization).
    """
    rows = slab.shape[0]
    blk = slab.astype(np.float64)
    own = np.sum(blk * blk, axis=1)
    # blocks in the short row; a block holding more than 3 blocks' share of its row's energy gets no filler
    # (sigma2 then comes out larger, but x^2 dominates its weights there anyway)
    m = int(min(4, max(2, np.ceil(np.max(own / np.maximum(32 * ms, 1e-30))) + 1)))
    fill = np.sqrt(np.maximum(32 * m * ms - own, 0.0) / (32 * (m - 1)))
    short = np.empty((rows, 32 * m), np.float32)
    short[:, :32] = slab
    short[:, 32:] = fill[:, None]
    imps = np.ones(32 * m, np.float32)
    imps[:32] = imp
    return ggml().quantize(type_id, short, imps).reshape(rows, m, p.size)[:, 0].copy()


def targets(tensor_types: Iterable[tuple[str, str]], names: Iterable[str]) -> dict[str, int]:
    """The matrices (name -> type id) a recipe puts in a type of FED_BACK; first matching pattern wins."""
    pats = [(re.compile(p), t) for p, t in tensor_types]
    out = {}
    for n in names:
        for rx, t in pats:
            if rx.search(n):
                if t in FED_BACK:
                    out[n] = TYPE_NAMES[t]
                break
    return out


def rewrite(
    path: Path,
    base_path: Path,
    covs: dict[str, np.ndarray],
    imatrix: dict[str, np.ndarray],
    rounding: str,
    *,
    on_progress: ProgressCallback = no_progress,
    cancel: Optional[CancelToken] = None,
) -> list[str]:
    """Rewrite, in place, each matrix of the GGUF at `path` that has a covariance and a packer, from the values
    the base at `base_path` holds. `path` is a temp file not yet renamed into place, so a kill leaves nothing
    half-written behind."""
    # the project's own table reader: gguf-py's GGUFReader spent ~7 s per file on a 49k-token vocabulary
    base = {t.name: t for t in read_tensors(base_path).tensors}
    raw = np.memmap(base_path, np.uint8, mode="r")
    todo = [t for t in read_tensors(path).tensors if t.name in covs and t.type_id in PACKERS]
    done: list[str] = []
    factors: dict[int, np.ndarray] = {}  # by id of the covariance: q/k/v (gate/up) share one object, so one factor
    # matrices still to come per covariance: a factor is dropped after its last one, so a pass holds one or two
    # factors beside its covariances, not one per input (pass_plan counts on that)
    left = Counter(id(covs[t.name]) for t in todo)
    g = ggml()
    with open(path, "r+b") as f, g.rounding(rounding):
        for i, t in enumerate(todo):
            on_progress(Progress("error feedback", i, len(todo), "matrix", message=t.name))
            h = covs[t.name]
            left[id(h)] -= 1
            src = base.get(t.name)
            if src is None or src.type_name not in _FLOAT:
                continue  # a quantized base has no values to feed back from
            w = _floats(raw, src)
            u = factors.get(id(h))
            if u is None:
                u = factors[id(h)] = _factor(h)
            if not left[id(h)]:
                del factors[id(h)]
            data = feed_back(t.type_id, w, h, imatrix.get(t.name), cancel, u)
            if len(data) != t.n_bytes:
                raise RuntimeFailure(f"error feedback wrote {len(data)} bytes for {t.name}, not {t.n_bytes}")
            f.seek(t.data_offset)
            f.write(data)
            done.append(t.name)
    on_progress(Progress("error feedback", len(todo), len(todo), "matrix", message="done"))
    return done


_FLOAT = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16}


def _floats(raw: np.ndarray, t: Any) -> np.ndarray:
    """A float tensor of the base (a read_tensors entry over the file's bytes `raw`) as float32, rows x cols;
    BF16 is read as 16-bit words and widened."""
    shape = tuple(int(n) for n in reversed(t.shape))
    data = raw[t.data_offset : t.data_offset + t.n_bytes].view(_FLOAT[t.type_name])
    if t.type_name == "BF16":
        return (data.astype(np.uint32) << 16).view(np.float32).reshape(shape)
    return data.astype(np.float32).reshape(shape)


# RAM beside the covariances: llama.cpp's context and the rest of the process
HEADROOM = 512 << 20
# one cols x cols float64 array: a covariance's accumulator; the factorization of the widest input takes
# FACTOR_COPIES of them at once (the shrunk copy, its Cholesky factor, the inverse by halves, the reversed U)
FACTOR_COPIES = 5


def _cov_bytes(cols: int) -> int:
    return cols * cols * 8


def pass_plan(cols: dict[str, int], room: int) -> list[list[str]]:
    """The matrices (name -> input width) split into calibration passes, each measuring as many distinct inputs
    as fit in `room` bytes beside the widest one's factorization. At 1.93B a Q5_K_M-size recipe's 24 inputs take
    3.35 GB and one pass does; at 7.7B every ffn_down in Q6_K would take ~36 GB, so the pass is repeated over
    groups of layers instead (each pass costs one forward over the calibration text). Raises
    InsufficientResources if not even the widest input fits."""
    widths: dict[str, int] = {}  # input key -> width, in the file's order
    for n, c in cols.items():
        widths.setdefault(input_key(n), c)
    if not widths:
        return []
    transient = FACTOR_COPIES * _cov_bytes(max(widths.values()))
    widest = max(widths, key=lambda k: widths[k])
    if _cov_bytes(widths[widest]) + transient > room:
        raise InsufficientResources(
            f"error feedback needs {human_size(_cov_bytes(widths[widest]) + transient)} of free RAM for "
            f"the {widths[widest]}-wide inputs of {widest.removesuffix('.weight')}, and has {human_size(max(0, room))}"
        )  # the caller says what to do: a --budget job goes on without, a feedback recipe cannot
    groups: list[list[str]] = [[]]
    used = 0
    for k, c in widths.items():
        if groups[-1] and used + _cov_bytes(c) + transient > room:
            groups.append([])
            used = 0
        groups[-1].append(k)
        used += _cov_bytes(c)
    pass_of = {k: i for i, g in enumerate(groups) for k in g}
    return [[n for n in cols if pass_of[input_key(n)] == i] for i in range(len(groups))]


def plan_passes(cols: dict[str, int], free: int, base_bytes: int) -> list[list[str]]:
    """pass_plan with room beside the base's pages, so that each pass reads the mmapped base from RAM; where not
    even one input fits beside them, with all of `free`: the passes then read the base from disk again each time,
    slower but not refused."""
    try:
        return pass_plan(cols, free - base_bytes)
    except InsufficientResources:
        return pass_plan(cols, free)


def prepare(
    base_path: Path,
    tensor_types: list[tuple[str, str]],
    imatrix: IMatrix,
    rounding: str,
    *,
    model_sha256: str,
    sequences: int,
    threads: Optional[int],
    on_progress: ProgressCallback = no_progress,
    cancel: Optional[CancelToken] = None,
) -> tuple[Callable[[Path], None], dict[str, float]]:
    """Plan the passes over the calibration text for every matrix the recipe puts in a packed type (refusing now,
    before anything is quantized, if free RAM cannot hold the widest input), and return the rewrite that
    quant/quantize.py runs on the finished temp file, with its timings (seconds: "tokens" the model wrote, `sequences` of
    them (or read back: "tokens_cached" 1), "inputs", "rewrite"; "matrices", "passes", "sequences"). Each pass measures its inputs, the rewrite uses them and lets them go before the next pass, so the
    covariances and llama-quantize's own memory are never held at once."""
    import time

    widths = {t.name: int(t.shape[0]) for t in read_tensors(base_path).tensors}
    cols = {n: widths[n] for n in targets(tensor_types, widths)}
    passes = plan_passes(cols, available_ram() - HEADROOM, base_path.stat().st_size)
    imp = {n: e.normalized().astype(np.float32) for n, e in imatrix.entries.items()}
    timing = {"tokens": 0.0, "tokens_cached": 0.0, "inputs": 0.0, "rewrite": 0.0, "matrices": 0.0, "passes": float(len(passes))}
    timing["sequences"] = float(sequences if passes else 0)  # no pass writes no tokens

    def run(tmp: Path) -> None:
        from quant.selfgen import written_tokens

        if not passes:  # no matrix in a fed-back type (a Q3_K_M-size recipe can have none): nothing to measure
            return
        t0 = time.perf_counter()
        # once for every pass, and once for every job on this base
        written, cached = written_tokens(
            base_path, model_sha256, sequences, threads=threads, on_progress=on_progress, cancel=cancel
        )
        if sequences > 0:  # a model too large to write any spent no time writing them (a GC pause would read as 0.001 s)
            timing["tokens"] = round(time.perf_counter() - t0, 3)
        timing["tokens_cached"] = float(cached)
        for names in passes:
            t0 = time.perf_counter()
            covs = covariances(base_path, names, threads=threads, on_progress=on_progress, cancel=cancel, written=written)
            t1 = time.perf_counter()
            rewrite(tmp, base_path, covs, imp, rounding, on_progress=on_progress, cancel=cancel)
            timing["inputs"] = round(timing["inputs"] + t1 - t0, 3)
            timing["rewrite"] = round(timing["rewrite"] + time.perf_counter() - t1, 3)
            timing["matrices"] += len(covs)
            del covs

    return run, timing


__all__ = ["PACKERS", "covariances", "feed_back", "pass_plan", "plan_passes", "prepare", "rewrite", "targets"]
