"""The quantization levels (llama.cpp file types) edgellm can produce.

One table, copied from llama.cpp's own list (`QUANT_OPTIONS` in
tools/quantize/quantize.cpp of the vendored tree): the name llama-quantize
accepts, its LLAMA_FTYPE number, the ggml type most tensors get, whether it
needs an importance matrix, and a nominal bits-per-weight for estimates.

Which levels need an importance matrix follows llama.cpp's
`tensor_requires_imatrix()` (src/llama-quant.cpp): a file type needs one when
any tensor it produces is IQ1_S, IQ1_M, IQ2_XXS, IQ2_XS, IQ2_S or IQ3_XXS, or
is Q2_K inside a Q2_K_S file. IQ2_M (IQ2_S tensors), IQ3_XS (IQ3_XXS for
attn_q/attn_k/ffn_up/ffn_gate) and IQ3_XXS therefore need one too; IQ3_S,
IQ3_M, IQ4_NL and IQ4_XS do not. edgellm does not compute importance
matrices, so those levels are refused up front with that reason instead of
letting llama.cpp fail half-way.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

from edgellm.engine.memory import DEFAULT_CTX, MemoryEstimate, estimate, shape_from_size
from edgellm.errors import QuantizeError, UsageError
from edgellm.gguf.reader import GGUFInfo, gguf_constants
from quant._common import FLOAT_LEVELS

log = logging.getLogger(__name__)

# ggml block size of the K-quants and most i-quants: rows must be a multiple.
QK_K = 256


@dataclass(frozen=True)
class Level:
    """One llama.cpp file type."""

    name: str  # llama.cpp's spelling: "Q4_K_M"
    ftype: int  # LLAMA_FTYPE_* number written to general.file_type
    base_type: str  # ggml type of the bulk of the tensors: "Q4_K"
    bpw: float  # nominal bits/weight of a whole file (llama.cpp's figures for mixes)
    needs_imatrix: bool = False
    description: str = ""

    @property
    def key(self) -> str:
        """The lowercase form used in store names and `ModelRecord.level`."""
        return self.name.lower()

    @property
    def is_float(self) -> bool:
        return self.name in ("F32", "F16", "BF16")

    @property
    def block_size(self) -> int:
        """ggml block size of `base_type` (rows must be a multiple of it)."""
        c = gguf_constants()

        try:
            return c.GGML_QUANT_SIZES[c.GGMLQuantizationType[self.base_type]][0]
        except KeyError:
            return QK_K

    @property
    def readable(self) -> bool:
        """Whether the installed gguf-py knows the tensor type, so the output
        can be validated before anything loads it."""
        return self.base_type in gguf_constants().GGMLQuantizationType.__members__

    def to_json(self) -> dict:
        return {
            "level": self.key,
            "name": self.name,
            "ftype": self.ftype,
            "base_type": self.base_type,
            "bpw": self.bpw,
            "needs_imatrix": self.needs_imatrix,
            "description": self.description,
        }


# In llama-quantize's order. bpw: block bits for single-type levels; for the
# K/i-quant mixes, the bits/weight llama.cpp's README measured on Llama-3.1-8B.
LEVELS: tuple[Level, ...] = (
    Level("Q1_0", 40, "Q1_0", 1.125, False, "1.125 bpw quantization"),
    Level("Q2_0", 41, "Q2_0", 2.25, False, "2.25 bpw quantization (group 64)"),
    Level("Q4_0", 2, "Q4_0", 4.5, False, "4-bit, 32-block, scale only"),
    Level("Q4_1", 3, "Q4_1", 5.0, False, "4-bit, 32-block, scale and min"),
    Level("MXFP4_MOE", 38, "MXFP4", 4.25, False, "MXFP4 for MoE expert tensors, Q8_0 elsewhere"),
    Level("Q5_0", 8, "Q5_0", 5.5, False, "5-bit, 32-block, scale only"),
    Level("Q5_1", 9, "Q5_1", 6.0, False, "5-bit, 32-block, scale and min"),
    Level("IQ2_XXS", 19, "IQ2_XXS", 2.3824, True, "2.06 bpw i-quant"),
    Level("IQ2_XS", 20, "IQ2_XS", 2.5882, True, "2.31 bpw i-quant"),
    Level("IQ2_S", 28, "IQ2_XS", 2.7403, True, "2.5 bpw i-quant"),
    Level("IQ2_M", 29, "IQ2_S", 2.9294, True, "2.7 bpw i-quant"),
    Level("IQ1_S", 24, "IQ1_S", 2.0042, True, "1.56 bpw i-quant"),
    Level("IQ1_M", 31, "IQ1_M", 2.1460, True, "1.75 bpw i-quant"),
    Level("TQ1_0", 36, "TQ1_0", 1.6875, False, "1.69 bpw ternarization"),
    Level("TQ2_0", 37, "TQ2_0", 2.0625, False, "2.06 bpw ternarization"),
    Level("Q2_K", 10, "Q2_K", 3.1593, False, "2-bit K-quant mix"),
    Level("Q2_K_S", 21, "Q2_K", 2.9697, True, "2-bit K-quant, small"),
    Level("IQ3_XXS", 23, "IQ3_XXS", 3.2548, True, "3.06 bpw i-quant"),
    Level("IQ3_S", 26, "IQ3_S", 3.6606, False, "3.44 bpw i-quant"),
    Level("IQ3_M", 27, "IQ3_S", 3.7628, False, "3.66 bpw i-quant mix"),
    Level("IQ3_XS", 22, "IQ3_S", 3.4977, True, "3.3 bpw i-quant"),
    Level("Q3_K_S", 11, "Q3_K", 3.6429, False, "3-bit K-quant, small"),
    Level("Q3_K_M", 12, "Q3_K", 3.9960, False, "3-bit K-quant, medium"),
    Level("Q3_K_L", 13, "Q3_K", 4.2979, False, "3-bit K-quant, large"),
    Level("IQ4_NL", 25, "IQ4_NL", 4.6818, False, "4.5 bpw non-linear quantization"),
    Level("IQ4_XS", 30, "IQ4_XS", 4.4597, False, "4.25 bpw non-linear quantization"),
    Level("Q4_K_S", 14, "Q4_K", 4.6672, False, "4-bit K-quant, small"),
    Level("Q4_K_M", 15, "Q4_K", 4.8944, False, "4-bit K-quant, medium (the usual choice)"),
    Level("Q5_K_S", 16, "Q5_K", 5.5704, False, "5-bit K-quant, small"),
    Level("Q5_K_M", 17, "Q5_K", 5.7036, False, "5-bit K-quant, medium"),
    Level("Q6_K", 18, "Q6_K", 6.5633, False, "6-bit K-quant"),
    Level("Q8_0", 7, "Q8_0", 8.5, False, "8-bit, 32-block"),
    Level("F16", 1, "F16", 16.0, False, "16-bit float"),
    Level("BF16", 32, "BF16", 16.0, False, "16-bit bfloat"),
    Level("F32", 0, "F32", 32.0, False, "32-bit float"),
)

# llama-quantize's aliases
ALIASES = {"Q3_K": "Q3_K_M", "Q4_K": "Q4_K_M", "Q5_K": "Q5_K_M"}

_BY_NAME = {lv.name: lv for lv in LEVELS}
_BY_FTYPE = {lv.ftype: lv for lv in LEVELS}

# What llama.cpp stores instead when a tensor's rows are not a multiple of the
# type's block (`tensor_type_fallback()` in src/llama-quant.cpp).
FALLBACK = {
    "IQ1_S": "IQ4_NL",
    "IQ1_M": "IQ4_NL",
    "IQ2_XXS": "IQ4_NL",
    "IQ2_XS": "IQ4_NL",
    "IQ2_S": "IQ4_NL",
    "IQ3_XXS": "IQ4_NL",
    "IQ3_S": "IQ4_NL",
    "IQ4_XS": "IQ4_NL",
    "Q2_0": "Q4_0",
    "Q2_K": "Q4_0",
    "Q3_K": "Q4_0",
    "TQ1_0": "Q4_0",
    "TQ2_0": "Q4_0",
    "Q4_K": "Q5_0",
    "Q5_K": "Q5_1",
    "Q6_K": "Q8_0",
}


def all_levels(*, usable_only: bool = False) -> list[Level]:
    """Every level llama.cpp offers; `usable_only` drops the ones edgellm refuses."""
    return [lv for lv in LEVELS if not usable_only or (not lv.needs_imatrix and lv.readable)]


def parse_level(text: str) -> Level:
    """ "q4_k_m", "Q4_K_M", "q4_k" (alias) or "15" (the ftype number) → Level.

    Raises `UsageError` naming the accepted levels.
    """
    raw = str(text).strip()
    up = raw.upper().replace("-", "_")
    up = ALIASES.get(up, up)
    if up in _BY_NAME:
        return _BY_NAME[up]
    if up.isdigit() and int(up) in _BY_FTYPE:
        return _BY_FTYPE[int(up)]
    names = ", ".join(lv.key for lv in LEVELS)
    raise UsageError(f"unknown level {raw!r}; llama.cpp's levels are: {names}")


def level_for_ftype(ftype: Optional[int]) -> Optional[Level]:
    return _BY_FTYPE.get(ftype) if ftype is not None else None


def type_id_block(name: str) -> tuple[int, int]:
    """ggml's id of a tensor type and its block width ("Q5_0" → (6, 32)): gguf-py's tables, which follow the pinned ggml.h."""
    c = gguf_constants()
    t = c.GGMLQuantizationType[name]
    return int(t), c.GGML_QUANT_SIZES[t][0]


def type_bpw(ggml_type: str) -> float:
    """Bits per weight of one ggml tensor type ("Q5_0" → 5.5)."""
    c = gguf_constants()

    try:
        block, size = c.GGML_QUANT_SIZES[c.GGMLQuantizationType[ggml_type.upper()]]
    except KeyError:
        return 32.0
    return size * 8 / block


__all__ = [
    "Level",
    "LEVELS",
    "ALIASES",
    "FALLBACK",
    "QK_K",
    "all_levels",
    "parse_level",
    "level_for_ftype",
    "type_bpw",
    "type_id_block",
    "level_estimate",
    "is_quantized",
    "check_levels",
    "estimate_size",
]


def level_estimate(parameters: int, level: str, *, ctx: int = DEFAULT_CTX) -> MemoryEstimate:
    """Memory of a model known only by parameters and level (a catalog entry
    not downloaded yet): the level's nominal bits per weight, then the core's
    one estimate. `models list` and the TUI's fit marks both use this."""
    try:
        bpw = parse_level(level).bpw
    except UsageError:
        bpw = 5.0  # unknown label: about Q4_K_M/Q5_K_M
    size = int(parameters * bpw / 8)
    return estimate(shape_from_size(size, parameters), ctx=ctx)


