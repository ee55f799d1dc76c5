"""Chat templates: a GGUF's `tokenizer.chat_template`, rendered where it cannot hurt us.

A chat template is Jinja code that ships inside a downloaded model file, so it
is untrusted. It is rendered in `jinja2.sandbox.ImmutableSandboxedEnvironment`
(no attribute access to Python internals, no mutation, no loader, so no file
reads) and, because the sandbox does not bound work (it caps one `range` at
100k items, but two nested ones are 10^10 iterations, and `'x' * 10**10` is
plain Python), inside a long-lived worker subprocess with a memory limit that
is killed when a render overruns its time limit. The worker is started once
per template and reused, so a normal render costs a pipe round trip.

A model without a template gets a plain `User:`/`Assistant:` fallback and one
warning.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

from edgellm.errors import EdgeLLMError, one_line

log = logging.getLogger(__name__)

DEFAULT_TIMEOUT = 5.0
STARTUP_TIMEOUT = 30.0
MAX_OUTPUT_CHARS = 4_000_000
WORKER_MEMORY_BYTES = 1 << 30

FALLBACK_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] }}\n\n"
    "{% elif message['role'] == 'user' %}User: {{ message['content'] }}\n"
    "{% else %}Assistant: {{ message['content'] }}{{ eos_token }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant: {% endif %}"
)
# The fallback has no end-of-turn token a model knows; stop at the next speaker.
FALLBACK_STOPS = ["\nUser:"]


_TOOL_KEYS = ("tool_calls", "tool_call_id", "name")


class TemplateError(EdgeLLMError):
    """A chat template that fails, is unsafe, or runs too long (one line)."""


class ChatTemplate:
    """Render a conversation with a model's Jinja chat template, sandboxed and time-limited."""

    def __init__(
        self,
        source: Optional[str],
        *,
        bos_token: str = "",
        eos_token: str = "",
        timeout: Optional[float] = None,
        warn: Optional[Callable[[str], None]] = None,
        model_name: str = "the model",
    ) -> None:
        self.is_fallback = not (source and source.strip())
        if self.is_fallback:
            (warn or log.warning)(f"{model_name} has no chat template; using a plain 'User:/Assistant:' fallback")
        self.source = FALLBACK_TEMPLATE if self.is_fallback else str(source)
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.timeout = timeout if timeout is not None else _env_timeout()
        self.stop_strings: list[str] = list(FALLBACK_STOPS) if self.is_fallback else []
        self._worker = _Worker()
        self._finalizer = weakref.finalize(self, self._worker.close)

    @classmethod
    def for_runtime(
        cls, runtime, *, timeout: Optional[float] = None, warn: Optional[Callable[[str], None]] = None
    ) -> ChatTemplate:
        """The template of a loaded model, with its BOS/EOS token texts."""
        info = getattr(runtime, "info", None)
        source = info.chat_template if info is not None else None
        eos = runtime.token_text(runtime.llm.token_eos())
        return cls(
            source,
            bos_token=runtime.token_text(runtime.token_bos()),
            eos_token=eos,
            timeout=timeout,
            warn=warn,
            model_name=Path(runtime.path).name,
        )

    def render(self, messages: list[dict[str, str]], *, add_generation_prompt: bool = True, **extra: Any) -> str:
        context = {
            # Tool calls and tool results ride along for templates that render them (edgellm.serve.tools).
            "messages": [
                {"role": m["role"], "content": m["content"], **{k: m[k] for k in _TOOL_KEYS if k in m}} for m in messages
            ],
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            **extra,
        }
        return self._worker.render(self.source, context, timeout=self.timeout)

    def close(self) -> None:
        self._finalizer()

    def __enter__(self) -> ChatTemplate:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _env_timeout() -> float:
    """EDGELLM_TEMPLATE_TIMEOUT (seconds) overrides the render time limit."""
    try:
        return max(0.1, float(os.environ.get("EDGELLM_TEMPLATE_TIMEOUT", DEFAULT_TIMEOUT)))
    except ValueError:
        return DEFAULT_TIMEOUT


