"""What a caller chooses for a model and a reply, and what a reply reports.

`RuntimeOptions` (how a model is loaded), `SamplingParams` (how one reply is
sampled) and `GenerationStats` (what it cost) are plain dataclasses, apart from
`engine.runtime` so that the server, the chat session and the TUI can name them
without importing the runtime that loads llama.cpp.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Union

from edgellm.engine.memory import DEFAULT_CTX
from edgellm.errors import UsageError

log = logging.getLogger(__name__)

KV_TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "bf16": 30}


@dataclass
class RuntimeOptions:
    # context
    n_ctx: int = DEFAULT_CTX
    n_batch: int = 512
    n_ubatch: int = 512
    # threads
    n_threads: Optional[int] = None  # None: physical cores, fewer while other processes take cores (engine.threads)
    n_threads_batch: Optional[int] = None
    # memory / offload
    n_gpu_layers: Union[int, str] = 0  # int, or "auto"/"all"
    gpu_device: Optional[str] = None  # index or name (edgellm.engine.gpu.find_device); None: auto, never a software device
    gpu_mem: Optional[int] = None  # bytes edgellm may use on the device
    use_mmap: bool = True
    use_mlock: bool = False
    kv_type: str = "f16"
    flash_attn: Optional[bool] = None  # None: engine.memory.flash_attn_default (on where every layer runs on the CPU)
    # misc
    seed: int = 0xFFFFFFFF
    logits_all: bool = False
    verbose: bool = False
    force: bool = False  # load even when weights + KV exceed available RAM
    draft: str = "off"  # speculative decoding for requests that do not choose (SamplingParams.draft ""): serve --draft
    # llama.cpp RPC workers (edgellm.engine.rpc): HOST:PORT[,...], and --split shares (this machine first)
    rpc: Optional[str] = None
    rpc_split: Optional[str] = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class SamplingParams:
    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.95
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    seed: Optional[int] = None
    max_tokens: int = 512
    stop: list[str] = field(default_factory=list)
    grammar: Any = None  # a llama_cpp.LlamaGrammar
    # speculative decoding (engine.speculative): "off", "ngram", or "model" (the runtime's attached draft model)
    draft: str = "off"
    draft_max: int = 0  # most drafted tokens per step; 0: the default (48)
    # end-of-generation tokens are never sampled (llama-server's `ignore_eos`): a reply runs to max_tokens
    ignore_eos: bool = False


@dataclass
class GenerationStats:
    prompt_tokens: int = 0  # tokens in the whole prompt sent this turn
    evaluated_prompt_tokens: int = 0  # of those, how many llama.cpp actually evaluated
    reused_tokens: int = 0  # prompt tokens served from the KV cache
    generated_tokens: int = 0
    ttft_seconds: float = 0.0
    prompt_seconds: float = 0.0
    generation_seconds: float = 0.0
    stop_reason: str = ""  # "eos", "stop", "length", "cancelled"
    # filled by edgellm.chat.session: the turn's place in the context window
    dropped_turns: int = 0  # oldest turns dropped this turn because the context was full
    kv_tokens: int = 0  # tokens held in the KV cache after the turn
    context_size: int = 0
    # speculative decoding, as llama-server counts it: drafted tokens, accepted ones, verification steps
    draft: str = "off"
    draft_tokens: int = 0
    draft_accepted: int = 0
    draft_steps: int = 0
    draft_accepted_per_pos: list[int] = field(default_factory=list)
    threads: int = 0  # the thread count at the end of the reply (it follows the machine unless pinned)

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.generation_seconds if self.generation_seconds > 0 else 0.0

    @property
    def prompt_tokens_per_second(self) -> float:
        return self.evaluated_prompt_tokens / self.prompt_seconds if self.prompt_seconds > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["tokens_per_second"] = round(self.tokens_per_second, 3)
        d["prompt_tokens_per_second"] = round(self.prompt_tokens_per_second, 3)
        return d


def resolve_gpu_layers(value: Union[int, str], *, warn: Callable[[str], None] = log.warning) -> int:
    """`auto` and `all` → all layers when a GPU backend exists, else 0; N on a CPU-only build → 0 with one warning."""
    import llama_cpp

    from edgellm.engine import backends

    backends.load_devices()  # a portable build's GPU backends, before llama.cpp is asked about them
    gpu = bool(llama_cpp.llama_supports_gpu_offload())
    if isinstance(value, str):
        if value.strip().lower() in ("auto", "all"):
            return -1 if gpu else 0
        try:
            value = int(value)
        except ValueError:
            raise UsageError(f"--gpu-layers takes a number, 'auto', 'all' or 0, not {value!r}") from None
    if value != 0 and not gpu:
        warn("this llama.cpp build has no GPU backend (CPU-only); running on the CPU")
        return 0
    return value
