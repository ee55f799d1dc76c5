"""llama.cpp's own tools, built from the same tree and flags: found, run, and set beside edgellm's rows."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Optional

from edgellm.errors import Cancelled, RuntimeFailure, UsageError
from edgellm.paths import cache_dir
from edgellm.profile.rows import BenchRow
from edgellm.profile.settings import BenchSettings
from edgellm.progress import CancelToken

log = logging.getLogger(__name__)


# -- llama-bench ------------------------------------------------------------------


def find_llama_bench() -> Path:
    """llama-bench from EDGELLM_LLAMA_TOOLS, else scripts/build_llama_tools.sh (cached), else the tools cache."""
    return find_llama_tool("llama-bench")


def find_llama_tool(name: str) -> Path:
    """One of llama.cpp's reference tools (llama-bench, llama-perplexity, llama-quantize), found as find_llama_bench says."""
    exe = f"{name}.exe" if os.name == "nt" else name
    env = os.environ.get("EDGELLM_LLAMA_TOOLS")
    if env:
        p = Path(env).expanduser() / exe
        if p.is_file():
            return p
        raise UsageError(f"EDGELLM_LLAMA_TOOLS={env} holds no {exe}; point it at the bin folder of scripts/build_llama_tools.sh")
    script = Path(__file__).resolve().parents[2] / "scripts" / "build_llama_tools.sh"
    if script.is_file() and shutil.which("bash"):
        log.info("locating %s with %s (builds it the first time)", exe, script)
        proc = subprocess.run(["bash", str(script)], capture_output=True, text=True)
        out = proc.stdout.strip().splitlines()
        if proc.returncode == 0 and out and (Path(out[-1]) / exe).is_file():
            return Path(out[-1]) / exe
        log.warning("scripts/build_llama_tools.sh failed: %s", (proc.stderr.strip().splitlines() or ["?"])[-1])

    found = sorted((cache_dir() / "llama-tools").glob(f"*/bin/{exe}"), key=lambda p: p.stat().st_mtime)
    if found:
        return found[-1]
    raise UsageError(f"{exe} not found: run scripts/build_llama_tools.sh, or set EDGELLM_LLAMA_TOOLS to its bin folder")


def run_llama_bench(
    paths: Sequence[Path],
    settings: BenchSettings,
    *,
    use_mmap: bool = True,
    mlock: bool = False,
    n_gpu_layers: int = 0,
    exe: Optional[Path] = None,
    cancel: Optional[CancelToken] = None,
    extra_args: Sequence[str] = (),
) -> list[dict[str, Any]]:
    """llama-bench's own JSON records for `paths`, same tests, threads and load mode."""
    exe = exe or find_llama_bench()
    mode = {(True, False): "mmap", (True, True): "mmap+mlock", (False, True): "mlock", (False, False): "none"}[(use_mmap, mlock)]
    cmd = [str(exe)]
    for p in paths:
        cmd += ["-m", str(p)]
    cmd += [
        "-p",
        str(settings.pp),
        "-n",
        str(settings.tg),
        "-r",
        str(settings.repetitions),
        "-t",
        str(settings.n_threads),
        "-lm",
        mode,
        "-ngl",
        str(n_gpu_layers),
        "-o",
        "json",
    ]
    if extra_args:  # e.g. --rpc with the split's -ngl/-ts (edgellm.profile.bench_rpc); a later -ngl wins
        cmd += list(extra_args)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        while True:
            try:
                out, err = proc.communicate(timeout=0.2)
                break
            except subprocess.TimeoutExpired:
                if cancel is not None and cancel.cancelled:
                    raise Cancelled(cancel.reason) from None
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    if proc.returncode != 0:
        tail = [ln for ln in err.strip().splitlines() if ln.strip()]
        raise RuntimeFailure(f"llama-bench failed (exit {proc.returncode}): {tail[-1][:200] if tail else 'no output'}")
    try:
        return json.loads(out)
    except json.JSONDecodeError:
        raise RuntimeFailure("llama-bench printed no JSON") from None


def _attach_llama_bench(rows: list[BenchRow], paths: list[Path], settings: BenchSettings, **kw) -> None:
    records = run_llama_bench(paths, settings, **kw)
    by_key = {(os.path.realpath(r["model_filename"]), int(r["n_prompt"]), int(r["n_gen"])): r for r in records}
    for row in rows:
        r = by_key.get((os.path.realpath(row.model_filename), row.n_prompt, row.n_gen))
        if r is None:
            continue
        row.llama_bench_ts = float(r["avg_ts"])
        row.llama_bench_stddev_ts = float(r.get("stddev_ts", 0.0))
        row.ratio = row.avg_ts / row.llama_bench_ts if row.llama_bench_ts > 0 else None