class _Worker:
    """One sandbox subprocess speaking JSON lines on stdin/stdout; restarted after a kill."""

    def __init__(self) -> None:
        self.proc: Optional[subprocess.Popen] = None
        self.lock = threading.Lock()
        self._buf = b""

    def _start(self) -> subprocess.Popen:
        env = dict(os.environ)
        pkg_root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = pkg_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        # Its own session: a Ctrl-C meant for the reply must not kill the renderer.
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from edgellm.chat.template import _worker_main; _worker_main()"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
            start_new_session=True,
        )
        self._buf = b""
        return self.proc

    def render(self, source: str, context: dict[str, Any], *, timeout: float) -> str:
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                self._start()
                # Startup (python + jinja2 import) is not the template's fault: ping first.
                self._send("", {})
                if self._read_line(STARTUP_TIMEOUT) is None:
                    self._kill()
                    raise TemplateError("the chat template renderer did not start")
            self._send(source, context)
            line = self._read_line(timeout)
            if line is None:
                self._kill()
                raise TemplateError(f"the chat template did not finish rendering within {timeout:g} s (stopped)")
        try:
            reply = json.loads(line)
        except ValueError:
            raise TemplateError("the chat template renderer sent a bad reply") from None
        if "error" in reply:
            raise TemplateError(f"chat template error: {reply['error']}")
        return reply["text"]

    def _send(self, source: str, context: dict[str, Any]) -> None:
        try:
            assert self.proc is not None and self.proc.stdin is not None
            self.proc.stdin.write(json.dumps({"template": source, "context": context}).encode("utf-8") + b"\n")
            self.proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self._kill()
            raise TemplateError("the chat template renderer died; try again") from None

    def _read_line(self, timeout: float) -> Optional[bytes]:
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([fd], [], [], left)
            if not ready:
                continue
            chunk = os.read(fd, 1 << 20)
            if not chunk:  # the worker died (e.g. its memory limit)
                self._kill()
                return json.dumps({"error": "the template used too much memory or crashed the renderer"}).encode()
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line

    def _kill(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        try:
            proc.kill()
            proc.wait(timeout=5)
        except Exception:  # already gone
            pass
        for f in (proc.stdin, proc.stdout):
            try:
                f.close()  # type: ignore[union-attr]
            except Exception:
                pass

    def close(self) -> None:
        with self.lock:
            if self.proc is not None and self.proc.poll() is None:
                try:
                    self.proc.stdin.close()  # type: ignore[union-attr]
                    self.proc.wait(timeout=1)
                except Exception:
                    pass
            self._kill()


# -- the worker side ---------------------------------------------------------


class _Raised(Exception):
    """raise_exception() called by the template itself."""


def _make_env():
    import jinja2  # jinja2 only in the template sandbox
    import jinja2.ext  # jinja2 only in the template sandbox
    from jinja2.sandbox import ImmutableSandboxedEnvironment  # jinja2 only in the template sandbox

    class Env(ImmutableSandboxedEnvironment):
        # String repetition and powers can allocate gigabytes in one step.
        intercepted_binops = frozenset({"*", "**"})

        def call_binop(self, context, operator, left, right):
            if operator == "**" and isinstance(right, (int, float)) and abs(right) > 64:
                raise jinja2.exceptions.SecurityError("exponent too large")
            if operator == "*":
                for a, b in ((left, right), (right, left)):
                    if isinstance(a, (str, list, tuple)) and isinstance(b, int) and len(a) * b > 1_000_000:
                        raise jinja2.exceptions.SecurityError("repetition too large")
            return super().call_binop(context, operator, left, right)

    env = Env(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])

    def raise_exception(message: str = "") -> None:
        raise _Raised(message)

    def tojson(value, indent=None, separators=None, sort_keys=False, ensure_ascii=False):
        return json.dumps(value, indent=indent, separators=separators, sort_keys=sort_keys, ensure_ascii=ensure_ascii)

    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    env.filters["tojson"] = tojson
    return env


def _worker_main() -> None:
    """Loop: read a request line, render, write a reply line. Runs in the subprocess."""
    try:
        import resource  # POSIX only

        resource.setrlimit(resource.RLIMIT_AS, (WORKER_MEMORY_BYTES, WORKER_MEMORY_BYTES))
    except (ImportError, ValueError, OSError):
        pass
    sys.setrecursionlimit(2000)
    env = _make_env()
    compiled: dict[str, Any] = {}
    out = sys.stdout.buffer
    for raw in sys.stdin.buffer:
        try:
            req = json.loads(raw)
            src = req["template"]
            tpl = compiled.get(src)
            if tpl is None:
                tpl = compiled[src] = env.from_string(src)
            text = tpl.render(**req["context"])
            if len(text) > MAX_OUTPUT_CHARS:
                reply = {"error": f"the rendered prompt is over {MAX_OUTPUT_CHARS} characters"}
            else:
                reply = {"text": text}
        except MemoryError:
            reply = {"error": "the template used too much memory"}
        except _Raised as e:
            reply = {"error": f"the template raised: {e}"[:300]}
        except RecursionError:
            reply = {"error": "the template recursed too deeply"}
        except Exception as e:  # any template failure becomes one line for the user
            reply = {"error": one_line(e, typed=True)}
        out.write(json.dumps(reply).encode("utf-8") + b"\n")
        out.flush()


__all__ = ["ChatTemplate", "TemplateError", "FALLBACK_TEMPLATE"]
