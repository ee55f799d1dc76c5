"""A loaded llama.cpp model: options, streaming, cancel, KV reuse, counters.

One `Runtime` wraps one `llama_cpp.Llama`. Chat, bench, the server and the
TUI all drive models through it, so options (threads, ctx, GPU layers, mmap,
KV type) mean the same everywhere.

Generation runs edgellm's own decode loop (`edgellm.engine.decode`) on the
llama.cpp context llama-cpp-python created: the runtime remembers which
tokens the KV cache holds, keeps the longest common prefix with the next
prompt and evaluates only the rest, so turn N of a conversation evaluates
only its new tokens (`GenerationStats` says how many).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Generator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

from edgellm.engine import backends, hardware
from edgellm.engine.gpu_load import allocation_report, load_llama
from edgellm.engine.memory import KV_BYTES_PER_ELEM as KV_BYTES_PER_ELEMENT  # one table for the load guard and /stats
from edgellm.engine.memory import check_fits, default_threads, estimate, flash_attn_default, kv_bytes_per_token
from edgellm.engine.native_io import capture_native_stderr, silence_native_stderr
from edgellm.engine.options import KV_TYPES, GenerationStats, RuntimeOptions, SamplingParams, resolve_gpu_layers
from edgellm.engine.speculative import FA_TILE
from edgellm.errors import Cancelled, UsageError
from edgellm.gguf.reader import read_gguf
from edgellm.progress import CancelToken

if TYPE_CHECKING:
    from edgellm.engine.decode import Batch  # imported where the first stream needs it

log = logging.getLogger(__name__)


class Runtime:
    """One model loaded in llama.cpp."""

    # Set by _engine() on the first stream, per llama.cpp context: the tokens the KV cache holds,
    # and the decode batch allocated for that context.
    _kv: list[int]
    _batch: Optional[Batch]
    _batch_ctx: Any

    # long: the load is one sequence: validate, size (RAM, GPU, RPC plans), load, fall back to the CPU; split, the order would hide
    def __init__(
        self,
        path: Path | str,
        options: Optional[RuntimeOptions] = None,
        *,
        validate: bool = True,
        warn: Optional[Callable[[str], None]] = None,
        on_plan: Optional[Callable[[Any], None]] = None,
        rpc_plan: Any = None,
    ) -> None:
        self.path = Path(path)
        self.options = opts = options or RuntimeOptions()
        if opts.kv_type not in KV_TYPES:
            raise UsageError(f"unknown KV cache type {opts.kv_type!r} (expected one of {', '.join(KV_TYPES)})")
        # llama.cpp needs flash attention for a quantized V cache
        fa = (
            opts.flash_attn
            if opts.flash_attn is not None
            else flash_attn_default(resolve_gpu_layers(opts.n_gpu_layers, warn=lambda _m: None), bool(opts.rpc))
        )
        self.flash_attn = fa or opts.kv_type != "f16"
        self.info = read_gguf(self.path) if validate else None
        self.memory = None  # the MemoryEstimate the load guard checked (None without validation)
        if self.info is not None:
            from edgellm.gguf.reader import check_tensor_data

            check_tensor_data(self.path)
            self.memory = estimate(
                self.info, ctx=opts.n_ctx, kv_type=opts.kv_type, n_ubatch=opts.n_ubatch, flash_attn=self.flash_attn
            )
            if not opts.rpc:  # split across workers: the RPC plan checks each device's share, this machine's too
                check_fits(self.memory, self.path.name, force=opts.force, warn=warn or log.warning)
        if opts.n_ctx < 8:
            raise UsageError(f"context size {opts.n_ctx} is too small")

        # portable build: load its CPU variant (self-tested with this model the first time) before llama.cpp looks for one
        backends.ensure(self.path, tester=hardware.self_test)
        backends.keep_batch_invariant(FA_TILE)  # replies must not depend on drafts or batch-mates

        n_threads = opts.n_threads or default_threads()
        kw: dict[str, Any] = dict(
            model_path=str(self.path),
            n_ctx=opts.n_ctx,
            n_batch=min(opts.n_batch, opts.n_ctx),
            n_ubatch=min(opts.n_ubatch, opts.n_batch, opts.n_ctx),
            n_threads=n_threads,
            n_threads_batch=opts.n_threads_batch or n_threads,
            n_gpu_layers=0 if self.info is not None else resolve_gpu_layers(opts.n_gpu_layers, warn=warn or log.warning),
            use_mmap=opts.use_mmap,
            use_mlock=opts.use_mlock,
            seed=opts.seed,
            logits_all=opts.logits_all,
            verbose=opts.verbose,
        )
        kw["flash_attn"] = self.flash_attn
        if opts.kv_type != "f16":
            kw["type_k"] = KV_TYPES[opts.kv_type]
            kw["type_v"] = KV_TYPES[opts.kv_type]
        # The offload plan (edgellm.engine.gpu): layers, device and bytes, decided before loading.
        self.gpu_plan = None
        if self.info is not None and not opts.rpc:  # with --rpc the RPC plan places the layers
            from edgellm.engine.gpu import plan_offload

            self.gpu_plan = plan_offload(
                self.path,
                self.info,
                opts.n_gpu_layers,
                ctx=opts.n_ctx,
                kv_type=opts.kv_type,
                n_ubatch=kw["n_ubatch"],
                gpu_device=opts.gpu_device,
                gpu_mem=opts.gpu_mem,
            )
            for note in self.gpu_plan.notes:
                (warn or log.warning)(note)
            if on_plan is not None:
                on_plan(self.gpu_plan)
            kw.update(self.gpu_plan.llama_kwargs())
        t0 = time.perf_counter()

        self.rpc_plan = None
        if opts.rpc:  # layers on llama.cpp RPC workers: planned (and the workers probed) before anything loads
            from edgellm.engine import rpc_native

            self.rpc_plan = rpc_plan or rpc_native.plan_for(self.path, opts)
        with rpc_native.loading(self.rpc_plan, kw) if self.rpc_plan is not None else contextlib.nullcontext():
            self.llm, self.load_log, self.gpu_plan = load_llama(
                kw,
                self.gpu_plan,
                name=self.path.name,
                quiet=silence_native_stderr,
                verbose=opts.verbose,
                warn=warn or log.warning,
            )
        self.n_gpu_layers = self.gpu_plan.n_gpu_layers if self.gpu_plan is not None else kw["n_gpu_layers"]
        self.load_seconds = time.perf_counter() - t0
        self.n_threads = n_threads
        self.threads_pinned = opts.n_threads is not None
        self.draft_runtime: Optional[Runtime] = None  # attach_draft
        self._governor: Any = None
        self.verify_cost: Any = None  # this machine's verify-step cost (engine.speculative.VerifyCost), learned across replies
        self._spec_memory: list[list[int]] = []  # earlier replies' tokens, drafted from like the prompt
        self._draft_prior: dict[str, Any] = {}  # per draft mode: the acceptance the last sequence ended with

    # -- tokens ------------------------------------------------------------

    def tokenize(self, text: str, *, add_bos: bool = True, special: bool = True) -> list[int]:
        return self.llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=special)

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self.llm.detokenize(list(tokens)).decode("utf-8", "replace")

    @property
    def n_ctx(self) -> int:
        return self.llm.n_ctx()

    @property
    def n_cached(self) -> int:
        """Tokens currently held in the KV cache."""
        return len(getattr(self, "_kv", ()))

    def kv_cache_bytes(self, n_ctx: Optional[int] = None, *, kv_type: Optional[str] = None) -> int:
        """K and V for all layers at `n_ctx` tokens (the whole context by default) in the cache type."""
        if self.info is None:
            return 0
        kt = kv_type or self.options.kv_type
        return kv_bytes_per_token(self.info, kt) * (self.n_ctx if n_ctx is None else n_ctx)

    def state_bytes(self) -> int:
        """llama.cpp's own size of the context state (logits + the used KV cells, in the cache type)."""
        import llama_cpp

        return int(llama_cpp.llama_state_get_size(self.llm.ctx))

    def gpu_report(self) -> dict[str, Any]:
        """The offload plan and what llama.cpp reported allocating on the device and the host (its load log)."""

        return allocation_report(self.gpu_plan, getattr(self, "load_log", ""), self.n_gpu_layers)

    @property
    def add_bos(self) -> bool:
        """Whether the vocab wants a BOS token in front of a prompt."""
        import llama_cpp

        return bool(llama_cpp.llama_vocab_get_add_bos(self.llm._model.vocab))

    def token_bos(self) -> int:
        return int(self.llm.token_bos())

    def token_text(self, token: int) -> str:
        """The text of a token, special tokens included (for templates: bos_token, eos_token)."""
        if token is None or token < 0:
            return ""
        return self.token_piece(token).decode("utf-8", "replace")

    def token_piece(self, token: int) -> bytes:
        """The bytes a token renders to, special tokens as their text."""
        import ctypes

        import llama_cpp

        size = 64
        while True:
            buf = ctypes.create_string_buffer(size)
            n = llama_cpp.llama_token_to_piece(self.llm._model.vocab, llama_cpp.llama_token(token), buf, size, 0, True)
            if n >= 0:
                return buf.raw[:n]
            size = -n + 1

    def cached_tokens(self) -> list[int]:
        """The token sequence now held in the KV cache (sequence 0, the one `stream` uses)."""
        return list(getattr(self, "_kv", ()))

    def check_grammar(self, gbnf: str) -> None:
        """Parse a GBNF grammar with llama.cpp's parser; a bad one → one-line UsageError."""
        from edgellm.engine.decode import check_grammar  # lazy: loads jinja2, llama_cpp, numpy

        check_grammar(self.llm._model.vocab, gbnf)

    def reset(self) -> None:
        """Forget the KV cache."""
        import llama_cpp

        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.llm.ctx), True)
        self._kv = []

    def perf_counters(self) -> tuple[int, int]:
        """(prompt tokens evaluated, tokens generated) since the last reset, from llama.cpp."""
        import llama_cpp

        d = llama_cpp.llama_perf_context(self.llm.ctx)
        return int(d.n_p_eval), int(d.n_eval)

    def _reset_perf(self) -> None:
        import llama_cpp

        llama_cpp.llama_perf_context_reset(self.llm.ctx)

    # -- generation --------------------------------------------------------

    def _engine(self) -> tuple[Any, Any, Any]:
        """(ctx, vocab, batch) for the decode loop; the batch is allocated once per context."""
        ctx = self.llm.ctx
        if getattr(self, "_batch_ctx", None) is not ctx:
            from edgellm.engine.decode import Batch

            self._batch = Batch(max(1, min(self.options.n_batch, self.n_ctx)))
            self._batch_ctx = ctx
            self._kv = []
        return ctx, self.llm._model.vocab, self._batch

    def _room(self, prompt: list[int], s: SamplingParams) -> int:
        """How many tokens the reply may have: max_tokens, bounded by what the context leaves after the prompt."""
        if not prompt:
            raise UsageError("empty prompt")
        n_ctx = self.n_ctx
        if len(prompt) >= n_ctx:
            raise UsageError(f"the prompt is {len(prompt)} tokens but the context holds {n_ctx}; raise --ctx or shorten it")
        return min(s.max_tokens if s.max_tokens and s.max_tokens > 0 else n_ctx, n_ctx - len(prompt))

    # long: one reply in one frame: KV reuse, the decode loop and the timing that `finally` fills from its locals
    def stream(
        self,
        prompt_tokens: Sequence[int],
        sampling: Optional[SamplingParams] = None,
        *,
        cancel: Optional[CancelToken] = None,
        stats: Optional[GenerationStats] = None,
    ) -> Generator[str, None, None]:
        """Yield text pieces as they are generated; fill `stats` as it goes.

        Only the tokens past the longest prefix already in the KV cache are
        evaluated. Cancelling stops after the current token; the KV cache then
        holds the prompt and what was generated, and the runtime stays usable.
        With `sampling.draft` set, steps verify drafted tokens (engine.speculative):
        the reply is the one decoding without drafts gives.
        """
        from edgellm.engine.decode import Sampler, TextStream, decode_prompt  # lazy: loads jinja2, llama_cpp, numpy
        from edgellm.engine.generate import generate

        s = sampling or SamplingParams()
        st = stats if stats is not None else GenerationStats()
        prompt = list(prompt_tokens)
        n_ctx = self.n_ctx
        max_new = self._room(prompt, s)
        ctx, vocab, batch = self._engine()

        spec = self._speculator(s, prompt)
        governor = self.governor()
        keep = self.trim_kv(prompt)
        # Without a seed, fall back to the load-time seed (random by default) so
        # one seeded call does not make every later call deterministic.
        sampler = Sampler(vocab, s, default_seed=self.options.seed)
        text = TextStream(vocab, s.stop)
        st.prompt_tokens, st.reused_tokens, st.evaluated_prompt_tokens = len(prompt), keep, len(prompt) - keep
        st.stop_reason, st.draft = "length", s.draft if spec is not None else "off"
        st.threads = governor.threads if governor is not None else self.n_threads
        self._reset_perf()
        kv = self._kv
        t0 = time.perf_counter()
        try:
            if not decode_prompt(ctx, batch, prompt[keep:], keep, cancel=cancel):
                st.stop_reason = "cancelled"
                return
            kv.extend(prompt[keep:])
            if spec is not None:
                spec.drafter.prefill()
            yield from generate(
                ctx,
                vocab,
                batch,
                kv,
                sampler,
                text,
                st,
                max_new=max_new,
                n_ctx=n_ctx,
                t0=t0,
                cancel=cancel,
                spec=spec,
                governor=governor,
            )
        finally:
            sampler.close()
            now = time.perf_counter()
            if st.ttft_seconds:
                st.generation_seconds = now - t0 - st.ttft_seconds
            else:
                st.prompt_seconds = now - t0
            if spec is not None:
                self._remember(kv[len(prompt) :])
                self._draft_prior[st.draft] = (spec.policy.hits, spec.policy.misses)
        tail = text.flush()
        if tail:
            yield tail

    def trim_kv(self, tokens: Sequence[int]) -> int:
        """Cut the KV cache to the longest prefix it shares with `tokens`, less their last token (decoded
        again when everything matched: its logits are needed); the cells kept, which `tokens` need not decode."""
        import llama_cpp

        from edgellm.engine.decode import common_prefix

        keep = min(common_prefix(self._kv, tokens), len(tokens) - 1)
        llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(self._engine()[0]), 0, keep, -1)
        del self._kv[keep:]
        return keep

    # -- speculative decoding and threads ------------------------------------

    def attach_draft(self, draft: Optional[Runtime]) -> None:
        """Use `draft` (same vocabulary, else DraftMismatch naming what differs) for `SamplingParams(draft="model")`."""
        if draft is not None:
            from edgellm.engine.draft_model import check_compatible

            check_compatible(self, draft, names=(self.path.name, draft.path.name))
        self.draft_runtime = draft

    def _speculator(self, s: SamplingParams, prompt: list[int]) -> Any:
        mode = (s.draft or self.options.draft or "off").lower()
        if mode == "off":
            return None
        from edgellm.engine.draft_model import ModelDrafter
        from edgellm.engine.speculative import DEFAULT_DRAFT_MAX, DRAFT_MODES, NgramDrafter, Speculator, VerifyCost

        if mode not in DRAFT_MODES:
            raise UsageError(f"unknown draft mode {s.draft!r} (expected one of {', '.join(DRAFT_MODES)})")
        if self.verify_cost is None:
            self.verify_cost = VerifyCost()
        if mode == "model":
            if self.draft_runtime is None:
                raise UsageError("draft='model' needs a draft model (Runtime.attach_draft, --draft MODEL)")
            drafter: Any = ModelDrafter(self.draft_runtime)
        else:
            from edgellm.engine.decode import ends_reply

            drafter = NgramDrafter(is_end=ends_reply(self.llm._model.vocab))
        drafter.reset(prompt, self._spec_memory)
        return Speculator(
            drafter, draft_max=s.draft_max or DEFAULT_DRAFT_MAX, cost=self.verify_cost, prior=self._draft_prior.get(mode)
        )

    def forget_drafts(self) -> None:
        """Forget the earlier replies drafts come from and the acceptance they ended with (not the
        verify cost, which is the machine's): the next reply drafts as a fresh process's first would."""
        self._spec_memory = []
        self._draft_prior = {}

    def _remember(self, reply: list[int], budget: int = 8192) -> None:
        """Keep earlier replies (at most `budget` tokens) to draft from, as llama-server's shared n-gram table does."""
        if len(reply) < 4:
            return
        mem = self._spec_memory
        mem.append(list(reply))
        while sum(len(r) for r in mem) > budget and len(mem) > 1:
            mem.pop(0)

    def governor(self) -> Any:
        """The thread governor of this context (None when --threads pins the count)."""
        if self.threads_pinned or self.options.rpc:
            return None
        ctx = self.llm.ctx
        if self._governor is None or self._governor.ctx is not ctx:
            from edgellm.engine.threads import ThreadGovernor

            self._governor = ThreadGovernor(ctx, self.n_threads)
        return self._governor

    @property
    def threads_now(self) -> int:
        """The threads the next token runs on (for status lines)."""
        return self._governor.threads if self._governor is not None else self.n_threads

    def complete(
        self, prompt_tokens: Sequence[int], sampling: Optional[SamplingParams] = None, *, cancel: Optional[CancelToken] = None
    ) -> tuple[str, GenerationStats]:
        st = GenerationStats()
        text = "".join(self.stream(prompt_tokens, sampling, cancel=cancel, stats=st))
        return text, st

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is not None:
            batch = getattr(self, "_batch", None)
            if batch is not None:
                batch.close()
                self._batch = self._batch_ctx = None
            llm.close()
            self.llm = None  # type: ignore[assignment]

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = [
    "Runtime",
    "RuntimeOptions",
    "SamplingParams",
    "GenerationStats",
    "default_threads",
    "resolve_gpu_layers",
    "Cancelled",
    "KV_TYPES",
    "KV_BYTES_PER_ELEMENT",
    "silence_native_stderr",
    "capture_native_stderr",
]
