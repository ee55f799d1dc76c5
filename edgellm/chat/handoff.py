"""Hand-off to the engines users move on to: an Ollama Modelfile, a llama-server command line.

Ollama renders prompts with Go's text/template, not Jinja, so a GGUF's chat
template cannot be copied across. It is translated by observation instead:
the Jinja template is rendered (sandboxed, by edgellm.chat.template) for
conversations whose contents are sentinel words, and the text around the
sentinels gives each role's prefix and suffix, the generation prompt, and a
default system block (a template that adds one when the conversation has
none, as SmolLM2's does). The Go template is built from those pieces, and the
pieces are checked by rebuilding, in Python, a different 3-turn conversation
with a system prompt and comparing it with the Jinja rendering: a template
that is not "one wrapper per role" (one that numbers turns, or treats the
last turn differently) is refused with a one-line error rather than
exported wrong. scripts/render_ollama_template.go renders the exported
TEMPLATE with Go's own text/template to prove the same text comes out.

Only Ollama's documented Modelfile directives are written: FROM, TEMPLATE,
PARAMETER (stop, num_ctx, temperature, top_k, top_p, min_p, repeat_penalty).
"""

from __future__ import annotations

import shlex
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from edgellm.chat.template import ChatTemplate
from edgellm.engine.rpc import parse_endpoints
from edgellm.engine.runtime import SamplingParams, default_threads
from edgellm.errors import ModelExists, UsageError
from edgellm.fsutil import atomic_open, atomic_write_text, check_free_disk, copy_with_sha256
from edgellm.gguf.reader import read_gguf, read_layout
from edgellm.models.resolve import resolve

MODELFILE_DIRECTIVES = {"FROM", "PARAMETER", "TEMPLATE", "SYSTEM", "ADAPTER", "LICENSE", "MESSAGE", "REQUIRES"}
OLLAMA_PARAMETERS = {
    "num_ctx",
    "repeat_last_n",
    "repeat_penalty",
    "temperature",
    "seed",
    "stop",
    "num_predict",
    "top_k",
    "top_p",
    "min_p",
}
DEFAULT_CTX = 4096
_S = {"sys": "QSYSQ", "u1": "QUSERONEQ", "a1": "QASSTONEQ", "u2": "QUSERTWOQ"}


@dataclass
class RolePieces:
    default_system: str  # emitted when the first message is not a system one
    system: tuple[str, str]
    user: tuple[str, str]
    assistant: tuple[str, str]
    generation: str  # the generation prompt after the last message

    def render(self, messages: list[dict[str, str]]) -> str:
        """What the Go template built from these pieces renders (the same logic, in Python)."""
        out = self.default_system if not messages or messages[0]["role"] != "system" else ""
        for m in messages:
            pre, suf = {"system": self.system, "user": self.user, "assistant": self.assistant}[m["role"]]
            out += pre + m["content"] + suf
        return out + self.generation

    def go_template(self) -> str:
        lit = _go_literal
        t = ""
        if self.default_system:
            t += '{{ if or (not .Messages) (ne (index .Messages 0).Role "system") }}' + lit(self.default_system) + "{{ end }}"
        t += "{{ range .Messages }}"
        t += '{{ if eq .Role "system" }}' + lit(self.system[0]) + "{{ .Content }}" + lit(self.system[1])
        t += '{{ else if eq .Role "user" }}' + lit(self.user[0]) + "{{ .Content }}" + lit(self.user[1])
        t += '{{ else if eq .Role "assistant" }}' + lit(self.assistant[0]) + "{{ .Content }}" + lit(self.assistant[1])
        t += "{{ end }}{{ end }}" + lit(self.generation)
        return t


def _go_literal(text: str) -> str:
    """Text outside actions is copied verbatim by text/template; only "{{" needs quoting."""
    return text.replace("{{", '{{ "{{" }}')


def _between(text: str, a: str, b: str) -> str:
    i, j = text.index(a) + len(a), text.index(b)
    if j < i:
        raise ValueError("out of order")
    return text[i:j]


def _dialogue(system: str, *turns: str) -> list[dict[str, str]]:
    """A system prompt, then user and assistant turns in alternation (the user's first)."""
    roles = ("user", "assistant")
    return [{"role": "system", "content": system}] + [{"role": roles[i % 2], "content": t} for i, t in enumerate(turns)]


