"""The Chat screen's Settings tab: the model, the load options, sampling and
speculative decoding, each field labelled, read back as the core's own option
dataclasses (and `draft()`, the value `edgellm chat --draft` takes).

A field that does not parse is an error naming the field, never a silent
default: a typo in "Temperature" must not chat at 0.8 without saying so.
"""

from __future__ import annotations

from typing import Optional, Union

from textual import getters, on
from textual.app import ComposeResult
from textual.containers import Horizontal, VerticalScroll
from textual.widgets import Checkbox, Input, Label, Select

from edgellm.chat import draft as chat_draft
from edgellm.engine.gpu import parse_size
from edgellm.engine.runtime import RuntimeOptions, SamplingParams
from edgellm.engine.speculative import DEFAULT_DRAFT_MAX, DRAFT_MODES
from edgellm.errors import UsageError
from tui.state import AppState
from tui.widgets.fields import set_choices

# key, label, default (str), placeholder; defaults are the core dataclasses' own
_S = SamplingParams()
FIELDS = [
    ("threads", "Threads", "", "auto (physical cores)"),
    ("ctx", "Context (tokens)", str(RuntimeOptions().n_ctx), ""),
    ("gpu_layers", "GPU layers", "0", "N, all, auto or 0"),
    ("gpu_device", "GPU device", "", "auto (index or name, see System)"),
    ("gpu_mem", "GPU memory", "", "no cap (e.g. 512MB, 4GiB)"),
    ("temperature", "Temperature", str(_S.temperature), ""),
    ("top_k", "Top-k", str(_S.top_k), ""),
    ("top_p", "Top-p", str(_S.top_p), ""),
    ("min_p", "Min-p", str(_S.min_p), ""),
    ("repeat_penalty", "Repeat penalty", str(_S.repeat_penalty), ""),
    ("max_tokens", "Max tokens", str(_S.max_tokens), ""),
    ("seed", "Seed", "", "random"),
]
# speculative decoding (the CLI's --draft and --draft-max): the mode, the draft model, the length
DRAFT_LENGTH = ("draft_max", "Draft length", "", f"auto, at most {DEFAULT_DRAFT_MAX} tokens a step")
LABELS = {key: label for key, label, _, _ in [*FIELDS, DRAFT_LENGTH]}
# the core's draft modes (SamplingParams.draft), as the select names them
MODE_NAMES = {"off": "off", "ngram": "n-gram", "model": "draft model"}
AUTO = "auto"  # chat --draft auto: the smallest stored model of the same vocabulary
# Changing one of these needs the model reloaded (a draft model is loaded beside it, and drafting turns
# flash attention on); sampling, the draft length included, applies at the next turn.
RELOAD_KEYS = ("model", "threads", "ctx", "gpu_layers", "gpu_device", "gpu_mem", "rpc", "system", "draft")


