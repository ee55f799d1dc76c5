"""How much a group of matrices in a given type moves the logits, measured on the calibration text.

quant/budget.py's proxy (imatrix-weighted squared error of a matmul's
output) compares matrices of one kind at one depth well, but not a kind
with another, nor early layers with late ones (per unit of proxy error the
KL divergence spans 100x between kinds and depths), nor always one type
family with another: a K-quant's error (a 256-block with 6-bit sub-scales)
and a 32-block type's differ in structure the per-column proxy cannot see.
So the search calibrates one gain per group -- a matrix kind (attn_q, attn_k,
attn_v, attn_output, ffn_gate, ffn_up, ffn_down) times a slice of the layers
(depth_buckets: the first two and the last one by one, thirds between),
plus token_embd and output -- *and per candidate type*: gain = KLD caused by
that group's matrices in that type / their proxy error in that type. The
search measures the types its allocation actually picks (quant/budget.py
asks for them round by round), so every decision it makes rests on a
measured KLD of the very K-, i- or 32-block type it chooses.

How a probe is measured, with nothing written to disk: the F16/F32 base is
loaded once into ordinary memory (no mmap, no repacked buffers), and an eval
callback notes where every weight lives. For a probe, each matrix of the
group is quantized exactly as llama_model_quantize will do it
(`ggml_quantize_chunk` with the tensor's importance entry), read back with
ggml's `to_float`, and written over the loaded weights; the calibration
tokens run through, the KLD against the base's own log-probs is taken, and
the original weights are copied back from the file. The reference is the
base itself, as `edgellm eval` measures. KLDs of disjoint groups add up
(all-Q4_0 on the default model: 0.2376 measured, 0.2368 the sum of the
groups'), which is what lets per-group gains rank single matrices.

The text is the imatrix's calibration text (never an evaluation text): the
first PROBE_CHUNKS x PROBE_CTX tokens, scored from the ninth token of each
chunk. Results are cached under `<home>/sensitivity/`, one file per model,
matrix and probe setup, keyed by sha256: a later --budget at another size
measures only the (group, type) pairs it has not seen. A killed search
leaves nothing (no probe files; the cache is written by rename).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import re
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional, Protocol

import numpy as np

from edgellm import paths
from edgellm.engine.runtime import default_threads
from edgellm.errors import QuantizeError
from edgellm.fsutil import atomic_write_text
from edgellm.progress import CancelToken, Progress, ProgressCallback
from quant._ggml import GGML_TYPE_F16, GGML_TYPE_F32, Tensor, ggml
from quant.imatrix import calibration_text
from quant.kld import BaseLogProbs, KLDAccumulator
from quant.perplexity import ChunkPlan, LogitsRunner, _quiet_llama, score

VERSION = 3  # 3: the first two and the last layer are groups of their own (depth_buckets)
# 128 tokens: on the gridless 135M, Q4_K_M/Q3_K_M ratios 0.673/0.443 at 128 against 0.672/0.446 at 256
# (0.676/0.464 at 64), for 0.64x the probe time; at x4 the forward pass (~3 s on 2 cores) is a third of an
# average probe, the rounding of the group's matrices the rest
PROBE_CTX = 128
PROBE_CHUNKS = 1
PROBE_FIRST = 8  # scored from the 9th token: 119 of the 128 evaluated
DEPTH_BUCKETS = 3  # thirds of the layers between the edge ones
EDGE_FIRST, EDGE_LAST = 2, 1
_BLK = re.compile(r"^blk\.(\d+)\.([a-z_]+)")
_ROWS_PER_STEP = 2048  # rows quantized at a time: bounds the float32 copies of a 49k-row embedding


class TensorInfo(Protocol):
    """What a probe needs of a tensor-table entry (edgellm.gguf.layout.read_tensors)."""

    name: str
    shape: list[int]
    n_bytes: int
    data_offset: int


def depth_buckets(n_layers: int) -> list[range]:
    """The layers' groups: the first EDGE_FIRST and last EDGE_LAST layers one by one, thirds of the rest.

    The ends apart because that is where KLD per unit of error jumps: on the gridless 135M, attn_v in
    Q5_1 one layer at a time, layer 0 has 30x layer 1's and 440x the median (the residual stream is
    still small there, so its absolute error looks cheap); over a third of the layers the gain of
    ffn_down falls ~10x, smoothly, which interpolating between the groups follows (quant/budget.py).
    Per-layer gains against these groups' interpolated ones: within 4.4x (attn_v), 2.2x (ffn_down),
    5.3x (attn_q) where plain thirds were off by 447x, 6.4x and 7.0x."""
    n = max(1, n_layers)
    first, last = min(EDGE_FIRST, n), min(EDGE_LAST, max(0, n - EDGE_FIRST))
    inner = range(first, n - last)
    out = [range(i, i + 1) for i in range(first)]
    k = min(DEPTH_BUCKETS, len(inner))
    for b in range(k):
        out.append(inner[b * len(inner) // k : (b + 1) * len(inner) // k])
    out += [range(i, i + 1) for i in range(n - last, n)]
    return [r for r in out if len(r)]


def group_of(name: str, n_layers: int) -> str:
    """`attn_v/0` (kind / a single layer), `attn_v/2-10` (kind / layers 2..10), or the tensor's own name
    outside the blocks."""
    m = _BLK.match(name)
    if m is None:
        return name.split(".")[0]
    layer = int(m.group(1))
    for r in depth_buckets(n_layers):
        if layer in r:
            return f"{m.group(2)}/{r[0]}" if len(r) == 1 else f"{m.group(2)}/{r[0]}-{r[-1]}"
    return f"{m.group(2)}/{layer}"  # a layer past the count the header gives: its own group


def layer_of(name: str) -> Optional[int]:
    m = _BLK.match(name)
    return int(m.group(1)) if m else None


def group_centre(group: str) -> Optional[float]:
    """The mean layer of a group (`attn_v/2-10` -> 6.0), None outside the blocks."""
    if "/" not in group:
        return None
    a, _, b = group.split("/", 1)[1].partition("-")
    return (int(a) + int(b or a)) / 2


@dataclass
class ProbeResult:
    """One group in one type: the KLD it caused on the calibration tokens, and its proxy error."""

    kld: float
    kld_err: float
    error: float
    matrices: int
    seconds: float

    @property
    def gain(self) -> float:
        return self.kld / self.error if self.error > 0 else 0.0


def cache_key(model_sha256: str, imatrix_sha256: str, rounding: str) -> dict[str, Any]:
    return {
        "rounding": rounding,  # a probe's KLD is that of the blocks the quantizer wrote
        "model": model_sha256,
        "imatrix": imatrix_sha256,
        "ctx": PROBE_CTX,
        "chunks": PROBE_CHUNKS,
        "first": PROBE_FIRST,
        "buckets": [DEPTH_BUCKETS, EDGE_FIRST, EDGE_LAST],
        "version": VERSION,
    }


def _root() -> Path:
    return paths.home() / "sensitivity"


def _cache_file(key: dict[str, Any]) -> Path:
    return _root() / (hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24] + ".json")


def load_results(key: dict[str, Any]) -> dict[tuple[str, str], ProbeResult]:
    """The probes measured before for this model, matrix and setup ({(group, type): result})."""
    try:
        saved = json.loads(_cache_file(key).read_text(encoding="utf-8"))
        if saved.get("key") != key:
            return {}
        return {(g, t): ProbeResult(**r) for g, per in saved["probes"].items() for t, r in per.items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}


def save_results(key: dict[str, Any], results: dict[tuple[str, str], ProbeResult]) -> None:
    probes: dict[str, dict[str, Any]] = {}
    for (g, t), r in sorted(results.items()):
        probes.setdefault(g, {})[t] = asdict(r)
    text = calibration_text()
    atomic_write_text(
        _cache_file(key),
        json.dumps({"key": key, "text": text.label, "text_sha256": text.sha256, "probes": probes}, indent=1) + "\n",
    )


class _ProbeModel(LogitsRunner):
    """The base loaded into writable memory, with the address of every weight the graph reads.

    LogitsRunner's chunk driver, over a model llama.cpp reads into its own CPU buffer (no mmap: the
    weights must be writable; no extra buffer types: a repacked layout could not be written in
    place), with an eval callback that records the weights the graph's nodes read."""

    LOAD_FAILED = "llama.cpp could not load {name} for the sensitivity probes"
    CONTEXT_FAILED = "llama.cpp could not create a context for the sensitivity probes of {name}"

    def __init__(self, path: Path, *, n_ctx: int, threads: int) -> None:
        self.path = path
        self.weights: dict[str, tuple[int, int, int]] = {}  # name -> (address, ggml type, elements)
        self._callback = _quiet_llama().ggml_backend_sched_eval_callback(self._note)
        self._open(n_ctx=n_ctx, n_seq=1, n_batch=n_ctx, threads=threads)
        self._g = ggml()

    def _tune(self, mp: Any, cp: Any) -> None:
        mp.load_mode = self._ll.LLAMA_LOAD_MODE_NONE
        mp.use_extra_bufts = False
        cp.cb_eval = self._callback
        cp.cb_eval_user_data = None

    def _note(self, t_ptr: int, ask: bool, _ud: Optional[int]) -> bool:
        """Asked about every node before it runs: note the weights it reads; never ask for its data."""
        try:
            if ask:
                t = Tensor.from_address(t_ptr)
                for s in t.src[:2]:
                    if s:
                        w = Tensor.from_address(s)
                        name = w.name.decode("utf-8", "replace")
                        if name.endswith(".weight") and not w.view_src and name not in self.weights:
                            host = not w.buffer or self._g.lib.ggml_backend_buffer_is_host(w.buffer)
                            if host and w.data:
                                self.weights[name] = (int(w.data), int(w.type), int(w.ne[0] * w.ne[1] * w.ne[2] * w.ne[3]))
        except Exception:  # noqa: BLE001 - nothing may cross into C; a weight not noted is reported later
            pass
        return False