def infer_pieces(render, *, name: str = "the model") -> RolePieces:
    """Each role's wrapper, observed from `render(messages, add_generation_prompt)` (the Jinja template)."""
    s = _S
    conv = _dialogue(s["sys"], s["u1"], s["a1"], s["u2"])
    try:
        full = render(conv, False)
        with_gen = render(conv, True)
        upto_a1 = render(conv[:3], False)
        no_sys = render(conv[1:], False)
        if not with_gen.startswith(full) or not full.startswith(upto_a1[: upto_a1.index(s["a1"])]):
            raise ValueError("renders do not extend each other")
        generation = with_gen[len(full) :]
        user_suf = full[full.index(s["u2"]) + len(s["u2"]) :]
        asst_suf = upto_a1[upto_a1.index(s["a1"]) + len(s["a1"]) :]
        m1, m2, m3 = _between(full, s["sys"], s["u1"]), _between(full, s["u1"], s["a1"]), _between(full, s["a1"], s["u2"])
        if not (m2.startswith(user_suf) and m3.startswith(asst_suf)):
            raise ValueError("suffixes differ between turns")
        asst_pre = m2[len(user_suf) :]
        user_pre = m3[len(asst_suf) :]
        if not m1.endswith(user_pre):
            raise ValueError("the first user turn is wrapped differently")
        sys_suf = m1[: len(m1) - len(user_pre)]
        sys_pre = full[: full.index(s["sys"])]
        head = no_sys[: no_sys.index(s["u1"])]
        if not head.endswith(user_pre):
            raise ValueError("the first user turn is wrapped differently without a system prompt")
        pieces = RolePieces(
            head[: len(head) - len(user_pre)], (sys_pre, sys_suf), (user_pre, user_suf), (asst_pre, asst_suf), generation
        )
    except ValueError as e:
        raise UsageError(
            f"the chat template of {name} is not one wrapper per role ({e}); Ollama's template language "
            "cannot be derived from it: write the TEMPLATE by hand"
        ) from None
    # A different conversation, rendered both ways, must agree word for word.
    check = _dialogue("Be brief.", "Hi there", "Hello! How can I help?", "Name a colour.", "Blue.", "Another one?")
    if pieces.render(check) != render(check, True):
        raise UsageError(
            f"the chat template of {name} renders turns differently from one to the next; Ollama's template "
            "cannot be derived from it: write the TEMPLATE by hand"
        )
    return pieces


@dataclass
class ModelFacts:
    path: Path
    name: str
    chat_template: Optional[str]
    bos_text: str
    eos_text: str
    add_bos: bool
    context_length: int


def model_facts(path: Path, name: str) -> ModelFacts:
    """What the hand-off needs from a GGUF, without loading it: template, BOS/EOS texts, context."""

    info = read_gguf(path)
    kv = {k: v for k, _t, v, _it in read_layout(path).raw_kvs if not k.startswith("tokenizer.ggml.merges")}
    tokens = kv.get("tokenizer.ggml.tokens") or []

    def text(key: str) -> str:
        i = kv.get(key)
        if isinstance(i, int) and 0 <= i < len(tokens):
            t = tokens[i]
            return t.decode("utf-8", "replace") if isinstance(t, bytes) else str(t)
        return ""

    add_bos = kv.get("tokenizer.ggml.add_bos_token")
    return ModelFacts(
        path,
        name,
        info.chat_template,
        text("tokenizer.ggml.bos_token_id"),
        text("tokenizer.ggml.eos_token_id"),
        bool(add_bos) if add_bos is not None else True,
        info.context_length,
    )


def edgellm_render(facts: ModelFacts, messages: list[dict[str, str]]) -> str:
    """The prompt text `edgellm chat` sends for `messages` (a BOS the tokenizer adds is not text)."""

    with ChatTemplate(
        facts.chat_template, bos_token=facts.bos_text, eos_token=facts.eos_text, warn=lambda m: None, model_name=facts.name
    ) as t:
        text = t.render(messages, add_generation_prompt=True)
    if facts.add_bos and facts.bos_text and text.startswith(facts.bos_text):
        text = text[len(facts.bos_text) :]
    return text


def _pieces_for(facts: ModelFacts) -> RolePieces:
    if not facts.chat_template:
        raise UsageError(f"{facts.name} has no chat template to translate for Ollama")
    with ChatTemplate(facts.chat_template, bos_token=facts.bos_text, eos_token=facts.eos_text, model_name=facts.name) as t:

        def render(msgs, gen):
            text = t.render(msgs, add_generation_prompt=gen)
            if facts.add_bos and facts.bos_text and text.startswith(facts.bos_text):
                text = text[len(facts.bos_text) :]  # llama.cpp adds the BOS token itself, in Ollama too
            return text

        return infer_pieces(render, name=facts.name)


def sampling_defaults() -> dict[str, float]:
    s = SamplingParams()
    return {
        "temperature": s.temperature,
        "top_k": s.top_k,
        "top_p": s.top_p,
        "min_p": s.min_p,
        "repeat_penalty": s.repeat_penalty,
    }


def _quote(value: str) -> str:
    if '"""' in value:
        raise UsageError('the template contains """, which a Modelfile cannot quote')
    return '"""' + value + '"""'


def modelfile_text(facts: ModelFacts, gguf_name: str, *, n_ctx: Optional[int] = None) -> str:
    pieces = _pieces_for(facts)
    stops = []
    for s in (pieces.assistant[1].strip(), facts.eos_text, pieces.user[0].strip()):
        if s and s not in stops and "\n" not in s:
            stops.append(s)
    ctx = n_ctx or min(DEFAULT_CTX, facts.context_length or DEFAULT_CTX)
    lines = [
        f"# {facts.name}, exported by edgellm for `ollama create NAME -f Modelfile`",
        f"FROM ./{gguf_name}",
        f"TEMPLATE {_quote(pieces.go_template())}",
    ]
    lines += [f'PARAMETER stop "{s}"' for s in stops if '"' not in s]
    lines.append(f"PARAMETER num_ctx {ctx}")
    lines += [f"PARAMETER {k} {v:g}" for k, v in sampling_defaults().items()]
    return "\n".join(lines) + "\n"


