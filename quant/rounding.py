"""How edgellm's files round Q4_K and Q5_K blocks, and the switch in llama.cpp's quantizer that sets it.

Without numpy, so that the quantize worker and the CLI can name a rounding without loading it.
"""

from __future__ import annotations

import ctypes
import glob
from pathlib import Path

from edgellm.errors import RuntimeFailure

# How K-quant and IQ4_XS blocks are rounded. STOCK is llama.cpp's own (what llama-quantize writes, and what
# every stock level is byte-identical to). The refined ones re-choose each block's sub-block scales (and mins)
# and its F16 scales for the importance-weighted error (scripts/patches/ggml-quants-refine-k.patch):
# REFINED_K1 Q4_K and Q5_K among +-1 neighbours; REFINED (k2) Q5_K among +-2 and IQ4_XS too. Each is the
# level of the patch's switch, and llama-quantize from the same tree reproduces a file with
# GGML_QUANT_REFINE=<level>; a recipe names its rounding, so one made with k1 is still applied as k1.
STOCK, REFINED_K1, REFINED = "", "refined-k1", "refined-k2"
ROUNDINGS = (STOCK, REFINED_K1, REFINED)
# what `--budget` measures with and writes its files in: its probes, its proxy errors and its file round alike
BUDGET = REFINED
_SONAME = "libggml-base.so.0"  # what libllama names in its DT_NEEDED (Linux)


def base_library() -> ctypes.CDLL:
    """libggml-base from llama-cpp-python's own lib folder (the one libllama links to)."""
    import llama_cpp  # lazy: loading the shared library is the caller's choice, not an import side effect

    libdir = Path(llama_cpp.__file__).resolve().parent / "lib"
    # libllama links libggml-base by its soname, and a wheel holds a copy (not a link) under every name: a
    # copy opened by path would be a second quantizer, whose switch llama_model_quantize never reads. By
    # soname, the loader hands back the one already loaded (importing llama_cpp loaded libllama).
    if (libdir / _SONAME).is_file():
        try:
            return ctypes.CDLL(_SONAME)
        except OSError:
            pass
    found = sorted(glob.glob(str(libdir / "libggml-base.*")) + glob.glob(str(libdir / "ggml-base.dll")))
    if not found:
        raise RuntimeFailure(f"libggml-base not found in {libdir}; reinstall with scripts/setup.sh")
    return ctypes.CDLL(found[0])


def level(rounding: str) -> int:
    """The patch's switch level for a rounding (GGML_QUANT_REFINE's value)."""
    return ROUNDINGS.index(rounding)


def set_rounding(lib: ctypes.CDLL, rounding: str) -> str:
    """Make `lib`'s quantizer round as `rounding` says (process-wide); returns the previous one."""
    if rounding not in ROUNDINGS:
        raise RuntimeFailure(f"unknown rounding {rounding!r}")
    try:
        fn = lib.ggml_quantize_set_refine
    except AttributeError:
        raise RuntimeFailure(
            "this llama.cpp build lacks edgellm's refined K-quant rounding (scripts/patches); rerun scripts/setup.sh"
        ) from None
    fn.restype, fn.argtypes = ctypes.c_int, [ctypes.c_int]
    was = fn(level(rounding))
    return ROUNDINGS[was] if 0 <= was < len(ROUNDINGS) else STOCK


def describe(rounding: str) -> str:
    """One line for reports: which quantizer made the file's K-quant blocks."""
    if rounding != STOCK:
        return f"edgellm's refined rounding {rounding} (llama-quantize reproduces it with GGML_QUANT_REFINE={level(rounding)})"
    return "llama.cpp's own rounding"
