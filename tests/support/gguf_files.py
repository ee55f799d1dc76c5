"""Synthetic GGUF files for tests and fuzzing: the one place they are written.

Two kinds, one writer underneath:

* `write_tiny_llama`: a genuinely float llama that llama.cpp loads, quantizes
  and runs. Gaussian weights (seeded), rows a multiple of 256 so every K-quant
  applies without fallback, F32 norms, a byte vocabulary that llama.cpp
  accepts: SentencePiece-style by default (259 tokens: <unk>, <s>, </s> and
  the 256 byte tokens), or GPT-2 byte-level BPE (`tokenizer="gpt2"`: 256 byte
  tokens, <s>, </s>, two merges), which llama.cpp tokenizes ~50x faster: use
  it where a whole corpus is tokenized (perplexity, eval). A few MB: cheap to
  write hundreds of times. Unlike the default model, whose F16 is dequantized
  from Q4_1, its base really is float, so quantization errors order by precision.
* `write_stub_gguf`: a GGUF that passes edgellm's reader but is not a working
  model (random tensors, a labelled file type, optional padding, an optional
  split set, any architecture name): for the store, the Hub, bundles and
  llama.cpp's refusals, where only the container matters and speed does.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np

# Scales for `write_tiny_llama(..., peaked=True)`: a large embedding and output
# projection give sharp next-token distributions, so the KL divergence of a
# quantized copy is well above float noise and levels order by precision.
PEAKED = {"embd_std": 1.0, "std": 0.08, "output_std": 0.15}

# What the tests' ppl and eval runs on a tiny llama pass: chunks small enough for a few KB of text, quick.
TINY_EVAL_ARGS = ["--ctx", "64", "--chunks", "2", "--batch", "128"]


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table (the byte-level BPE alphabet)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def _write(path: Path, arch: str, fill: Callable, *, split_max_tensors: int = 0) -> Path:
    import gguf

    kw = {"split_max_tensors": split_max_tensors} if split_max_tensors else {}
    w = gguf.GGUFWriter(str(path), arch, **kw)
    fill(w, gguf)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if split_max_tensors:
        # gguf-py writes `<stem>-0000i-of-0000N.gguf` instead: the first shard names the set
        return sorted(path.parent.glob(path.stem + "-00001-of-*.gguf"))[0]
    return path


def write_tiny_llama(
    path: Path | str,
    *,
    n_embd: int = 256,
    n_layer: int = 2,
    n_head: int = 4,
    n_head_kv: int = 4,
    n_ff: int = 512,
    n_ctx: int = 512,
    seed: int = 0,
    dtype: str = "f16",
    chat_template: str | None = None,
    std: float = 0.05,
    embd_std: float | None = None,
    output_std: float | None = None,
    peaked: bool = False,
    tokenizer: str = "spm",
) -> Path:
    """A loadable llama; `peaked=True` uses the `PEAKED` scales (see there)."""
    if peaked:
        std, embd_std, output_std = PEAKED["std"], PEAKED["embd_std"], PEAKED["output_std"]
    path = Path(path)
    rng = np.random.default_rng(seed)
    if tokenizer == "spm":
        tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    elif tokenizer == "gpt2":
        b2u = bytes_to_unicode()
        tokens = [b2u[b] for b in range(256)] + ["<s>", "</s>"]
    else:
        raise ValueError(f"tokenizer {tokenizer!r}: 'spm' or 'gpt2'")
    n_vocab = len(tokens)
    np_dtype = {"f16": np.float16, "f32": np.float32}[dtype]

    def mat(rows: int, cols: int, s: float | None = None) -> np.ndarray:
        # numpy shape (rows, cols) is GGUF shape [cols, rows]: cols is the row width
        return (rng.standard_normal((rows, cols)) * (std if s is None else s)).astype(np_dtype)

    def fill(w, gguf) -> None:
        w.add_name("tiny-llama")
        w.add_context_length(n_ctx)
        w.add_embedding_length(n_embd)
        w.add_block_count(n_layer)
        w.add_feed_forward_length(n_ff)
        w.add_head_count(n_head)
        w.add_head_count_kv(n_head_kv)
        w.add_rope_dimension_count(n_embd // n_head)
        w.add_layer_norm_rms_eps(1e-5)
        w.add_vocab_size(n_vocab)
        ftype = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16}[dtype]
        w.add_file_type(int(ftype))
        w.add_tokenizer_model("llama" if tokenizer == "spm" else "gpt2")
        w.add_tokenizer_pre("default")
        w.add_token_list(tokens)
        if tokenizer == "spm":
            w.add_token_scores([0.0] * n_vocab)
            types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * 256
        else:
            types = [gguf.TokenType.NORMAL] * 256 + [gguf.TokenType.CONTROL] * 2
        w.add_token_types([int(t) for t in types])
        if tokenizer == "spm":
            w.add_bos_token_id(1)
            w.add_eos_token_id(2)
            w.add_unk_token_id(0)
        else:
            w.add_token_merges([f"{b2u[ord('t')]} {b2u[ord('h')]}", f"{b2u[ord(' ')]} {b2u[ord('t')]}"])
            w.add_bos_token_id(256)
            w.add_eos_token_id(257)
        w.add_add_bos_token(True)
        if chat_template:
            w.add_chat_template(chat_template)

        w.add_tensor("token_embd.weight", mat(n_vocab, n_embd, embd_std))
        w.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
        w.add_tensor("output.weight", mat(n_vocab, n_embd, output_std))
        kv_dim = n_embd // n_head * n_head_kv
        for i in range(n_layer):
            p = f"blk.{i}."
            w.add_tensor(p + "attn_norm.weight", np.ones(n_embd, dtype=np.float32))
            w.add_tensor(p + "attn_q.weight", mat(n_embd, n_embd))
            w.add_tensor(p + "attn_k.weight", mat(kv_dim, n_embd))
            w.add_tensor(p + "attn_v.weight", mat(kv_dim, n_embd))
            w.add_tensor(p + "attn_output.weight", mat(n_embd, n_embd))
            w.add_tensor(p + "ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
            w.add_tensor(p + "ffn_gate.weight", mat(n_ff, n_embd))
            w.add_tensor(p + "ffn_up.weight", mat(n_ff, n_embd))
            w.add_tensor(p + "ffn_down.weight", mat(n_embd, n_ff))

    return _write(path, "llama", fill)


def write_stub_gguf(
    path: Path | str,
    *,
    arch: str = "llama",
    layers: int = 2,
    ftype: int = 7,
    pad_mib: float = 0,
    seed: int = 0,
    split_max_tensors: int = 0,
) -> Path:
    """A GGUF of architecture `arch` labelled file type `ftype` (7 = Q8_0) with
    `pad_mib` MiB of extra tensor data; with `split_max_tensors`, a split set
    whose first shard's path is returned."""
    path = Path(path)
    rng = np.random.default_rng(seed)
    embd, vocab = 64, 256  # fixed: callers vary the type, padding and split, never these

    def fill(w, gguf) -> None:
        w.add_context_length(512)
        w.add_embedding_length(embd)
        w.add_block_count(layers)
        w.add_head_count(4)
        w.add_head_count_kv(2)
        w.add_file_type(ftype)
        w.add_tokenizer_model("llama")
        w.add_token_list([f"t{i}" for i in range(vocab)])
        w.add_tensor("token_embd.weight", rng.standard_normal((vocab, embd), dtype=np.float32))
        for i in range(layers):
            w.add_tensor(f"blk.{i}.attn_q.weight", rng.standard_normal((embd, embd), dtype=np.float32))
        if pad_mib:
            rows = max(1, int(pad_mib * (1 << 20)) // (4 * embd))
            w.add_tensor("pad.weight", rng.standard_normal((rows, embd), dtype=np.float32))

    return _write(path, arch, fill, split_max_tensors=split_max_tensors)


if __name__ == "__main__":  # pragma: no cover
    import sys

    print(write_tiny_llama(sys.argv[1] if len(sys.argv) > 1 else "tiny.gguf"))
