#!/usr/bin/env python3
"""Does hosting llama.cpp in a Python process cost speed by itself?

llama-bench built with shared libraries (scripts/build_llama_tools.sh) is a
thin `main` over `libllama-bench-impl.so`, whose `llama_bench(argc, argv)`
can be called through ctypes. This script alternates, call by call, the
standalone `llama-bench` and the very same function run inside a Python
process (optionally with numpy imported, as llama_cpp does), and prints the
median of the paired ratios. Same code, same libraries, same arguments: any
difference is the host process. docs/bench.md has the figures.

    .venv/bin/python scripts/llama_bench_in_python.py MODEL.gguf --rounds 12
    .venv/bin/python scripts/llama_bench_in_python.py MODEL.gguf --numpy --tg 128
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _inside(bin_dir: str, numpy: bool, args: list[str]) -> None:
    """The child: run llama_bench() from the shared library in this Python process."""
    if numpy:
        import numpy  # noqa: F401
    lib = ctypes.CDLL(str(Path(bin_dir) / "libllama-bench-impl.so"))
    fn = getattr(lib, "_Z11llama_benchiPPc")  # int llama_bench(int, char **)
    fn.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    argv = [b"llama-bench", *(a.encode() for a in args)]
    rc = fn(len(argv), (ctypes.c_char_p * len(argv))(*argv))
    ctypes.CDLL(None).fflush(None)  # C stdio, not Python's
    sys.exit(rc)


def main() -> int:
    if len(sys.argv) > 3 and sys.argv[1] == "--inside":
        _inside(sys.argv[2], sys.argv[3] == "numpy", sys.argv[4:])
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--pp", type=int, default=512)
    ap.add_argument("--tg", type=int, default=0)
    ap.add_argument("-r", "--repetitions", type=int, default=2)
    ap.add_argument("--numpy", action="store_true", help="import numpy in the host process first")
    a = ap.parse_args()

    sys.path.insert(0, str(ROOT))
    from edgellm.profile.llama_bench import find_llama_bench

    bin_dir = str(find_llama_bench().parent)
    if not (Path(bin_dir) / "libllama-bench-impl.so").is_file():
        sys.exit(f"{bin_dir} holds no libllama-bench-impl.so (a static build?)")
    args = ["-m", str(a.model), "-p", str(a.pp), "-n", str(a.tg), "-t", str(a.threads), "-r", str(a.repetitions), "-o", "json"]
    cmds = {
        "standalone": [str(Path(bin_dir) / "llama-bench"), *args],
        "in python": [sys.executable, __file__, "--inside", bin_dir, "numpy" if a.numpy else "plain", *args],
    }
    ts: dict[str, list[float]] = {k: [] for k in cmds}
    for rnd in range(a.rounds):
        for k in list(cmds) if rnd % 2 == 0 else list(cmds)[::-1]:
            p = subprocess.run(cmds[k], capture_output=True, text=True)
            if p.returncode != 0:
                sys.exit(f"{k} failed: {p.stderr[-300:]}")
            ts[k].append(float(json.loads(p.stdout)[0]["avg_ts"]))
        print(f"round {rnd + 1}: standalone {ts['standalone'][-1]:.1f} t/s, in python {ts['in python'][-1]:.1f} t/s", flush=True)
    paired = [b / s for s, b in zip(ts["standalone"], ts["in python"])]
    test = f"pp{a.pp}" if a.pp else f"tg{a.tg}"
    print(
        f"{a.model.name} {test}, {a.threads} threads, numpy {'imported' if a.numpy else 'not imported'}: "
        f"in python / standalone = median paired {statistics.median(paired):.3f}x, "
        f"mean/mean {statistics.mean(ts['in python']) / statistics.mean(ts['standalone']):.3f}x over {a.rounds} rounds"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
