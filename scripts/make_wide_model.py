#!/usr/bin/env python3
"""Build a larger test model that computes the same function as a small one.

    scripts/make_wide_model.py BASE.gguf --factor 4 -o wide-x4-f16.gguf
    scripts/make_wide_model.py BASE.gguf --factor 1 --dither -o gridless-f16.gguf
    scripts/make_wide_model.py BASE.gguf --factor 4 --dither --type f16 -o gridless-x4-f16.gguf

Every figure edgellm publishes would otherwise come from one 135M model,
which on a laptop is compute-bound and cache-resident; the models users run
are 10-60x larger and bound by memory bandwidth. This widens a llama-
architecture GGUF F times so that it keeps computing the base's function:

- every hidden unit, attention head (q and kv alike) and FFN unit is copied
  F times, copy-major: unit `c*n + i` of the wide model is unit `i` of copy
  `c`, so head `c*n_head + j` reads kv head `c*n_kv + j // (n_head/n_kv)`,
  exactly the kv head its original reads (the group size is unchanged);
- a matrix that reads the copied hidden state is tiled F x F and divided by
  F: each output copy sums F identical inputs, so it gets the base's value;
- norms and the embedding are tiled (RMSNorm of F copies of a vector is F
  copies of its RMSNorm), and the output matrix is untied: `output.weight`
  = the tiled embedding / F, since the logits read the copied state too
  (at factor 1, a tied base stays tied: same tensors, same sizes).

The head size, and so RoPE and the attention scale, stay the base's. Rounding
(F16 sums in another order) is the only difference: the script checks its own
output's perplexity on two chunks of the shipped calibration text against
the base's and says so.

`--dither` first removes the base's quantization grid. The default model's
F16 is dequantized from Q4_1: every 32-value block holds at most 16 distinct
values, so any quantizer that can land on that grid looks nearly lossless.
Dither adds, to every weight, uniform noise of +-d/2 where d is the step of
its own block (the Q4_0/Q4_1/Q5_x/Q8_0 scale it was stored with), seeded per
tensor: each block's values then fill their cells evenly and no type can
reproduce the source grid. The result is a different (worse) model, but a
continuous one; its perplexity is reported beside the base's. With a factor,
the dithered model is widened, so `--factor 4 --dither` computes exactly what
`--factor 1 --dither` does (same seed), and is checked against it.

Deterministic: the same base, factor, seed and type give the same bytes.
Needs the edgellm venv (gguf, numpy, llama-cpp-python for the check).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from edgellm.errors import EdgeLLMError  # noqa: E402
from edgellm.fsutil import atomic_path, check_free_disk  # noqa: E402
from edgellm.gguf.reader import read_gguf  # noqa: E402
from quant.convert import _read_for_copy  # noqa: E402

# Tensors by the dimension they read (columns) and the one they write (rows):
# "h" the hidden state (copied), "o" an output of their own (copied units).
# matrix: tiled F x F and / F; vector: tiled F (norms, biases of copied units).
MATRICES = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
VECTORS = ("attn_norm", "ffn_norm", "output_norm", "attn_q.bias", "attn_k.bias", "attn_v.bias")
# Block types whose first two bytes are the block's f16 step d (values are d*q or d*q + m).
STEP_TYPES = {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0"}
# Hyperparameters that count copied units.
WIDE_KEYS = ("embedding_length", "feed_forward_length", "attention.head_count", "attention.head_count_kv")
CHECK_REL = 1e-3


class WidenError(EdgeLLMError):
    """A base this construction cannot widen (architecture, tensor, metadata)."""


def _kind(name: str) -> str:
    """'embd', 'output', 'matrix' or 'vector' for a tensor name; WidenError otherwise."""
    if name == "token_embd.weight":
        return "embd"
    if name == "output.weight":
        return "output"
    if name == "output_norm.weight":
        return "vector"
    parts = name.split(".")
    if len(parts) >= 4 and parts[0] == "blk":
        stem = parts[2] if parts[-1] == "weight" else f"{parts[2]}.{parts[3]}"
        if parts[-1] == "weight" and stem in MATRICES:
            return "matrix"
        if stem in VECTORS or (parts[-1] == "weight" and stem in VECTORS):
            return "vector"
    raise WidenError(f"tensor {name} is not one this construction knows how to widen (llama blocks only)")


def _dither(
    values: np.ndarray, raw: np.ndarray, type_name: str, block: int, type_size: int, rng: np.random.Generator
) -> np.ndarray:
    """values + U(-d/2, d/2) per element, d the step of the element's own block."""
    steps = raw.reshape(-1, type_size)[:, :2].copy().view(np.float16).astype(np.float32).reshape(-1)
    noise = rng.uniform(-0.5, 0.5, size=values.size).astype(np.float32)
    flat = values.reshape(-1, block) + noise.reshape(-1, block) * np.abs(steps)[:, None]
    return flat.reshape(values.shape)


