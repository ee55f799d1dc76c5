"""A tiny, genuinely float llama written with gguf-py, for tests and fuzzing.

Gaussian weights (seeded), rows a multiple of 256 so every K-quant applies
without fallback, a byte-level SentencePiece-style vocabulary that llama.cpp
accepts (259 tokens: <unk>, <s>, </s> and the 256 byte tokens), F32 norms.
A few MB: cheap to write hundreds of times.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np


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
) -> Path:
    import gguf

    path = Path(path)
    rng = np.random.default_rng(seed)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    n_vocab = len(tokens)
    w = gguf.GGUFWriter(str(path), "llama")
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
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * n_vocab)
    types = [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL] + [gguf.TokenType.BYTE] * 256
    w.add_token_types([int(t) for t in types])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_add_bos_token(True)
    if chat_template:
        w.add_chat_template(chat_template)

    np_dtype = np.float16 if dtype == "f16" else np.float32

    def mat(rows: int, cols: int) -> np.ndarray:
        # numpy shape (rows, cols) is GGUF shape [cols, rows]: cols is the row width
        return (rng.standard_normal((rows, cols)) * std).astype(np_dtype)

    w.add_tensor("token_embd.weight", mat(n_vocab, n_embd))
    w.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    w.add_tensor("output.weight", mat(n_vocab, n_embd))
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
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


if __name__ == "__main__":  # pragma: no cover
    import sys

    print(write_tiny_llama(sys.argv[1] if len(sys.argv) > 1 else "tiny.gguf"))
