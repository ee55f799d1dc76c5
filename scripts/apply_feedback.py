#!/usr/bin/env python3
"""Error feedback on a file already quantized: what `quantize --budget --error-feedback` does after its search.

    .venv/bin/python scripts/apply_feedback.py BASE_F16.gguf QUANTIZED.gguf IMATRIX.gguf -o OUT.gguf

Every matrix the quantized file holds in a type of quant.feedback.FED_BACK is rounded again from the base's
values, column by column, with the inputs' covariance measured on the shipped calibration text and the tokens
BASE writes itself (quant/selfgen.py, as many as --budget would have it write; one pass of BASE over both, more where free RAM holds only some of the
covariances at once). The output has the same types, size
and layout; it is written beside OUT and renamed when complete.
The rounding is --budget's (quant.rounding.BUDGET). Used for docs/quantize.md's figures on files a --budget
run already made (the search does not depend on the feedback, so its types are the same).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("base", type=Path)
    ap.add_argument("quantized", type=Path)
    ap.add_argument("imatrix", type=Path)
    ap.add_argument("-o", "--output", type=Path, required=True)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--sequences", type=int, default=None, help="sequences BASE writes (default: quant.selfgen.sequences_for)")
    args = ap.parse_args()
    from edgellm.errors import EdgeLLMError, one_line
    from edgellm.fsutil import atomic_path, sha256_file
    from edgellm.gguf.layout import read_tensors
    from quant import feedback, rounding
    from quant.imatrix_file import read_imatrix
    from quant.selfgen import sequences_for

    try:
        tensor_types = [(f"^{t.name}$", t.type_name) for t in read_tensors(args.quantized).tensors]
        t0 = time.perf_counter()
        run, timing = feedback.prepare(
            args.base, tensor_types, read_imatrix(args.imatrix), rounding.BUDGET,
            model_sha256=sha256_file(args.base), threads=args.threads,
            sequences=sequences_for(args.base) if args.sequences is None else args.sequences,
        )  # fmt: skip
        with atomic_path(args.output) as tmp:
            shutil.copyfile(args.quantized, tmp)
            run(tmp)
    except (EdgeLLMError, OSError, ValueError) as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 1
    print(
        f"{args.output}: {int(timing['matrices'])} matrices fed back; {int(timing['passes'])} pass(es), "
        f"tokens {'read back' if timing['tokens_cached'] else 'written'} {timing['tokens']:.1f} s, inputs {timing['inputs']:.1f} s, rewrite {timing['rewrite']:.1f} s, {time.perf_counter() - t0:.1f} s in all"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