def _tensor_seed(seed: int, name: str) -> int:
    # per tensor, so a tensor's noise does not depend on the order it is written in
    return (seed * 1_000_003 + zlib.crc32(name.encode())) & 0xFFFFFFFF


def _base_values(t, dither: bool, seed: int) -> np.ndarray:
    from gguf import GGML_QUANT_SIZES
    from gguf.quants import dequantize

    values = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
    if dither and len(t.shape) >= 2:
        name = t.tensor_type.name
        if name in ("F32", "F16", "BF16"):
            return values  # stored as floats: no grid to remove
        if name not in STEP_TYPES:
            raise WidenError(
                f"--dither needs the block step of {t.name}, stored as {name}: only {', '.join(sorted(STEP_TYPES))} "
                f"blocks carry it (dither a base in one of those types)"
            )
        block, type_size = GGML_QUANT_SIZES[t.tensor_type]
        values = _dither(values, t.data, name, block, type_size, np.random.default_rng(_tensor_seed(seed, t.name)))
    return values


def _widen(kind: str, values: np.ndarray, factor: int) -> np.ndarray:
    """numpy layout: rows (outputs) first, then columns (inputs)."""
    if factor == 1:
        return values
    if kind == "vector":
        return np.tile(values, factor)
    if kind == "embd":
        return np.tile(values, (1, factor))
    # matrix, output (from the embedding): every input copy contributes 1/F
    reps = (factor, factor) if kind == "matrix" else (1, factor)
    return np.tile(values, reps) / np.float32(factor)


def _target_type(ndim: int, out_type: str):
    from gguf import GGMLQuantizationType

    # as llama.cpp's converter: 1-D tensors (norms, biases) stay F32
    return GGMLQuantizationType.F32 if ndim <= 1 else GGMLQuantizationType[out_type.upper()]


def _nbytes(shape: tuple[int, ...], out_type: str) -> int:
    return int(np.prod(shape)) * (4 if len(shape) <= 1 or out_type == "f32" else 2)


def _encode(values: np.ndarray, qtype) -> np.ndarray:
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    if qtype == GGMLQuantizationType.F32:
        return values.astype(np.float32, copy=False)
    if qtype == GGMLQuantizationType.F16:
        return values.astype(np.float16)
    return quantize(values, qtype)


def _check_metadata(kvs: list, factor: int) -> str:
    arch = next((v for k, _, v, _ in kvs if k == "general.architecture"), None)
    arch = arch.decode() if isinstance(arch, bytes) else arch
    if arch != "llama":
        raise WidenError(f"only llama-architecture GGUFs can be widened; this one is {arch!r}")
    for key in WIDE_KEYS:
        found = [(v, sub) for k, _, v, sub in kvs if k == f"llama.{key}"]
        if key != "attention.head_count_kv" and not found:
            raise WidenError(f"the base has no llama.{key}")
        if found and found[0][1] is not None:
            raise WidenError(f"llama.{key} is per layer; only a uniform value can be widened")
    return arch