def is_quantized(info: GGUFInfo) -> bool:
    """A file whose weights are already quantized (anything beyond F32/F16/BF16)."""
    if info.level in FLOAT_LEVELS:
        return False
    return any(t not in ("F32", "F16", "BF16", "I8", "I16", "I32", "I64", "F64") for t in info.tensor_types)


def check_levels(
    wanted: list[Level], info: GGUFInfo, label: str, *, allow_requantize: bool, has_imatrix: bool = False
) -> list[str]:
    """Refuse levels this model cannot be quantized to (one line each); the warnings for those it can."""
    for lv in wanted:
        if lv.needs_imatrix and not has_imatrix:
            raise QuantizeError(
                f"{lv.key} needs an importance matrix (llama.cpp refuses it without one): add --imatrix auto "
                f"(or a matrix from `edgellm imatrix {label}`)"
            )
        if not lv.readable:
            raise QuantizeError(
                f"{lv.key} output cannot be validated: the installed gguf-py does not know the {lv.base_type} tensor type"
            )
        if info.file_type == lv.ftype:
            raise QuantizeError(f"{label} is already {lv.key}; pick another level")
    warnings = []
    if is_quantized(info):
        if not allow_requantize:
            raise QuantizeError(
                f"{label} is already quantized ({info.level}); requantizing compounds the errors. Quantize from an "
                f"F16/F32 file (`edgellm convert {label} --to f16` first), or pass --allow-requantize"
            )
        warnings.append(
            f"requantizing {label} ({info.level}): the errors compound (the new level's rounding adds to {info.level}'s); "
            "quantize from F16/F32 when you have it"
        )
    return warnings


def estimate_size(info: GGUFInfo, lv: Level) -> int:
    """A generous estimate of the output size, for the disk preflight.

    Fallbacks are assumed everywhere they could happen, and the token
    embedding (and an output matrix the same size) at up to 8.5 bits/weight:
    small models like SmolLM2 spend a fifth of their weights there.
    """
    meta = max(0, info.size_bytes - info.tensor_bytes)
    if lv.is_float:
        return meta + info.parameters * int(lv.bpw) // 8
    bits = max(lv.bpw, type_bpw(FALLBACK.get(lv.base_type, lv.base_type)))
    embd = min(info.parameters, 2 * info.embedding_length * info.vocab_size)
    rest = max(0, info.parameters - embd)
    return int(meta + embd * max(bits, 8.5) / 8 + rest * bits / 8 * 1.02)
