"""Hand-off exports (issue 17): `edgellm export NAME --to ollama DIR` and `--to llama-server`.

The Ollama TEMPLATE is rendered by Go's own text/template (scripts/render_ollama_template.go,
the engine Ollama renders with); Go must be installed (Debian: apt-get install -y golang-go).
"""

from __future__ import annotations

import hashlib
import json
import shlex
import subprocess
from pathlib import Path

import pytest
from support.helpers import DEFAULT_NAME, ROOT, assert_one_line_error, store_snapshot

RENDER = ROOT / "scripts" / "render_ollama_template.sh"
THREE_TURNS = [
    {"role": "system", "content": "You are a terse assistant. Answer in one word."},
    {"role": "user", "content": "What colour is the sky?"},
    {"role": "assistant", "content": "Blue."},
    {"role": "user", "content": "And grass?"},
    {"role": "assistant", "content": "Green."},
    {"role": "user", "content": 'And snow? {{ not a template }} "quoted"'},
]


def go_render(modelfile: Path, messages: list[dict]) -> str:
    proc = subprocess.run(
        ["bash", str(RENDER), str(modelfile)],
        input=json.dumps({"messages": messages}),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_ollama_export_renders_with_go_like_edgellm(cli, default_model, tmp_path):
    from edgellm.chat.handoff import check_modelfile, edgellm_render, model_facts

    out = tmp_path / "ollama"
    res = cli("export", DEFAULT_NAME, "--to", "ollama", out, "--json")
    assert res.exit_code == 0, res
    info = res.json()
    gguf, modelfile = Path(info["gguf"]), Path(info["modelfile"])
    assert sorted(p.name for p in out.iterdir()) == sorted([gguf.name, "Modelfile"])
    assert _sha(gguf) == _sha(default_model.path) == info["sha256"]
    text = modelfile.read_text()
    assert check_modelfile(text) == []  # only Ollama's documented directives and parameters
    directives = {
        ln.split()[0] for ln in text.splitlines() if ln.strip() and not ln.startswith(("#", " ")) and ln.split()[0].isupper()
    }
    assert {"FROM", "TEMPLATE", "PARAMETER"} <= directives
    assert f"FROM ./{gguf.name}" in text and 'PARAMETER stop "<|im_end|>"' in text and "PARAMETER num_ctx 4096" in text
    assert "PARAMETER temperature 0.8" in text and "PARAMETER top_k 40" in text
    facts = model_facts(default_model.path, DEFAULT_NAME)
    # the Must-show case: 3 turns with a system prompt; Go's text/template and edgellm's Jinja give one text
    ours = edgellm_render(facts, THREE_TURNS)
    assert go_render(modelfile, THREE_TURNS) == ours
    assert ours.count("<|im_start|>") == 7 and ours.endswith("<|im_start|>assistant\n")
    # without a system prompt the model's template adds its default one, and so does the translation
    no_system = THREE_TURNS[1:]
    assert go_render(modelfile, no_system) == edgellm_render(facts, no_system)
    assert "You are a helpful AI assistant named SmolLM" in go_render(modelfile, no_system)


def test_ollama_export_refuses_a_nonempty_folder_and_bad_usage(cli, default_model, tmp_path, edgellm_home):
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "keep.txt").write_text("mine")
    before = store_snapshot(edgellm_home)
    res = cli("export", DEFAULT_NAME, "--to", "ollama", busy)
    assert_one_line_error(res)
    assert "not an empty folder" in res.stderr and [p.name for p in busy.iterdir()] == ["keep.txt"]
    res = cli("export", DEFAULT_NAME, "--to", "ollama")
    assert_one_line_error(res)
    assert "--to ollama DIR" in res.stderr
    res = cli("export", "no-such-model", "--to", "ollama", tmp_path / "new")
    assert_one_line_error(res)
    assert not (tmp_path / "new").exists() and store_snapshot(edgellm_home) == before


def test_a_template_that_is_not_one_wrapper_per_role_is_refused():
    from edgellm.chat.handoff import infer_pieces
    from edgellm.chat.template import ChatTemplate
    from edgellm.errors import UsageError

    numbered = (
        "{% for m in messages %}[{{ loop.index }}] {{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    with ChatTemplate(numbered) as t, pytest.raises(UsageError, match="not one wrapper per role|differently"):
        infer_pieces(lambda msgs, gen: t.render(msgs, add_generation_prompt=gen), name="numbered")
    chatml = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    with ChatTemplate(chatml) as t:
        pieces = infer_pieces(lambda msgs, gen: t.render(msgs, add_generation_prompt=gen))
        assert pieces.default_system == "" and pieces.user == ("<|im_start|>user\n", "<|im_end|>\n")
        assert pieces.render(THREE_TURNS) == t.render(THREE_TURNS, add_generation_prompt=True)


def test_llama_server_export_prints_the_same_settings(cli, default_model):
    res = cli("export", DEFAULT_NAME, "--to", "llama-server", "--ctx", "2048", "--threads", "3", "--kv-type", "q8_0", "--json")
    assert res.exit_code == 0, res
    out = res.json()
    cmd = out["command"]
    assert cmd[0] == "llama-server" and shlex.split(out["command_line"]) == cmd
    opts = {cmd[i]: cmd[i + 1] for i in range(1, len(cmd) - 1) if cmd[i].startswith("-")}
    assert opts["-m"] == str(default_model.path) and opts["--ctx-size"] == "2048" and opts["--threads"] == "3"
    assert opts["--cache-type-k"] == opts["--cache-type-v"] == "q8_0" and opts["--flash-attn"] == "on"
    assert "--jinja" in cmd and opts["--temp"] == "0.8" and opts["--host"] == "127.0.0.1"
    assert f'"{DEFAULT_NAME}":' in out["llama_swap"] and "--port ${PORT}" in out["llama_swap"]
    assert str(default_model.path) in out["llama_swap"]
    text = cli("export", DEFAULT_NAME, "--to", "llama-server", "--rpc", "127.0.0.1:50052")
    assert text.exit_code == 0 and "--rpc 127.0.0.1:50052" in text.stdout and "llama-swap" in text.stdout
    res = cli("export", DEFAULT_NAME, "other", "--to", "llama-server")
    assert_one_line_error(res)
