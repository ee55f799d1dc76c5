"""How much memory a loaded model takes: the one estimate every number comes from.

`recommend`, `models list`, the Hub preflight, the TUI's fit marks, the load
guard and the GPU offload plan all call `estimate()`, so they cannot
disagree. The parts follow what llama.cpp allocates on the CPU backend
(checked against its own log lines, `model buffer`, `KV buffer`,
`compute buffer`, for SmolLM2-135M at ctx 512-8192):

- weights: the GGUF's tensor bytes (mmapped; they count in RSS once read);
- repacked weights: on CPUs with the kernels for them, llama.cpp copies the
  matmul weights of some types (Q4_0, Q4_K, IQ4_NL with AVX2, Q2_K with
  AVX-512, more on Arm) into an interleaved layout in anonymous memory at
  load, while the mapped file pages it read them from stay resident: those
  bytes count twice (`repacked_bytes`);
- KV cache: 2 (K and V) x layers x ctx x n_embd_kv x bytes per element of
  the cache type (llama.cpp clears the buffer at load, so all of it is resident);
- compute buffers: sized for one micro-batch (n_ubatch tokens): the logits
  (n_vocab floats per token) plus a few activation rows of n_embd; with
  flash attention off, the larger of the logits and the attention scores
  (ctx x n_head floats per token). Flash attention is on by default where
  every layer runs on this CPU (`flash_attn_default`, as llama.cpp's own
  `-fa auto` resolves on the CPU): without it the score buffer grows with
  ctx x heads and a short chat touches only part of it, so no estimate is
  both above a full context and close to a short turn (0.54B Q4_K_M at ctx
  4096: 173 MB of scores reserved, a 512-token turn 1.21x below the estimate);
- the process itself (`PROCESS_BYTES`): Python with numpy, llama.cpp's
  code and the chat CLI's modules (45 MiB before a model loads), plus what a
  context adds beside those buffers (llama-cpp-python's logits arrays, the
  thread pool, allocator arenas). Measured with flash attention off:
  `edgellm chat` of SmolLM2-135M with a 4061-token prompt at ctx 4096
  peaked at 374.5 MiB RSS, 92.9 MiB above weights + KV cache + compute buffer.

With flash attention on the compute buffer is the logits' (512 rows reserved,
one computed per chat step) plus a few MiB of activations, so the estimate
stays above a chat's peak at any prompt length, by the untouched logits: at
ctx 4096, a 512-token chat peaks 1.27x below it at 135M Q4_K_M, 1.10x at
0.54B and 1.03x at 1.93B (docs/scale.md); tests/test_memory.py holds the
135M default model's full context between 1.00x and 1.45x.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Optional, Union

from edgellm.errors import InsufficientResources
from edgellm.fsutil import human_size
from edgellm.gguf.layout import GGUFInfo

# The one default context: chat, serve, the TUI, recommend and the Hub preflight.
DEFAULT_CTX = 4096
DEFAULT_UBATCH = 512
MiB = 1 << 20
PROCESS_BYTES = 96 * MiB


def flash_attn_default(gpu_layers: int = 0, rpc: bool = False) -> bool:
    """Flash attention when the caller does not choose (`--flash-attn auto`): on where every layer runs on
    this machine's CPU, as llama.cpp's `-fa auto` resolves there (and speculative decoding needs: its batched
    verification then rounds as single tokens do); off with GPU layers or RPC workers, whose backends edgellm
    has not measured with it."""
    return not rpc and gpu_layers == 0  # as options.resolve_gpu_layers counts them: 0 on a build without a GPU


# Bytes per K/V element for each cache type (ggml block bytes / elements per block).
KV_BYTES_PER_ELEM = {
    "f32": 4.0,
    "f16": 2.0,
    "bf16": 2.0,
    "q8_0": 34 / 32,
    "q5_1": 24 / 32,
    "q5_0": 22 / 32,
    "q4_1": 20 / 32,
    "q4_0": 18 / 32,
}


# What the pinned llama.cpp's CPU backend repacks (ggml-cpu/repack.cpp,
# ggml_repack_get_optimal_repack_type): by the CPU feature (llama.cpp's spelling,
# as engine.hardware.cpu_features reports it) that enables the repacked kernel.
REPACKED_TYPES = {
    "AVX2": ("Q4_0", "Q4_K", "IQ4_NL", "MXFP4"),
    "AVX512": ("Q2_K",),
    "MATMUL_INT8": ("Q4_0", "Q4_K", "Q5_K", "Q6_K", "Q8_0"),
    "DOTPROD": ("Q4_0", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "Q8_0", "MXFP4"),
}


def repacked_types(features: Optional[Sequence[str]] = None) -> frozenset[str]:
    """The tensor types this CPU's llama.cpp build copies into a repacked layout at load."""
    if features is None:
        from edgellm.engine import cpu_features  # reads /proc/cpuinfo: only when a GGUF is estimated

        features = cpu_features.present(cpu_features.host_flags())
    return frozenset(t for f in features for t in REPACKED_TYPES.get(f, ()))


