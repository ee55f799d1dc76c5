"""Small synthetic GGUF files that pass edgellm's read_gguf, for tests where speed matters."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def tiny_gguf(path: Path, *, embd: int = 64, vocab: int = 256, layers: int = 2, ftype: int = 7,
              pad_mib: float = 0, seed: int = 0, split_max_tensors: int = 0) -> Path:
    """A llama-arch GGUF with `pad_mib` MiB of extra tensor data (ftype 7 = Q8_0 label).

    With `split_max_tensors`, gguf-py writes a split set `<stem>-0000i-of-0000N.gguf`
    instead; the first shard's path is returned.
    """
    import gguf

    path = Path(path)
    kw = {"split_max_tensors": split_max_tensors} if split_max_tensors else {}
    w = gguf.GGUFWriter(str(path), "llama", **kw)
    w.add_context_length(512)
    w.add_embedding_length(embd)
    w.add_block_count(layers)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_file_type(ftype)
    w.add_tokenizer_model("llama")
    w.add_token_list([f"t{i}" for i in range(vocab)])
    rng = np.random.default_rng(seed)
    w.add_tensor("token_embd.weight", rng.standard_normal((vocab, embd), dtype=np.float32))
    for i in range(layers):
        w.add_tensor(f"blk.{i}.attn_q.weight", rng.standard_normal((embd, embd), dtype=np.float32))
    if pad_mib:
        rows = max(1, int(pad_mib * (1 << 20)) // (4 * embd))
        w.add_tensor("pad.weight", rng.standard_normal((rows, embd), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    if split_max_tensors:
        return sorted(path.parent.glob(path.stem + "-00001-of-*.gguf"))[0]
    return path
