#!/usr/bin/env python3
"""Does a base model carry structure a quantizer can exploit? Per type, against smooth data of the same scale.

    .venv/bin/python scripts/check_base_structure.py MODEL.gguf IMATRIX.gguf [--tensors blk.3.ffn_down.weight,...]

The `--budget` figures are stated on a base "with no grid": the default
model's F16 (dequantized from Q4_1) with every weight dithered by +-d/2 of
its own 32-block's step (scripts/make_wide_model.py --dither). The dither
removes the grid points, but not the blocks: each 32-value block still ends
at hard edges, its values filling 16 equal cells evenly, and a 32-block
quantizer with a min (Q4_K, Q5_K, Q4_1, Q5_1) whose scale and min land on
that block's own rounds it as well as any 16-level quantizer can. A real
model's blocks are smooth, bell-shaped, with no edges at block boundaries.

For a sample of rows of each tensor this prints, per type, the
importance-weighted squared rounding error (sum over columns of E[x^2] x the
error, the `--budget` proxy) of llama.cpp's own quantizer (ggml_quantize_chunk
with the tensor's importance entry) on the model's rows, and on a surrogate:
the same rows with each 32-block's values redrawn from a Laplace law with the
block's own mean and RMS (the scale varies across blocks as in the model;
the shape inside a block is smooth). Then a refined Q4_K rounding: the
llama.cpp blocks with each sub-block's 6-bit scale and min re-chosen among
their neighbours, and the block's F16 scales among nearby values, by the
same weighted error: what a better Q4_K quantizer gains on each kind of data.
If the model's ratios differ from the surrogate's (Q6_K no better than Q5_K,
or the refined Q4_K far ahead), the base rewards the quantizers that fit its
blocks, and figures on it do not carry to real models.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from edgellm.gguf.layout import read_tensors  # noqa: E402
from quant._ggml import ggml  # noqa: E402
from quant.budget import SAMPLE_ROWS  # noqa: E402  (the rows the --budget proxy samples)
from quant.imatrix_file import read_imatrix  # noqa: E402
from quant.recipe import TYPES  # noqa: E402

COMPARE = ("Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "Q8_0")


def q4k_fields(q: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """block_q4_K (ggml-common.h): f16 d, f16 dmin, 12 bytes of 6-bit scales and mins, 128 bytes of nibbles."""
    b = q.reshape(-1, 144)
    d = b[:, 0:2].copy().view(np.float16).astype(np.float32)[:, 0]
    dm = b[:, 2:4].copy().view(np.float16).astype(np.float32)[:, 0]
    s = b[:, 4:16].astype(np.int32)
    ls, lm = np.zeros((len(b), 8), np.int32), np.zeros((len(b), 8), np.int32)
    ls[:, :4], lm[:, :4] = s[:, 0:4] & 63, s[:, 4:8] & 63
    ls[:, 4:] = (s[:, 8:12] & 0xF) | ((s[:, 0:4] >> 6) << 4)
    lm[:, 4:] = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return d, dm, ls, lm


def sub_error(x: np.ndarray, w: np.ndarray, scale: np.ndarray, mn: np.ndarray) -> np.ndarray:
    """Weighted error of each 32-value sub-block rounded to nearest on the grid scale*l - mn, l in 0..15."""
    with np.errstate(divide="ignore", invalid="ignore"):
        lv = np.clip(np.rint((x + mn[..., None]) / scale[..., None]), 0, 15)
    lv = np.where(scale[..., None] > 0, lv, 0)
    return (w * (x - (scale[..., None] * lv - mn[..., None])) ** 2).sum(-1)


def refined_q4k_error(rows: np.ndarray, imp: np.ndarray, q: np.ndarray) -> float:
    """The weighted error after re-choosing each sub-block's scale and min (+-1) and the block's F16 d and
    dmin (+-6%), starting from llama.cpp's own block: every candidate is a valid block_q4_K."""
    d, dm, ls, lm = q4k_fields(q)
    x = rows.reshape(-1, 8, 32)
    w = np.broadcast_to(imp, rows.shape).reshape(-1, 8, 32)
    best = np.full(len(d), np.inf)
    for fd in np.linspace(0.94, 1.06, 9):
        for fm in np.linspace(0.94, 1.06, 5):
            dd = (d * fd).astype(np.float16).astype(np.float32)
            ddm = (dm * fm).astype(np.float16).astype(np.float32)
            with np.errstate(divide="ignore", invalid="ignore"):
                ls0 = np.clip(np.rint(ls * np.where(dd > 0, d / dd, 0)[:, None]), 0, 63)
                lm0 = np.clip(np.rint(lm * np.where(ddm > 0, dm / ddm, 0)[:, None]), 0, 63)
            e = np.full(ls.shape, np.inf)
            for a in (-1, 0, 1):
                for c in (-1, 0, 1):
                    sc = dd[:, None] * np.clip(ls0 + a, 0, 63)
                    mn = ddm[:, None] * np.clip(lm0 + c, 0, 63)
                    e = np.minimum(e, sub_error(x, w, sc, mn))
            best = np.minimum(best, e.sum(1))
    return float(best.sum())


