"""A tiny llama GGUF with Gaussian weights, written with gguf-py, for tests.

A genuinely float base (unlike the default model, whose F16 is dequantized
from Q4_1): rows are multiples of 256 so every K-quant applies to every
tensor, and a byte-level GPT-2 tokenizer (256 byte tokens + BOS/EOS, two
merges) that llama.cpp accepts. 1.4M parameters: a chunk costs milliseconds.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


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


def make_tiny_llama(path: Path, *, n_embd: int = 256, n_layer: int = 2, n_head: int = 4, n_ff: int = 512, seed: int = 0) -> Path:
    """Write an F32 llama GGUF with N(0, s) weights to `path`."""
    import gguf
    rng = np.random.default_rng(seed)
    b2u = bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)] + ["<s>", "</s>"]
    types = [gguf.TokenType.NORMAL] * 256 + [gguf.TokenType.CONTROL] * 2
    n_vocab = len(tokens)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-gaussian")
    w.add_context_length(1024)
    w.add_embedding_length(n_embd)
    w.add_block_count(n_layer)
    w.add_feed_forward_length(n_ff)
    w.add_head_count(n_head)
    w.add_head_count_kv(n_head)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_dimension_count(n_embd // n_head)
    w.add_file_type(0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges([f"{b2u[ord('t')]} {b2u[ord('h')]}", f"{b2u[ord(' ')]} {b2u[ord('t')]}"])
    w.add_bos_token_id(256)
    w.add_eos_token_id(257)
    w.add_add_bos_token(True)

    def g(*shape: int, s: float = 0.02) -> np.ndarray:
        return (rng.standard_normal(shape) * s).astype(np.float32)

    w.add_tensor("token_embd.weight", g(n_vocab, n_embd, s=1.0))
    for i in range(n_layer):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(n_embd, np.float32))
        for t in ("q", "k", "v", "output"):
            w.add_tensor(f"blk.{i}.attn_{t}.weight", g(n_embd, n_embd, s=0.08))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(n_embd, np.float32))
        w.add_tensor(f"blk.{i}.ffn_gate.weight", g(n_ff, n_embd, s=0.08))
        w.add_tensor(f"blk.{i}.ffn_up.weight", g(n_ff, n_embd, s=0.08))
        w.add_tensor(f"blk.{i}.ffn_down.weight", g(n_embd, n_ff, s=0.08))
    w.add_tensor("output_norm.weight", np.ones(n_embd, np.float32))
    w.add_tensor("output.weight", g(n_vocab, n_embd, s=0.15))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
