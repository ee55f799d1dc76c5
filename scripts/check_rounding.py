#!/usr/bin/env python3
"""How much importance-weighted error each refined rounding removes, and what it costs, matrix by matrix.

For each named matrix of an F16/F32 GGUF, 512 of its rows (spread as --budget samples them) are rounded
by llama.cpp's own quantizer (`ggml_quantize_chunk` with the matrix's importance entry) in Q4_K, Q5_K and
IQ4_XS, once per rounding of quant/rounding.py (stock, refined-k1, refined-k2, ...), and read back with
ggml's `to_float`. Printed: the weighted error sum over columns of E[x_c^2] x (w - q(w))^2 as a ratio to
the stock rounding's, and the seconds each rounding took on this machine (one thread).

    .venv/bin/python scripts/check_rounding.py gl4-f16.gguf gl4-f16-imatrix.gguf blk.15.ffn_down.weight ...

The model's matrix widths must be multiples of 256 for these types (the x4 widened model's are).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from edgellm.gguf.layout import read_tensors  # noqa: E402
from quant import rounding  # noqa: E402
from quant._ggml import ggml  # noqa: E402
from quant.imatrix_file import read_imatrix  # noqa: E402
from quant.recipe import TYPES  # noqa: E402

KINDS = ("Q4_K", "Q5_K", "IQ4_XS")
ROWS = 512


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path, help="an F16/F32 GGUF")
    ap.add_argument("imatrix", type=Path, help="its importance matrix (GGUF, as edgellm imatrix writes it)")
    ap.add_argument("tensors", nargs="+", help="matrix names, e.g. blk.15.ffn_down.weight")
    args = ap.parse_args()
    g, im = ggml(), read_imatrix(args.imatrix)
    raw = np.memmap(args.model, np.uint8, mode="r")
    tensors = {t.name: t for t in read_tensors(args.model).tensors}
    dtypes = {"F16": np.float16, "F32": np.float32}
    for name in args.tensors:
        t = tensors.get(name)
        if t is None or t.type_name not in dtypes or name not in im.entries:
            print(f"{name}: not an F16/F32 matrix with an importance entry; skipped")
            continue
        cols, rows = t.shape
        data = np.frombuffer(raw[t.data_offset : t.data_offset + t.n_bytes], dtypes[t.type_name]).reshape(rows, cols)
        pick = np.unique(np.linspace(0, rows - 1, min(rows, ROWS)).astype(np.int64))
        src = np.ascontiguousarray(data[pick], np.float32)
        imp = im.entries[name].normalized().astype(np.float32)
        parts = [name]
        for kind in KINDS:
            tid, blk = TYPES[kind]
            if cols % blk:
                continue
            err, secs = {}, {}
            for r in rounding.ROUNDINGS:
                with g.rounding(r):
                    t0 = time.perf_counter()
                    q = g.quantize(tid, src, imp)
                    secs[r] = time.perf_counter() - t0
                back = g.to_float(tid, q, src.shape)
                err[r] = float((np.square(src - back, dtype=np.float64) * imp).sum())
            base = err[rounding.STOCK]
            ratios = " ".join(f"{r or 'stock'} {err[r] / base:.3f}" for r in rounding.ROUNDINGS)
            times = "/".join(f"{secs[r]:.2f}" for r in rounding.ROUNDINGS)
            parts.append(f"{kind}: {ratios} ({times} s)")
        print(" | ".join(parts), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