# long: one pass over the file read top to bottom: metadata, tensor table, the tensors one at a time
def write_wide(
    base: Path, out: Path, *, factor: int, dither: bool = False, seed: int = 0, out_type: str = "f16", log=print
) -> dict:
    """Write the widened (and optionally dithered) model to `out` atomically; return what was done."""
    from gguf import GGUFValueType, GGUFWriter, Keys

    if factor < 1:
        raise WidenError("--factor must be a whole number >= 1")
    read_gguf(base)  # validated before gguf-py sees it
    src = _read_for_copy(base)
    _check_metadata(src.kvs, factor)
    names = [t.name for t in src.tensors]
    plan = []  # (name, kind, source tensor, numpy shape of the output)
    for t in src.tensors:
        kind = _kind(t.name)
        rows, cols = (1, t.shape[0]) if len(t.shape) == 1 else (t.shape[1], t.shape[0])
        if kind == "vector":
            shape = (cols * factor,)
        elif kind == "matrix":
            shape = (rows * factor, cols * factor)
        else:
            shape = (rows, cols * factor)
        plan.append((t.name, kind, t, shape))
        if kind == "embd" and "output.weight" not in names and factor > 1:
            plan.append(("output.weight", "output", t, shape))  # untied: the logits read the copied state
    if dither and not any(len(t.shape) >= 2 and t.tensor_type.name in STEP_TYPES for t in src.tensors):
        # a float base has no block steps: nothing would be dithered, and the output would be the grid base
        # under a "dithered" name (its F16, dequantized from Q4_1, still holds the grid)
        raise WidenError(
            f"--dither needs a base whose matrices are stored in {', '.join(sorted(STEP_TYPES))} (their block "
            f"steps set the noise); {base.name} has none: pass the quantized file it was made from"
        )
    ftype = {"f32": 0, "f16": 1, "bf16": 32}[out_type]
    check_free_disk(out.parent, sum(_nbytes(s, out_type) for *_, s in plan) + (1 << 24), what=out.name)

    writer = GGUFWriter(None, arch="llama")
    writer.data_alignment = src.alignment
    for key, vtype, value, sub_type in src.kvs:
        if key == Keys.General.ARCHITECTURE:
            continue
        if key == Keys.General.FILE_TYPE:
            writer.add_uint32(key, ftype)
        elif key.startswith("llama.") and key[len("llama.") :] in WIDE_KEYS:
            writer.add_key_value(key, int(value) * factor, vtype)
        elif key == Keys.General.NAME:
            text = value.decode() if isinstance(value, bytes) else str(value)
            suffix = (f" x{factor}" if factor > 1 else "") + (" dithered" if dither else "")
            writer.add_key_value(key, text + suffix, GGUFValueType.STRING)
        elif sub_type is not None and len(value) == 0:
            continue  # GGUFWriter cannot write an empty array
        else:
            writer.add_key_value(key, value, vtype, sub_type=sub_type)
    if not any(k == Keys.General.FILE_TYPE for k, *_ in src.kvs):
        writer.add_uint32(Keys.General.FILE_TYPE, ftype)
    # provenance, read by nothing in llama.cpp: how this file was made
    writer.add_uint32("edgellm.widen.factor", factor)
    writer.add_bool("edgellm.widen.dither", dither)
    writer.add_uint32("edgellm.widen.seed", seed)
    for name, kind, t, shape in plan:
        writer.add_tensor_info(
            name, shape, np.dtype(np.float32), _nbytes(shape, out_type), raw_dtype=_target_type(len(shape), out_type)
        )

    t0 = time.perf_counter()
    with atomic_path(out) as tmp:
        try:
            writer.open_output_file(tmp)
            writer.write_header_to_file()
            writer.write_kv_data_to_file()
            writer.write_ti_data_to_file()
            cache: dict[str, np.ndarray] = {}
            for i, (name, kind, t, shape) in enumerate(plan):
                base_values = cache.pop(t.name, None)
                if base_values is None:
                    base_values = _base_values(t, dither, seed)
                if kind == "embd" and "output.weight" not in names and factor > 1:
                    cache[t.name] = base_values  # read again for the untied output
                data = _encode(_widen(kind, base_values, factor).reshape(shape), _target_type(len(shape), out_type))
                writer.write_tensor_data(data)
                if (i + 1) % 20 == 0 or i + 1 == len(plan):
                    log(f"[widen] {i + 1}/{len(plan)} tensors ({time.perf_counter() - t0:.0f} s)")
        finally:
            writer.close()
            src.close()
        info = read_gguf(tmp)
    return {
        "path": str(out),
        "factor": factor,
        "dither": dither,
        "seed": seed,
        "type": out_type,
        "parameters": info.parameters,
        "size_bytes": out.stat().st_size,
        "seconds": time.perf_counter() - t0,
    }