class ChatSettings(VerticalScroll):
    app = getters.app(AppState)  # the RPC workers the System screen took (tui.state)

    def compose(self) -> ComposeResult:
        with Horizontal(classes="setting"):
            yield Label("Model")
            yield Select([], prompt="(no models)", id="set-model", allow_blank=True)
        # the draft model and how it drafts, beside the model it drafts for
        with Horizontal(classes="setting"):
            yield Label("Speculation")
            yield Select([(MODE_NAMES.get(m, m), m) for m in DRAFT_MODES], value="off", id="set-draft", allow_blank=False)
        with Horizontal(classes="setting"):
            yield Label("Draft model")
            yield Select(
                [(AUTO, AUTO)],
                value=AUTO,
                id="set-draft-model",
                allow_blank=False,
                disabled=True,
                tooltip="for the draft model mode: a smaller stored model of the same vocabulary; auto: the smallest",
            )
        key, label, default, ph = DRAFT_LENGTH
        with Horizontal(classes="setting"):
            yield Label(label)
            yield Input(default, placeholder=ph, id=f"set-{key}")
        for key, label, default, ph in FIELDS:
            with Horizontal(classes="setting"):
                yield Label(label)
                yield Input(default, placeholder=ph, id=f"set-{key}")
        with Horizontal(classes="setting"):
            yield Label("RPC workers")
            yield Checkbox("use the workers set on the System screen", id="set-rpc")
        yield Label("System prompt")
        yield Input("", placeholder="(none)", id="set-system")

    def values(self) -> dict[str, str]:
        v = {key: self.query_one(f"#set-{key}", Input).value.strip() for key, *_ in FIELDS}
        model = self.query_one("#set-model", Select).value
        v["model"] = model if isinstance(model, str) else ""
        v["system"] = self.query_one("#set-system", Input).value.strip()
        # the workers as configured now: a changed list is a reload too
        v["rpc"] = self.app.rpc_workers if self.query_one("#set-rpc", Checkbox).value else ""
        v["use_rpc"] = "yes" if self.query_one("#set-rpc", Checkbox).value else ""
        v["draft_max"] = self.query_one(f"#set-{DRAFT_LENGTH[0]}", Input).value.strip()
        v["draft"] = self.draft()
        return v

    def draft(self) -> str:
        """What `chat --draft` takes: off, ngram, or the draft model's name (or auto)."""
        mode = self.query_one("#set-draft", Select).value
        if mode != "model":
            return mode if isinstance(mode, str) else "off"
        picked = self.query_one("#set-draft-model", Select).value
        return picked if isinstance(picked, str) else AUTO

    @on(Select.Changed, "#set-draft")
    def _mode_changed(self, event: Select.Changed) -> None:
        # the draft model matters only to the "draft model" mode
        self.query_one("#set-draft-model", Select).disabled = event.value != "model"

    def set_models(self, names: list[str], default: str = "") -> None:
        set_choices(self.query_one("#set-model", Select), names, default)
        set_choices(self.query_one("#set-draft-model", Select), [AUTO, *names], AUTO)

    def reload_key(self) -> tuple:
        v = self.values()
        return tuple(v[k] for k in RELOAD_KEYS)

    def runtime_options(self) -> RuntimeOptions:
        v = self.values()
        if v["use_rpc"] and not v["rpc"]:
            raise UsageError("RPC workers: none configured; enter HOST:PORT on the System screen (F6) first")
        return RuntimeOptions(
            n_ctx=_int(v["ctx"], "ctx", lo=16),
            n_threads=_opt_int(v["threads"], "threads", lo=1),
            n_gpu_layers=gpu_layers(v["gpu_layers"]),
            gpu_device=v["gpu_device"] or None,
            gpu_mem=gpu_mem(v["gpu_mem"]),
            rpc=v["rpc"] or None,
            flash_attn=chat_draft.flash_attn(v["draft"]),  # as chat --flash-attn auto
        )

    def sampling(self) -> SamplingParams:
        v = self.values()
        return SamplingParams(
            temperature=_float(v["temperature"], "temperature"),
            top_k=_int(v["top_k"], "top_k", lo=0),
            top_p=_float(v["top_p"], "top_p"),
            min_p=_float(v["min_p"], "min_p"),
            repeat_penalty=_float(v["repeat_penalty"], "repeat_penalty"),
            max_tokens=_int(v["max_tokens"], "max_tokens", lo=1),
            seed=_opt_int(v["seed"], "seed"),
            # the mode is set once the draft is attached (chat_draft.attach), as the CLI does
            draft_max=chat_draft.check_draft_max(_opt_int(v["draft_max"], "draft_max") or 0),
        )


def gpu_layers(text: str, label: str = LABELS["gpu_layers"]) -> Union[int, str]:
    """N, all, auto or 0 (what --gpu-layers takes); empty is 0."""
    t = (text or "0").strip().lower()
    if t in ("all", "auto"):
        return t
    try:
        n = int(t)
    except ValueError:
        raise UsageError(f"{label}: a number, all, auto or 0, not {text!r}") from None
    if n < 0:
        raise UsageError(f"{label}: at least 0 (or all), not {n}")
    return n


def gpu_mem(text: str) -> Optional[int]:
    try:
        return parse_size(text)
    except UsageError:
        raise UsageError(f"{LABELS['gpu_mem']}: a size like 512M or 4G, not {text!r}") from None


def _int(text: str, key: str, *, lo: Optional[int] = None) -> int:
    try:
        n = int(text)
    except ValueError:
        raise UsageError(f"{LABELS[key]}: a whole number, not {text!r}") from None
    if lo is not None and n < lo:
        raise UsageError(f"{LABELS[key]}: at least {lo}, not {n}")
    return n


def _opt_int(text: str, key: str, *, lo: Optional[int] = None) -> Optional[int]:
    return _int(text, key, lo=lo) if text else None


def _float(text: str, key: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise UsageError(f"{LABELS[key]}: a number, not {text!r}") from None
