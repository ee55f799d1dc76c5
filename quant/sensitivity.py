"""How much each group of matrices' rounding error moves the logits, measured on the calibration text.

quant/budget.py's proxy (imatrix-weighted squared error of a matmul's
output) compares matrices of one kind at one depth well, but not a kind
with another, nor early layers with late ones: on SmolLM2-135M the KL
divergence caused per unit of proxy error spans 100x (attn_v of the first
ten layers 2.8e-3, attn_output of the last ten 2.4e-5, ffn_down's
massive-activation layers less still). So the search calibrates one gain
per group -- a matrix kind (attn_q, attn_k, attn_v, attn_output, ffn_gate,
ffn_up, ffn_down, token_embd, output) times a third of the layers -- and
ranks upgrades by error x gain.

A gain is measured, never guessed. llama.cpp quantizes the model twice,
with the importance matrix as the output will be: every matrix in Q8_0
(the base), and every matrix in a ~4.5-bit probe type (Q4_0 where allowed).
A group's probe file is the base with that group's tensors taken from the
second file (`assemble`: a byte copy, not another quantization); it runs
over the first 128 tokens of the calibration text (the imatrix's text, never
an evaluation text; 119 scored), and gain = KLD against the base / the
group's proxy error in the probe type. KLDs of disjoint groups add up
(all-Q4_0: 0.2376 measured, 0.2368 the sum of the groups), which is what
lets a per-group gain rank single matrices.

Cost: two llama_model_quantize calls, then per group (22 on a 30-layer
model) a file copy, a model load and a 128-token pass: ~95 s for
SmolLM2-135M on 2 loaded cores. The gains are cached under
`<home>/sensitivity/`, keyed by the model's and the imatrix's sha256 and the
candidate types, so a second --budget on the same model pays nothing.
Probe files live in `<home>/sensitivity/probe-<pid>/`, removed when the
search ends or is cancelled; a folder left by a killed search is removed by
the next one.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import re
import shutil
import struct
import time
from pathlib import Path
from typing import Any, Optional, Sequence

import numpy as np

from edgellm import paths
from edgellm.engine.runtime import default_threads
from edgellm.errors import Cancelled, QuantizeError
from edgellm.fsutil import atomic_write_text
from edgellm.gguf.layout import read_layout
from edgellm.progress import Progress
from quant._workers import Worker
from quant.imatrix import calibration_text
from quant.kld import BaseLogProbs, KLDAccumulator
from quant.perplexity import ChunkPlan, LogitsRunner, score

VERSION = 1
PROBE_CTX = 128
PROBE_CHUNKS = 1
PROBE_FIRST = 8  # scored from the 9th token on: 119 of the 128 evaluated, where llama-perplexity scores half
DEPTH_BUCKETS = 3
BASE_TYPE = "Q8_0"
# ~4.5-bit types first: a probe error large enough to measure, small enough to stay in the quadratic regime
PROBE_ORDER = ("Q4_0", "IQ4_NL", "Q4_K", "IQ4_XS", "Q5_0", "Q5_K", "Q3_K", "Q5_1", "Q4_1", "Q6_K", "Q2_K", "Q8_0")
_FTYPE_Q8_0 = 7  # LLAMA_FTYPE_MOSTLY_Q8_0: every matrix not overridden stays in the base type
_BLK = re.compile(r"^blk\.(\d+)\.([a-z_]+)")


def group_of(name: str, n_layers: int) -> str:
    """`attn_v/0` (kind / third of the layers), or the tensor's own name outside the blocks."""
    m = _BLK.match(name)
    if m is None:
        return name.split(".")[0]
    return f"{m.group(2)}/{int(m.group(1)) * DEPTH_BUCKETS // max(1, n_layers)}"


def probe_type(options: Sequence[tuple[str, int, float]]) -> str:
    have = {o[0] for o in options}
    return next((t for t in PROBE_ORDER if t in have), options[0][0])


def _root() -> Path:
    return paths.home() / "sensitivity"


def _clean_stale(root: Path) -> None:
    for d in root.glob("probe-*"):
        try:
            pid = int(d.name.split("-", 1)[1])
            os.kill(pid, 0)
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)  # its search was killed
        except (ValueError, PermissionError):
            pass


def cache_key(model_sha256: str, imatrix_sha256: str, types: Sequence[str]) -> dict[str, Any]:
    return {"model": model_sha256, "imatrix": imatrix_sha256, "types": sorted(types), "ctx": PROBE_CTX,
            "chunks": PROBE_CHUNKS, "first": PROBE_FIRST, "buckets": DEPTH_BUCKETS, "base": BASE_TYPE, "version": VERSION}