def ppl(path: Path, *, threads: int | None = None) -> float:
    """Perplexity on two chunks of 512 of the shipped calibration text (what the self-check compares)."""
    from quant.imatrix import calibration_path
    from quant.perplexity import Scoring, perplexity

    return perplexity(path, Scoring(text=calibration_path(), ctx=512, chunks=2, threads=threads)).ppl


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="The construction and the check are described at the top of this script.",
    )
    ap.add_argument("base", type=Path, help="a llama-architecture GGUF (the default model's Q4_1, or its F16)")
    ap.add_argument("--factor", type=int, default=2, help="how many copies of every unit (default 2)")
    ap.add_argument("--dither", action="store_true", help="first remove the base's quantization grid (+-d/2 per block)")
    ap.add_argument("--seed", type=int, default=0, help="the dither's seed (default 0)")
    ap.add_argument(
        "--type", dest="out_type", choices=("f16", "bf16", "f32"), default="f16", help="the output's type (default f16)"
    )
    ap.add_argument("-o", "--output", type=Path, required=True, help="the GGUF to write (atomically)")
    ap.add_argument("--no-check", action="store_true", help="skip the perplexity self-check")
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    try:
        if not args.base.is_file():
            raise WidenError(f"no such file: {args.base}")
        if args.factor == 1 and not args.dither:
            raise WidenError("--factor 1 without --dither would copy the base; ask for a factor or --dither")
        done = write_wide(args.base, args.output, factor=args.factor, dither=args.dither, seed=args.seed, out_type=args.out_type)
        what = f"widened x{args.factor}" + (f", dithered (seed {args.seed})" if args.dither else "")
        print(
            f"[widen] wrote {args.output}: {what}, {done['parameters'] / 1e9:.3f}B parameters, "
            f"{done['size_bytes'] / 1e9:.2f} GB {args.out_type} in {done['seconds']:.0f} s"
        )
        if args.no_check:
            return 0
        if args.factor == 1:
            got, base_ppl = ppl(args.output, threads=args.threads), ppl(args.base, threads=args.threads)
            print(
                f"[widen] dithered: PPL {got:.4f} (calibration text, 2 x 512), base {base_ppl:.4f}: a different, gridless model"
            )
            return 0
        # The reference is the base, dithered the same way, at factor 1 in the same type: a quantized base
        # runs other kernels (int8 activations for Q4_1), so only the same arithmetic can be held to 1e-3.
        with tempfile.TemporaryDirectory(dir=args.output.parent) as tmp:
            ref = Path(tmp) / "reference-x1.gguf"
            write_wide(args.base, ref, factor=1, dither=args.dither, seed=args.seed, out_type=args.out_type, log=lambda m: None)
            ref_ppl = ppl(ref, threads=args.threads)
        label = (f"the dithered base (x1, seed {args.seed}" if args.dither else "the base (x1") + f", {args.out_type})"
        got = ppl(args.output, threads=args.threads)
        rel = abs(got - ref_ppl) / ref_ppl
        ok = rel <= CHECK_REL
        print(
            f"[widen] check: PPL {got:.4f} vs {ref_ppl:.4f} of {label} (calibration text, 2 x 512): "
            f"relative difference {rel:.2e} {'<=' if ok else '>'} {CHECK_REL:g}: "
            f"{'the same function' if ok else 'NOT the same function'}"
        )
        if not ok:
            os.unlink(args.output)
            print(f"error: the widened model does not compute the base's function; {args.output} removed", file=sys.stderr)
            return 1
        return 0
    except EdgeLLMError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted; nothing was written", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