@dataclass(frozen=True)
class MemoryEstimate:
    weights_bytes: int
    kv_bytes: int
    compute_bytes: int
    process_bytes: int
    ctx: int
    kv_type: str
    n_layers: int
    repacked_bytes: int = 0

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.repacked_bytes + self.kv_bytes + self.compute_bytes + self.process_bytes

    def describe(self) -> str:
        repacked = f" + repacked copy {human_size(self.repacked_bytes)}" if self.repacked_bytes else ""
        return (
            f"needs ~{human_size(self.total_bytes)} at ctx {self.ctx} (weights {human_size(self.weights_bytes)}{repacked}"
            f" + KV cache {human_size(self.kv_bytes)} {self.kv_type} + compute {human_size(self.compute_bytes)}"
            f" + process {human_size(self.process_bytes)})"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "total_bytes": self.total_bytes,
            "weights_bytes": self.weights_bytes,
            "kv_bytes": self.kv_bytes,
            "compute_bytes": self.compute_bytes,
            "process_bytes": self.process_bytes,
            "repacked_bytes": self.repacked_bytes,
            "ctx": self.ctx,
            "kv_type": self.kv_type,
        }


def kv_bytes_per_token(shape: ModelShape, kv_type: str = "f16") -> int:
    if not (shape.head_count and shape.embedding_length and shape.block_count):
        return 0
    head_dim = shape.embedding_length // shape.head_count
    n_kv = shape.head_count_kv or shape.head_count
    return int(2 * shape.block_count * n_kv * head_dim * KV_BYTES_PER_ELEM.get(kv_type, 2.0))


def estimate(
    shape: ModelShape,
    *,
    ctx: int = DEFAULT_CTX,
    kv_type: str = "f16",
    n_ubatch: int = DEFAULT_UBATCH,
    features: Optional[Sequence[str]] = None,
    flash_attn: bool = True,
) -> MemoryEstimate:
    """Peak memory of one process holding this model at `ctx` with a `kv_type` cache
    (`features`: the CPU's, llama.cpp spelling; this machine's when None; `flash_attn`: as the context
    runs, `flash_attn_default()` unless the caller chose)."""
    ub = max(1, min(n_ubatch, ctx))
    n_vocab = shape.vocab_size or 32000
    n_head = shape.head_count or 1
    n_embd = shape.embedding_length or 0
    # The graph's biggest live tensors: the logits, or without flash attention the attention
    # scores and their softmax (~15% more at long ctx); plus a few activation rows.
    scores = 0 if flash_attn else int(1.15 * ctx * n_head)
    compute = 4 * ub * max(n_vocab, scores) + 3 * 4 * ub * n_embd
    return MemoryEstimate(
        weights_bytes=int(shape.tensor_bytes),
        kv_bytes=kv_bytes_per_token(shape, kv_type) * ctx,
        compute_bytes=compute,
        process_bytes=PROCESS_BYTES,
        ctx=ctx,
        kv_type=kv_type,
        n_layers=shape.block_count,
        repacked_bytes=repacked_bytes(shape, features),
    )


