"""One benchmark result row, with llama-bench's fields, and the bandwidth probe's result."""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

log = logging.getLogger(__name__)


@dataclass
class BenchRow:
    """One test of one model; field names follow llama-bench's JSON where it has them."""

    model: str  # store name, or the file name for a bare path
    model_filename: str
    model_type: str  # the level, e.g. "q8_0"
    model_size: int  # weight bytes
    model_n_params: int
    test: str  # "pp512", "tg128"
    n_prompt: int
    n_gen: int
    n_threads: int
    n_ctx: int
    n_batch: int
    n_ubatch: int
    n_gpu_layers: int
    use_mmap: bool
    mlock: bool
    samples_ns: list[int]
    avg_ts: float
    stddev_ts: float
    rss_bytes: Optional[int]  # peak RSS of the benchmark process so far
    file_backed_bytes: Optional[int]  # resident pages of the model file's mappings
    anon_bytes: Optional[int]  # anonymous resident bytes the model added (KV, compute buffers, weights without mmap)
    kv_bytes: int  # KV cache for n_ctx, from the model's shape (f16)
    kv_buffer_bytes: int  # what llama.cpp reported allocating for the KV cache
    compute_buffer_bytes: int
    output_buffer_bytes: int
    load_seconds: float
    ttft_seconds: Optional[float]
    file_bytes: int = 0
    bandwidth_bytes_per_s: Optional[float] = None
    # tg only: bandwidth / the bytes one token reads (every matrix once, a repacked one too; the
    # embedding table only when it is also the output; the KV cache up to the token's mean position)
    read_bytes_per_token: Optional[int] = None
    roofline_ts: Optional[float] = None
    roofline_fraction: Optional[float] = None
    llama_bench_ts: Optional[float] = None
    llama_bench_stddev_ts: Optional[float] = None
    ratio: Optional[float] = None  # avg_ts / llama-bench's avg_ts
    machine_id: str = ""
    timestamp: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    # GPU offload: the device, and llama.cpp's own allocations on it and on the host
    gpu_device: str = ""
    device_bytes: int = 0
    host_bytes: int = 0

    @property
    def samples_ts(self) -> list[float]:
        n = self.n_prompt + self.n_gen
        return [1e9 * n / t for t in self.samples_ns if t > 0]

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["samples_ts"] = self.samples_ts
        return d


@dataclass
class Bandwidth:
    read_bytes_per_s: float
    copy_bytes_per_s: float  # bytes read + written per second
    threads: int
    size_bytes: int
    reader: str = "memchr"  # which read gave read_bytes_per_s: "memchr" or "ggml" (the kernels' prefetching stream)
    samples: list[float] = field(default_factory=list)  # read bytes/s of each probe averaged here

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @staticmethod
    def bracket(before: Bandwidth, after: Bandwidth) -> Bandwidth:
        """The probes on both sides of a model's runs, as one: the mean of their reads and copies.

        A probe is a 0.1 s snapshot and a VM's bandwidth drifts by a third within seconds
        (docs/scale.md, 2026-12-08), while generation averages over its runs: one snapshot
        taken before the model loaded once sat below what generation then read (fraction 1.02).
        """
        readers = dict.fromkeys((before.reader, after.reader))
        return Bandwidth(
            (before.read_bytes_per_s + after.read_bytes_per_s) / 2,
            (before.copy_bytes_per_s + after.copy_bytes_per_s) / 2,
            before.threads,
            before.size_bytes,
            "/".join(readers),
            [before.read_bytes_per_s, after.read_bytes_per_s],
        )