class Prober:
    """Measures (group, type) probes on one loaded copy of the base; the model loads at the first probe,
    so a search whose probes are all cached loads nothing."""

    def __init__(
        self,
        model_path: Path,
        tensors: dict[str, TensorInfo],
        imatrix: dict[str, np.ndarray],
        *,
        threads: Optional[int],
        cancel: Optional[CancelToken],
    ) -> None:
        self.model_path, self.tensors, self.imatrix = model_path, tensors, imatrix
        self.threads = threads or default_threads()  # as quantize and eval choose them
        self.cancel = cancel
        self.model: Optional[_ProbeModel] = None
        self.raw = np.memmap(model_path, np.uint8, mode="r")
        self.base: Optional[BaseLogProbs] = None
        self.seconds = 0.0
        self.probes = 0
        self._pool = ThreadPoolExecutor(self.threads)  # ggml_quantize_chunk drops the GIL: rows split over threads

    def _start(self) -> _ProbeModel:
        if self.model is not None:
            return self.model
        t0 = time.perf_counter()
        self.model = _ProbeModel(self.model_path, n_ctx=PROBE_CTX, threads=self.threads)
        self.plan = ChunkPlan(n_ctx=PROBE_CTX, n_chunk=PROBE_CHUNKS, n_batch=PROBE_CTX, n_seq=1, first=PROBE_FIRST)
        self.tokens = self.model.tokenize(calibration_text().data)
        if len(self.tokens) < PROBE_CTX * PROBE_CHUNKS:
            raise QuantizeError(f"the calibration text is too short for the sensitivity probes ({len(self.tokens)} tokens)")
        per = self.plan.n_scored_per_chunk
        base = BaseLogProbs(self.plan.n_chunk * per, self.model.n_vocab)
        score(
            self.model,
            self.tokens,
            self.plan,
            cancel=self.cancel,
            on_chunk=lambda i, lg, tg, nll, sm: base.add_chunk(i * per, lg, tg, nll, sm, seed=i),
        )
        self.base = base
        self.seconds += time.perf_counter() - t0
        return self.model

    def can_probe(self, names: Sequence[str]) -> bool:
        m = self._start()
        return all(n in m.weights and m.weights[n][1] in (GGML_TYPE_F16, GGML_TYPE_F32) for n in names)

    def measure(self, names: Sequence[str], type_id: int) -> tuple[float, float]:
        """(mean KLD, its uncertainty) on the calibration tokens with the matrices `names` in `type_id`."""
        m = self._start()
        t0 = time.perf_counter()
        try:
            for n in names:
                self._write(n, type_id)
            acc = KLDAccumulator(self.base)  # type: ignore[arg-type]
            per = self.plan.n_scored_per_chunk
            score(
                m,
                self.tokens,
                self.plan,
                cancel=self.cancel,
                on_chunk=lambda i, lg, tg, nll, sm: acc.add_chunk(i * per, lg, nll, sm),
            )
            res = acc.result()
        finally:
            for n in names:
                self._restore(n)
        self.seconds += time.perf_counter() - t0
        self.probes += 1
        return float(res.kld_mean), float(res.kld_err)

    def _target(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """(the file's values of `name`, the loaded copy llama.cpp computes with), both rows x cols."""
        t = self.tensors[name]
        addr, tid, n = self.model.weights[name]  # type: ignore[union-attr]
        dtype = np.float16 if tid == GGML_TYPE_F16 else np.float32
        cols, rows = t.shape[0], n // t.shape[0]
        if n != t.shape[0] * t.shape[1] or t.n_bytes != n * np.dtype(dtype).itemsize:
            raise QuantizeError(f"the loaded {name} is not the file's tensor; cannot probe it")
        live = np.ctypeslib.as_array((ctypes.c_uint8 * t.n_bytes).from_address(addr)).view(dtype).reshape(rows, cols)
        src = np.frombuffer(self.raw[t.data_offset : t.data_offset + t.n_bytes], dtype).reshape(rows, cols)
        return src, live

    def _write(self, name: str, type_id: int) -> None:
        src, live = self._target(name)
        g, imp = ggml(), self.imatrix.get(name)
        cols = src.shape[1]

        def step(span: tuple[int, int]) -> None:
            rows = np.ascontiguousarray(src[span[0] : span[1]], np.float32)
            q = g.quantize(type_id, rows, imp)
            live[span[0] : span[1]] = g.to_float(type_id, q, (len(rows), cols))

        list(self._pool.map(step, row_spans(src.shape[0], self.threads)))

    def _restore(self, name: str) -> None:
        src, live = self._target(name)
        live[...] = src

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        if self.model is not None:
            self.model.close()
            self.model = None


def row_spans(rows: int, threads: int) -> list[tuple[int, int]]:
    """Near-equal row ranges, a multiple of `threads` of them, none over _ROWS_PER_STEP. Fixed 2,048-row
    steps left one thread rounding alone: a 2,304-row matrix split 2,048 + 256, a 768-row one not at all,
    and the x4 model's probes spent ~1.8x the rounding time they need (each row rounds on its own, so
    the values do not depend on the split)."""
    n = max(1, threads) * max(1, -(-rows // (max(1, threads) * _ROWS_PER_STEP)))
    n = min(n, max(1, rows))
    edges = [rows * i // n for i in range(n + 1)]
    return [(a, b) for a, b in zip(edges[:-1], edges[1:], strict=True) if b > a]


def run_probes(
    prober: Prober,
    want: Sequence[tuple[str, str, list[str], float]],
    type_ids: dict[str, int],
    results: dict[tuple[str, str], ProbeResult],
    *,
    on_progress: Optional[ProgressCallback] = None,
    cancel: Optional[CancelToken] = None,
) -> None:
    """Measure each (group, type, matrices, proxy error) of `want` into `results`."""
    task = "measure sensitivity on the calibration text"
    for i, (g, t, names, err) in enumerate(want):
        if on_progress is not None:
            on_progress(Progress(task, i, len(want), "probe", message=f"{g} {t}"))
        if cancel is not None:
            cancel.check()
        t0 = time.perf_counter()
        kld, kld_err = prober.measure(names, type_ids[t])
        results[(g, t)] = ProbeResult(
            kld=kld, kld_err=kld_err, error=err, matrices=len(names), seconds=round(time.perf_counter() - t0, 3)
        )
    if on_progress is not None and want:
        on_progress(Progress(task, len(want), len(want), "probe", message="done"))


def gain_lookup(results: dict[tuple[str, str], ProbeResult], bpw: Callable[[str], float]) -> Callable[[str, str], float]:
    """gain(group, type): measured where that pair was probed, else the group's probe nearest in bits per
    weight; a group never probed gets the median gain, one lost in the noise 1% of it, so it is not free."""
    per: dict[str, list[tuple[float, float]]] = {}
    for (g, t), r in results.items():
        if r.gain > 0:
            per.setdefault(g, []).append((bpw(t), r.gain))
    vals = sorted(v for lst in per.values() for _b, v in lst)
    mid = vals[len(vals) // 2] if vals else 1.0
    floor = mid / 100

    def gain(group: str, type_name: str) -> float:
        r = results.get((group, type_name))
        if r is not None and r.gain > 0:
            return max(r.gain, floor)
        lst = per.get(group)
        if not lst:
            return floor if (group, type_name) in results else mid
        b = bpw(type_name)
        return max(min(lst, key=lambda bv: (abs(bv[0] - b), bv[0]))[1], floor)

    return gain


def clean_legacy(root: Optional[Path] = None) -> None:
    """Probe folders of the file-based probes (edgellm before the in-memory ones) left by a killed search."""
    import shutil

    root = root or _root()
    for d in root.glob("probe-*") if root.is_dir() else []:
        try:
            os.kill(int(d.name.split("-", 1)[1]), 0)
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
        except (ValueError, PermissionError):
            pass
