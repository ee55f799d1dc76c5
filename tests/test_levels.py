"""quant/levels.py: the table of llama.cpp file types, checked against llama.cpp and gguf-py themselves."""

from __future__ import annotations

import pytest

from edgellm.errors import UsageError
from quant.levels import ALIASES, FALLBACK, LEVELS, level_for_ftype, parse_level, type_bpw


@pytest.mark.parametrize(
    "text, name",
    [
        ("q4_k_m", "Q4_K_M"),
        ("Q4_K_M", "Q4_K_M"),
        (" q8_0 ", "Q8_0"),
        ("q4-k-m", "Q4_K_M"),
        ("bf16", "BF16"),
        # llama-quantize's aliases
        ("q4_k", "Q4_K_M"),
        ("Q3_K", "Q3_K_M"),
        ("q5_k", "Q5_K_M"),
        # the LLAMA_FTYPE number
        ("15", "Q4_K_M"),
        ("7", "Q8_0"),
        ("0", "F32"),
        ("1", "F16"),
    ],
)
def test_parse_level_names_aliases_and_numbers(text, name):
    lv = parse_level(text)
    assert lv.name == name and lv.key == name.lower()


@pytest.mark.parametrize("text", ["q9_9", "q4_k_xl", "99", "", "q4 k m"])
def test_unknown_level_is_a_usage_error_naming_the_levels(text):
    with pytest.raises(UsageError) as e:
        parse_level(text)
    msg = str(e.value)
    assert msg.startswith(f"unknown level {text.strip()!r}")
    assert "q4_k_m" in msg and "q8_0" in msg and "f16" in msg


def test_table_matches_llama_cpp():
    import llama_cpp

    assert len({lv.name for lv in LEVELS}) == len({lv.ftype for lv in LEVELS}) == len(LEVELS)
    for lv in LEVELS:
        const = "LLAMA_FTYPE_ALL_F32" if lv.name == "F32" else f"LLAMA_FTYPE_MOSTLY_{lv.name}"
        assert getattr(llama_cpp, const) == lv.ftype, lv.name
        assert level_for_ftype(lv.ftype) is lv
    assert level_for_ftype(None) is None and level_for_ftype(999) is None
    assert set(ALIASES.values()) <= {lv.name for lv in LEVELS}


def test_bpw_single_types_are_block_bits_and_mixes_are_ordered():
    # legacy, ternary and float levels are one type throughout: bpw is that type's block bits (gguf-py's sizes)
    for name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "F16", "BF16", "F32", "TQ1_0", "TQ2_0"):
        lv = parse_level(name)
        assert lv.base_type == name and lv.bpw == pytest.approx(type_bpw(name)), name
    # the K- and i-quant mixes keep some tensors (output, token_embd, attn_v...) at more bits than the bulk
    for lv in LEVELS:
        if lv.readable and lv.name[:2] in ("Q2", "Q3", "Q4", "Q5", "IQ") and lv.name not in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
            assert lv.bpw >= type_bpw(lv.base_type), lv.name
    assert (parse_level("q4_0").bpw, parse_level("q8_0").bpw, parse_level("f16").bpw) == (4.5, 8.5, 16.0)
    assert type_bpw("q5_0") == 5.5 and type_bpw("Q6_K") == pytest.approx(6.5625) and type_bpw("NOT_A_TYPE") == 32.0
    bpw = {lv.name: lv.bpw for lv in LEVELS}
    assert bpw["Q3_K_S"] < bpw["Q3_K_M"] < bpw["Q3_K_L"]
    assert bpw["Q4_K_S"] < bpw["Q4_K_M"] and bpw["Q5_K_S"] < bpw["Q5_K_M"]
    assert bpw["Q4_K_M"] < bpw["Q5_K_M"] < bpw["Q6_K"] < bpw["Q8_0"] < bpw["F16"] < bpw["F32"]


def test_fallbacks_have_small_blocks_and_no_fewer_bits():
    """llama.cpp's stand-ins for rows that are not a multiple of a type's block: a 32-wide type, never coarser."""
    from edgellm.gguf.reader import gguf_constants

    c = gguf_constants()
    known = c.GGMLQuantizationType.__members__
    checked = 0
    for src, dst in FALLBACK.items():
        assert dst in known, dst
        if src not in known:  # a type newer than the installed gguf-py (Q2_0)
            continue
        src_block = c.GGML_QUANT_SIZES[c.GGMLQuantizationType[src]][0]
        dst_block = c.GGML_QUANT_SIZES[c.GGMLQuantizationType[dst]][0]
        assert dst_block == 32 < src_block, (src, dst)
        assert type_bpw(dst) >= type_bpw(src), (src, dst)
        checked += 1
    assert checked >= 14
    # the levels' own block sizes: K- and i-quants 256, the legacy quants 32
    assert parse_level("q4_k_m").block_size == 256 and parse_level("q4_0").block_size == 32


def test_needs_imatrix_follows_llama_cpp_rule():
    # tensor_requires_imatrix(): IQ1_S/IQ1_M/IQ2_XXS/IQ2_XS/IQ2_S/IQ3_XXS tensors, or Q2_K in a Q2_K_S file
    need = {lv.name for lv in LEVELS if lv.needs_imatrix}
    assert need == {"IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ3_XXS", "IQ3_XS", "Q2_K_S"}
