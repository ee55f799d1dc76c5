"""edgellm convert: dequantize the real default model (Q4_1) to F16 with gguf-py."""

from __future__ import annotations

import ctypes
import json

import pytest
from support.helpers import DEFAULT_NAME, CancelAfter, assert_refused, store_snapshot
from support.quant_fixtures import F16_NAME


def test_f16_of_default_model_keeps_metadata_and_types(f16_session, default_gguf):
    from edgellm.gguf.reader import read_gguf

    result, _home = f16_session
    src, out = read_gguf(default_gguf), read_gguf(result.path)
    assert result.name == F16_NAME and result.level == "f16" and result.source_level == "q4_1"
    assert result.path.name == f"{F16_NAME}.gguf" and result.path.parent.name == F16_NAME
    # 1-D norms stay F32, everything else (token_embd included) becomes F16
    assert out.tensor_types == {"F16": 211, "F32": 61}
    assert out.tensor_count == src.tensor_count == 272 and out.parameters == src.parameters
    assert out.file_type == 1 and out.level == "f16"
    assert 16.0 <= out.bpw < 16.01
    # every scalar KV kept except the file type; the chat template and vocabulary too
    changed = {k for k in src.metadata if src.metadata[k] != out.metadata.get(k)}
    assert changed == {"general.file_type"}
    assert set(out.metadata) == set(src.metadata)
    assert out.chat_template == src.chat_template and out.chat_template
    assert out.vocab_size == src.vocab_size == 49152
    # lineage: the record says it was dequantized from q4_1
    rec = result.record
    assert rec.parent == DEFAULT_NAME and rec.level == "f16" and rec.source == "convert"
    assert rec.extra["dequantized_from"] == "q4_1" and "q4_1" in rec.extra["lineage_warning"]


def test_f16_tensors_equal_llama_cpps_own_dequantization(f16_session, default_gguf, tmp_path):
    """llama.cpp requantizing Q4_1 to F16 must give the same tensor bytes as gguf-py's dequantize."""
    import llama_cpp
    import numpy as np
    from gguf import GGUFReader

    result, _home = f16_session
    ref = tmp_path / "llama-f16.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_F16
    params.nthread = 2
    params.allow_requantize = True
    assert llama_cpp.llama_model_quantize(str(default_gguf).encode(), str(ref).encode(), ctypes.byref(params)) == 0
    ours = {t.name: t for t in GGUFReader(result.path).tensors}
    theirs = {t.name: t for t in GGUFReader(ref).tensors}
    assert set(ours) == set(theirs)
    differing = [
        n for n in ours if ours[n].tensor_type != theirs[n].tensor_type or not np.array_equal(ours[n].data, theirs[n].data)
    ]
    assert differing == []


def test_f16_generates_like_its_q4_1_parent(f16_session, default_gguf):
    from edgellm.engine.runtime import Runtime, RuntimeOptions, SamplingParams

    result, _home = f16_session
    outs = []
    for path in (default_gguf, result.path):
        rt = Runtime(path, RuntimeOptions(n_ctx=256, n_threads=2))
        try:
            toks = rt.tokenize("The capital of France is")
            outs.append((toks, "".join(rt.stream(toks, SamplingParams(temperature=0.0, max_tokens=4, seed=1)))))
        finally:
            rt.close()
    assert outs[0][0] == outs[1][0]  # same tokenizer
    # same weights, different kernels (Q4_1 dot products quantize the activations):
    # the answer agrees, later tokens may drift apart at near-ties
    assert outs[0][1].startswith(" Paris") and outs[1][1].startswith(" Paris"), outs


def test_convert_cli_refuses_existing_output_and_lists_lineage(cli, f16_model, edgellm_home):
    assert_refused(cli, edgellm_home, "convert", DEFAULT_NAME, "--to", "f16", says=["already exists", "--force"])
    models = {m["name"]: m for m in cli("models", "list", "--json").json()["models"]}
    assert models[F16_NAME]["parent"] == DEFAULT_NAME and models[F16_NAME]["level"] == "f16"


@pytest.mark.parametrize("args, needle", [(["--to", "q4_0"], "f16, bf16 or f32"), (["--to", "f17"], "unknown level")])
def test_convert_bad_target(cli, default_model, edgellm_home, args, needle):
    assert_refused(cli, edgellm_home, "convert", DEFAULT_NAME, *args, says=needle)


def test_convert_same_type_and_text_file(cli, f16_model, edgellm_home, tmp_path):
    text = tmp_path / "notes.gguf"
    text.write_text("just some text, not a model\n")
    assert_refused(cli, edgellm_home, "convert", F16_NAME, "--to", "f16", says="already f16")
    assert_refused(cli, edgellm_home, "convert", str(text), "--to", "f16", says="not a GGUF")


def test_convert_cancel_leaves_nothing(default_model, edgellm_home):
    from edgellm.errors import Cancelled
    from edgellm.models.store import Store
    from quant.convert import convert

    stop = CancelAfter(20)
    before = store_snapshot(edgellm_home)
    with pytest.raises(Cancelled):
        convert(DEFAULT_NAME, "bf16", on_progress=stop, cancel=stop.token)
    assert max(stop.seen) == 20
    assert store_snapshot(edgellm_home) == before
    assert not list(edgellm_home.rglob("*.partial"))
    assert Store().find("smollm2-135m-instruct-bf16") is None


def test_convert_json(cli, f16_session):
    # the JSON shape scripts rely on, from the session's result
    result, _home = f16_session
    d = json.loads(json.dumps(result.to_json()))
    for key in ("name", "level", "path", "size_bytes", "bpw", "tensor_types", "source_level", "parent", "seconds", "sha256"):
        assert key in d
    assert d["size_bytes"] == result.path.stat().st_size