def surrogate(rows: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Each 32-block redrawn from a Laplace law with the block's own mean and RMS deviation."""
    b = rows.reshape(-1, 32).astype(np.float64)
    mean, sd = b.mean(1, keepdims=True), b.std(1, keepdims=True)
    z = rng.laplace(0.0, 1.0, b.shape)
    z = (z - z.mean(1, keepdims=True)) / np.maximum(z.std(1, keepdims=True), 1e-12)
    return np.ascontiguousarray((mean + sd * z).reshape(rows.shape), np.float32)


def errors(rows: np.ndarray, imp: np.ndarray) -> dict[str, float]:
    g = ggml()
    out = {}
    for t in COMPARE:
        tid = TYPES[t][0]
        q = g.quantize(tid, rows, imp)
        back = g.to_float(tid, q, rows.shape)
        out[t] = float((np.square(rows - back, dtype=np.float64) * imp).sum())
        if t == "Q4_K":
            out["Q4_K refined"] = refined_q4k_error(rows, imp, q)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 2)[2])
    ap.add_argument("model", type=Path, help="an F16/F32 GGUF")
    ap.add_argument("imatrix", type=Path, help="its importance matrix (edgellm imatrix / llama-imatrix)")
    ap.add_argument("--tensors", default="", help="comma-separated names (default: ffn_down of 3 depths)")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    parsed = read_tensors(a.model)
    entries = read_imatrix(a.imatrix).entries
    n_layers = 1 + max(int(t.name.split(".")[1]) for t in parsed.tensors if t.name.startswith("blk."))
    names = [n for n in a.tensors.split(",") if n] or [
        f"blk.{i}.ffn_down.weight" for i in (n_layers // 10, n_layers // 2, n_layers - 2)
    ]
    raw = np.memmap(a.model, np.uint8, mode="r")
    rng = np.random.default_rng(a.seed)
    dtypes = {"F16": np.float16, "F32": np.float32}
    print("weighted rounding error, model rows / smooth surrogate; ratios to Q5_K and to llama.cpp's Q4_K")
    for t in parsed.tensors:
        if t.name not in names:
            continue
        cols, nrows = t.shape
        if cols % 256 or t.name not in entries or t.type_name not in dtypes:
            print(f"{t.name}: skipped (needs 256-multiple rows, an importance entry, F16/F32)")
            continue
        data = np.frombuffer(raw[t.data_offset : t.data_offset + t.n_bytes], dtypes[t.type_name]).reshape(nrows, cols)
        pick = np.unique(np.linspace(0, nrows - 1, min(nrows, SAMPLE_ROWS)).astype(np.int64))
        rows = np.ascontiguousarray(data[pick], np.float32)
        imp = entries[t.name].normalized().astype(np.float32).reshape(-1)[:cols]
        for label, r in (("model", rows), ("smooth", surrogate(rows, rng))):
            e = errors(r, imp)
            cells = "  ".join(f"{k} {v / e['Q5_K']:.3f}" for k, v in e.items())
            print(f"{t.name} {label:6s} (x Q5_K): {cells}   refined/llama Q4_K {e['Q4_K refined'] / e['Q4_K']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