def check_modelfile(text: str) -> list[str]:
    """Directives and PARAMETER names outside Ollama's documented set (empty: all documented)."""
    bad, in_quote = [], False
    for line in text.splitlines():
        if in_quote:
            in_quote = line.count('"""') % 2 == 0
            continue
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        if words[0].upper() not in MODELFILE_DIRECTIVES:
            bad.append(words[0])
        elif words[0].upper() == "PARAMETER" and (len(words) < 3 or words[1] not in OLLAMA_PARAMETERS):
            bad.append(line)
        in_quote = line.count('"""') % 2 == 1
    return bad


def export_ollama(name: str, dest: Path, *, n_ctx: Optional[int] = None, on_progress=None, cancel=None) -> dict[str, Any]:
    """DIR/<model>.gguf and DIR/Modelfile; DIR must be new or empty. Nothing is left half-written."""

    r = resolve(name)
    facts = model_facts(r.path, r.label)
    dest = Path(dest).expanduser()
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise ModelExists(f"{dest} exists and is not an empty folder; export to a new folder")
    gguf_name = f"{r.record.name if r.record else r.path.stem}.gguf"
    modelfile = modelfile_text(facts, gguf_name, n_ctx=n_ctx)  # before any copying: a template refused costs nothing
    size = r.path.stat().st_size
    check_free_disk(dest, size, what=f"exporting {r.label}")
    created = not dest.exists()
    dest.mkdir(parents=True, exist_ok=True)
    try:
        # The GGUF by temp file + rename, then the Modelfile: a Modelfile never points at half a file.
        with open(r.path, "rb") as src, atomic_open(dest / gguf_name, "wb") as dst:
            _n, sha = copy_with_sha256(src, dst, total=size, on_progress=on_progress or (lambda p: None), cancel=cancel)
        atomic_write_text(dest / "Modelfile", modelfile)
    except BaseException:
        if created:  # a folder this export made and could not finish is removed again
            shutil.rmtree(dest, ignore_errors=True)
        raise
    return {
        "model": r.label,
        "dir": str(dest),
        "gguf": str(dest / gguf_name),
        "sha256": sha,
        "modelfile": str(dest / "Modelfile"),
        "create": f"ollama create {_ollama_name(r.label)} -f {dest / 'Modelfile'}",
    }


def _ollama_name(label: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in label.lower())


def llama_server(
    name: str,
    *,
    n_ctx: Optional[int] = None,
    threads: Optional[int] = None,
    kv_type: str = "f16",
    host: str = "127.0.0.1",
    port: int = 8080,
    rpc: Optional[str] = None,
) -> dict[str, Any]:
    """The llama-server command line that serves `name` as `edgellm serve` would, and a llama-swap entry."""

    r = resolve(name)
    facts = model_facts(r.path, r.label)
    ctx = n_ctx or min(DEFAULT_CTX, facts.context_length or DEFAULT_CTX)
    args = [
        "-m",
        str(r.path),
        "--ctx-size",
        str(ctx),
        "--threads",
        str(threads or default_threads()),
        "--cache-type-k",
        kv_type,
        "--cache-type-v",
        kv_type,
    ]
    if kv_type != "f16":
        args += ["--flash-attn", "on"]  # llama.cpp needs it for a quantized V cache, as edgellm does
    args += ["--jinja"]  # the GGUF's own chat template, rendered by llama.cpp's Jinja engine
    s = sampling_defaults()
    args += [
        "--temp",
        f"{s['temperature']:g}",
        "--top-k",
        f"{s['top_k']:g}",
        "--top-p",
        f"{s['top_p']:g}",
        "--min-p",
        f"{s['min_p']:g}",
        "--repeat-penalty",
        f"{s['repeat_penalty']:g}",
    ]
    if rpc:
        args += ["--rpc", ",".join(map(str, parse_endpoints(rpc))), "-ngl", "99"]
    cmd = ["llama-server", *args, "--host", host, "--port", str(port)]
    swap_cmd = " ".join(shlex.quote(a) for a in ["llama-server", *args]) + " --port ${PORT}"  # llama-swap's macro
    swap = f'models:\n  "{r.label}":\n    cmd: >\n      {swap_cmd}\n'
    return {"model": r.label, "command": cmd, "command_line": " ".join(shlex.quote(a) for a in cmd), "llama_swap": swap}


__all__ = [
    "RolePieces",
    "infer_pieces",
    "model_facts",
    "edgellm_render",
    "modelfile_text",
    "check_modelfile",
    "export_ollama",
    "llama_server",
    "MODELFILE_DIRECTIVES",
    "OLLAMA_PARAMETERS",
]