def repacked_bytes(shape: ModelShape, features: Optional[Sequence[str]] = None) -> int:
    """The anonymous copy llama.cpp's CPU backend makes of this model's repackable weights."""
    candidates = getattr(shape, "repack_candidate_bytes", None)
    if not candidates:
        return 0
    kinds = repacked_types(features)
    return sum(n for t, n in candidates.items() if t in kinds)


@dataclass(frozen=True)
class Shape:
    """A `ModelShape` of plain numbers: a GGUF header's with other weights
    (all shards of a split model), or a guess from size and parameters."""

    tensor_bytes: int
    block_count: int
    embedding_length: int
    head_count: int
    head_count_kv: int
    vocab_size: int

    @classmethod
    def of(cls, shape: ModelShape, *, tensor_bytes: Optional[int] = None) -> Shape:
        return cls(
            shape.tensor_bytes if tensor_bytes is None else tensor_bytes,
            shape.block_count,
            shape.embedding_length,
            shape.head_count,
            shape.head_count_kv,
            shape.vocab_size,
        )


# What the estimate reads: a GGUF header, or a Shape of plain numbers.
ModelShape = Union[GGUFInfo, "Shape"]


def shape_from_size(size_bytes: int, parameters: int) -> Shape:
    """A rough shape for a model known only by size and parameters (a catalog
    entry not downloaded yet). Only the KV cache depends on the guess; once
    the GGUF header is known, the real shape is used."""
    # ~12 x layers x width^2 parameters, layers growing slowly with size;
    # grouped-query attention with 4 query heads per KV head.
    n_layer = max(12, min(80, int(round(4.2 * (parameters / 1e6) ** 0.25))))
    n_embd = max(512, int((parameters / (12 * n_layer)) ** 0.5) // 64 * 64)
    n_head = max(8, n_embd // 128)
    return Shape(int(size_bytes), n_layer, n_embd, n_head, max(1, n_head // 4), 128000)


def weights_room(shape: ModelShape, ram: int, *, ctx: int = DEFAULT_CTX, kv_type: str = "f16") -> int:
    """The most weight bytes a model of this shape can have and still fit `ram` at `ctx`: the same
    estimate as the load guard, solved for the weights (`quantize --budget ram`, `recommend`)."""
    return max(0, ram - estimate(Shape.of(shape, tensor_bytes=0), ctx=ctx, kv_type=kv_type).total_bytes)


def default_threads() -> int:
    """Physical cores: llama.cpp gains nothing from SMT siblings."""
    try:
        import psutil

        n = psutil.cpu_count(logical=False) or os.cpu_count() or 1
    except Exception:
        n = os.cpu_count() or 1
    return max(1, int(n))


def available_ram() -> int:
    override = os.environ.get("EDGELLM_FAKE_AVAILABLE_RAM")
    if override:  # lets tests exercise the guard without a machine that is short of RAM
        return int(override)
    import psutil

    return int(psutil.virtual_memory().available)


def fit_mark(need: int, ram: int) -> str:
    """✓ fits with room, ~ tight (over 80% of `ram`), ✗ does not fit: the TUI's and `models list`'s mark."""
    if need <= 0.8 * ram:
        return "✓"
    return "~" if need <= ram else "✗"


def check_fits(est: MemoryEstimate, what: str, *, force: bool = False, available: Optional[int] = None, warn=None) -> None:
    """Refuse a load that would not fit in RAM, unless forced.

    mmap would let such a model start, then page weights in and out of disk
    for every token: minutes per reply.
    """
    avail = available_ram() if available is None else available
    if est.total_bytes <= avail:
        return
    msg = f"{what} {est.describe()}, {human_size(avail)} available"
    if not force:
        raise InsufficientResources(f"{msg}; use a smaller level or --ctx, or --force")
    if warn is not None:
        warn(f"{msg}; loading anyway (--force)")