def _table_start(raw: Any, parsed: Any) -> int:
    """Where the tensor table begins: it ends within one alignment before the data, and starts with the
    first tensor's length-prefixed name."""
    size = sum(8 + len(t.name.encode()) + 4 + 8 * len(t.shape) + 4 + 8 for t in parsed.tensors)
    first = parsed.tensors[0].name.encode()
    want = struct.pack("<Q", len(first)) + first
    for end in range(parsed.data_offset, parsed.data_offset - parsed.alignment, -1):
        start = end - size
        if start > 0 and bytes(raw[start:start + len(want)]) == want:
            return start
    raise QuantizeError("cannot find the tensor table of a sensitivity probe's base file")


def assemble(base: Path, alt: Path, take: set[str], dst: Path, layouts: Optional[tuple[Any, Any]] = None) -> None:
    """`base` with the tensors named in `take` replaced by `alt`'s (same model, other types): a probe file in
    a file copy instead of a llama_model_quantize call. The metadata is `base`'s, byte for byte. `layouts`:
    both files' read_layout, parsed once for all the probes (0.4 s each with a 49k-token vocabulary)."""
    pb, pa = layouts or (read_layout(base), read_layout(alt))
    alt_by_name = {t.name: t for t in pa.tensors}
    parts = [(alt_by_name[t.name], alt) if t.name in take else (t, base) for t in pb.tensors]
    align = pb.alignment
    table, off = bytearray(), 0
    for t, _src in parts:
        off = -(-off // align) * align
        name = t.name.encode()
        table += struct.pack("<Q", len(name)) + name + struct.pack("<I", len(t.shape))
        table += struct.pack(f"<{len(t.shape)}Q", *t.shape) + struct.pack("<IQ", t.type_id, off)
        off += t.n_bytes
    with open(base, "rb") as fb, open(alt, "rb") as fa, open(dst, "wb") as fh:
        head = np.memmap(base, np.uint8, mode="r", shape=(pb.data_offset,))
        fh.write(bytes(head[:_table_start(head, pb)]))
        fh.write(table)
        fh.write(b"\0" * (-fh.tell() % align))
        data0 = fh.tell()
        files = {base: fb, alt: fa}
        for t, src in parts:
            fh.write(b"\0" * (-(fh.tell() - data0) % align))
            fh.flush()
            _copy(files[src], fh, t.data_offset, t.n_bytes)


def _copy(src: Any, dst: Any, offset: int, n: int) -> None:
    """n bytes from src at offset to dst's end: in the kernel where it can (copy_file_range), else read/write."""
    fast = getattr(os, "copy_file_range", None)
    while n > 0 and fast is not None:
        try:
            done = fast(src.fileno(), dst.fileno(), n, offset)
        except OSError:
            break
        if done <= 0:
            break
        offset, n = offset + done, n - done
    if n > 0:
        dst.seek(0, os.SEEK_END)
        src.seek(offset)
        while n > 0:
            buf = src.read(min(n, 16 << 20))
            if not buf:
                raise QuantizeError("a sensitivity probe's source file is shorter than its tensor table says")
            dst.write(buf)
            n -= len(buf)


class _Quantizer:
    """One quantize worker (quant/_quantize_worker.py) for all the probes; killed on cancel."""

    def __init__(self, threads: int) -> None:
        self.events: queue.Queue = queue.Queue()
        self.worker = Worker(self.events, threads)

    def run(self, src: Path, dst: Path, imatrix: Path, overrides: list[list[Any]], cancel: Any) -> None:
        self.worker.submit({"input": str(src), "output": str(dst), "ftype": _FTYPE_Q8_0, "nthread": self.worker.threads,
                            "allow_requantize": False, "imatrix": str(imatrix), "tt_overrides": overrides})
        tail: list[str] = []
        while True:
            if cancel is not None and cancel.cancelled:
                self.worker.kill()
                raise Cancelled(cancel.reason)
            try:
                _w, raw = self.events.get(timeout=0.1)
            except queue.Empty:
                continue
            if raw is None:
                raise QuantizeError("the quantization worker died while measuring sensitivity: "
                                    + " / ".join(tail[-3:] or list(self.worker.stderr_tail)[-3:]))
            try:
                msg = json.loads(raw)
            except ValueError:
                continue
            if "log" in msg:
                tail = (tail + [str(msg["log"]).strip()])[-5:]
            elif "done" in msg:
                if int(msg["done"]) != 0:
                    raise QuantizeError("llama.cpp failed to quantize a sensitivity probe: " + " / ".join(tail[-3:]))
                return

    def close(self) -> None:
        self.worker.close()


# long: one loop over the probes, sharing the worker, the base log-probs and the temp folder it cleans up
def measure_gains(model_path: Path, imatrix_path: Path, mats: Sequence[Any], types: Sequence[str], *, type_ids: dict[str, int],
                  model_sha256: str, imatrix_sha256: str, n_layers: int, threads: Optional[int] = None, cancel: Any = None,
                  on_progress: Any = None) -> tuple[dict[str, float], dict[str, Any]]:
    """({group: KLD per unit of proxy error}, how they were obtained); from the cache when it has them."""
    root = _root()
    key = cache_key(model_sha256, imatrix_sha256, types)
    cache = root / (hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24] + ".json")
    try:
        saved = json.loads(cache.read_text(encoding="utf-8"))
        if saved.get("key") == key:
            return {g: float(v) for g, v in saved["gains"].items()}, dict(saved["info"], cached=True)
    except (OSError, ValueError, KeyError, AttributeError):
        pass
    t0 = time.perf_counter()
    root.mkdir(parents=True, exist_ok=True)
    _clean_stale(root)
    work = root / f"probe-{os.getpid()}"
    work.mkdir(exist_ok=True)
    groups: dict[str, list[Any]] = {}
    for m in mats:
        groups.setdefault(group_of(m.name, n_layers), []).append(m)
    threads = threads or default_threads()  # as quantize and eval choose them
    text = calibration_text()
    task = "measure group sensitivity on the calibration text"
    probe_file = work / "probe.gguf"
    results: dict[str, dict[str, Any]] = {}
    q = _Quantizer(threads)
    try:
        def report(done: int, message: str) -> None:
            if on_progress is not None:
                on_progress(Progress(task, done, len(groups) + 1, "probe", message=message))

        report(0, f"all {BASE_TYPE}")
        base_file, alt_file = work / "base.gguf", work / "alt.gguf"
        picks = {m.name: probe_type(m.options) for m in mats}
        q.run(model_path, base_file, imatrix_path, [], cancel)
        q.run(model_path, alt_file, imatrix_path, [[f"^{re.escape(n)}$", type_ids[t]] for n, t in picks.items()], cancel)
        layouts = (read_layout(base_file), read_layout(alt_file))
        plan = ChunkPlan(n_ctx=PROBE_CTX, n_chunk=PROBE_CHUNKS, n_batch=PROBE_CTX, n_seq=1, first=PROBE_FIRST)
        per = plan.n_scored_per_chunk
        with LogitsRunner(base_file, n_ctx=PROBE_CTX, n_seq=1, n_batch=PROBE_CTX, threads=threads) as r:
            tokens = r.tokenize(text.data)
            if len(tokens) < PROBE_CTX * PROBE_CHUNKS:
                raise QuantizeError(f"the calibration text is too short for the sensitivity probes ({len(tokens)} tokens)")
            base = BaseLogProbs(plan.n_chunk * per, r.n_vocab)
            score(r, tokens, plan, on_chunk=lambda i, lg, tg, nll, sm: base.add_chunk(i * per, lg, tg, nll, sm, seed=i),
                  cancel=cancel)
        for i, (g, ms) in enumerate(groups.items()):
            report(i + 1, g)
            err = sum(next(o[2] for o in m.options if o[0] == picks[m.name]) for m in ms)
            assemble(base_file, alt_file, {m.name for m in ms}, probe_file, layouts)
            acc = KLDAccumulator(base)
            with LogitsRunner(probe_file, n_ctx=PROBE_CTX, n_seq=1, n_batch=PROBE_CTX, threads=threads) as r:
                score(r, tokens, plan, on_chunk=lambda i_, lg, tg, nll, sm, acc=acc: acc.add_chunk(i_ * per, lg, nll, sm),
                      cancel=cancel)
            res = acc.result()
            results[g] = {"kld": res.kld_mean, "kld_err": res.kld_err, "error": err, "matrices": len(ms),
                          "probe": sorted({picks[m.name] for m in ms})}
        report(len(groups) + 1, "done")
    finally:
        q.close()
        shutil.rmtree(work, ignore_errors=True)
    gains = _gains(results)
    info = {"groups": results, "seconds": round(time.perf_counter() - t0, 3), "tokens": PROBE_CHUNKS * PROBE_CTX,
            "scored_tokens": plan.n_chunk * per, "text": text.label, "text_sha256": text.sha256}
    atomic_write_text(cache, json.dumps({"key": key, "gains": gains, "info": info}, indent=1) + "\n")
    return gains, dict(info, cached=False)


def _gains(results: dict[str, dict[str, Any]]) -> dict[str, float]:
    """KLD / proxy error per group; a group whose KLD is lost in the noise keeps 1% of the median gain, so
    one noisy probe cannot leave its matrices in the cheapest type for free."""
    raw = {g: r["kld"] / r["error"] for g, r in results.items() if r["error"] > 0 and r["kld"] > 0}
    if not raw:
        return {g: 1.0 for g in results}
    vals = sorted(raw.values())
    floor = vals[len(vals) // 2] / 100
    return {g: max(raw.get(g, floor), floor) for g in results}
