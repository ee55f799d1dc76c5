"""`GET /metrics`: the server's counters in Prometheus' text format (version 0.0.4).

Requests are counted by HTTP status and by endpoint by an ASGI wrapper around
the whole app (so a 400 from parsing counts as much as a 200 from a model);
tool calls are counted by the routes that parse them; the rest comes from the
model pool at scrape time: queue depth, active sequences, prompt, cached and
generated tokens, prefix-cache hits, embedded inputs and tokens, KV use per model.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any


class Metrics:
    def __init__(self) -> None:
        self.by_status: collections.Counter = collections.Counter()
        self.by_endpoint: collections.Counter = collections.Counter()  # (path, status)
        self.tool_calls = 0
        self.tool_replies = 0  # replies that called at least one tool
        self._lock = threading.Lock()
        self._last: dict[str, tuple[float, int]] = {}  # model → (time, generated) at the previous scrape

    def count(self, status: int, path: str = "other") -> None:
        with self._lock:
            self.by_status[status] += 1
            self.by_endpoint[(path, status)] += 1

    def count_tool_calls(self, n: int) -> None:
        with self._lock:
            self.tool_calls += n
            self.tool_replies += n > 0

    def render(self, pool: Any) -> str:
        out: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[str, Any]]) -> None:
            out.append(f"# HELP edgellm_{name} {help_}")
            out.append(f"# TYPE edgellm_{name} {kind}")
            for labels, value in samples:
                out.append(f"edgellm_{name}{labels} {value}")

        with self._lock:
            statuses = sorted(self.by_status.items())
            endpoints = sorted(self.by_endpoint.items())
            calls, replies = self.tool_calls, self.tool_replies
        metric("requests_total", "counter", "HTTP responses by status code.", [(f'{{status="{s}"}}', n) for s, n in statuses])
        metric(
            "endpoint_requests_total",
            "counter",
            "HTTP responses by endpoint and status code.",
            [(f'{{endpoint="{_esc(p)}",status="{s}"}}', n) for (p, s), n in endpoints],
        )
        metric("tool_calls_total", "counter", "Tool calls returned to clients.", [("", calls)])
        metric("tool_call_replies_total", "counter", "Replies that called at least one tool.", [("", replies)])
        per = pool.metrics()
        now = time.monotonic()
        rates = []
        for name, m in per.items():
            t0, g0 = self._last.get(name, (now, m["generated_tokens"]))
            rates.append((name, (m["generated_tokens"] - g0) / (now - t0) if now > t0 else 0.0))
            self._last[name] = (now, m["generated_tokens"])

        def by_model(key: str) -> list[tuple[str, Any]]:
            return [(f'{{model="{_esc(n)}"}}', m[key]) for n, m in per.items()]

        metric("queue_depth", "gauge", "Requests waiting for a sequence slot.", by_model("queued"))
        metric("active_sequences", "gauge", "Requests being decoded in the batch.", by_model("active"))
        metric("sequence_slots", "gauge", "Sequences a model decodes together (--parallel).", by_model("slots"))
        metric("prompt_tokens_total", "counter", "Prompt tokens of admitted requests.", by_model("prompt_tokens"))
        metric("cached_prompt_tokens_total", "counter", "Prompt tokens served from the prefix cache.", by_model("cached_tokens"))
        metric("prefix_cache_hits_total", "counter", "Requests that reused a cached prefix.", by_model("cache_hits"))
        metric("generated_tokens_total", "counter", "Tokens generated.", by_model("generated_tokens"))
        metric(
            "generated_tokens_per_second",
            "gauge",
            "Generated tokens per second since the previous scrape.",
            [(f'{{model="{_esc(n)}"}}', round(r, 3)) for n, r in rates],
        )
        metric("embedded_inputs_total", "counter", "Inputs embedded (/v1/embeddings, /api/embed).", by_model("embedded_inputs"))
        metric("embedded_tokens_total", "counter", "Tokens of the inputs embedded.", by_model("embedded_tokens"))
        metric("kv_cells_used", "gauge", "KV cache cells in use (running sequences and cached prefixes).", by_model("kv_used"))
        metric(
            "kv_cells", "gauge", "KV cache cells of the model's context (split between its sequence slots).", by_model("kv_cells")
        )
        # speculative decoding, under llama-server's own names (llamacpp:spec_decode_*)
        for key, name, help_ in (
            ("draft_tokens", "num_draft_tokens_total", "Speculative: Total draft tokens generated"),
            ("draft_accepted", "num_accepted_tokens_total", "Speculative: Total draft tokens accepted by the target model"),
            ("draft_steps", "num_drafts_total", "Speculative: Total speculative decoding verification steps"),
        ):
            out.append(f"# HELP llamacpp:spec_decode_{name} {help_}")
            out.append(f"# TYPE llamacpp:spec_decode_{name} counter")
            out.append(f"llamacpp:spec_decode_{name} {sum(m.get(key, 0) for m in per.values())}")
        per_pos: list[int] = []
        for m in per.values():
            for i, v in enumerate(m.get("draft_per_pos", [])):
                per_pos += [0] * (i + 1 - len(per_pos))
                per_pos[i] += v
        if per_pos:
            out.append("# HELP llamacpp:spec_decode_num_accepted_tokens_per_pos_total Accepted tokens per draft position")
            out.append("# TYPE llamacpp:spec_decode_num_accepted_tokens_per_pos_total counter")
            out += [
                f'llamacpp:spec_decode_num_accepted_tokens_per_pos_total{{position="{i}"}} {v}' for i, v in enumerate(per_pos)
            ]
        return "\n".join(out) + "\n"


ENDPOINTS = frozenset(
    {
        "/v1/models",
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/embeddings",
        "/health",
        "/metrics",
        "/api/chat",
        "/api/generate",
        "/api/embed",
        "/api/embeddings",
        "/api/tags",
        "/api/show",
        "/api/ps",
        "/api/version",
    }
)


class CountStatus:
    """ASGI middleware: every HTTP response counted by status and endpoint in `metrics`."""

    def __init__(self, app: Any, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        # Known routes by name, the rest as one label: a client cannot grow the label set.
        endpoint = path if path in ENDPOINTS else ("/v1/models/{id}" if path.startswith("/v1/models/") else "other")

        async def send_counting(message):
            if message["type"] == "http.response.start":
                self.metrics.count(int(message["status"]), endpoint)
            await send(message)

        return await self.app(scope, receive, send_counting)


def _esc(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


__all__ = ["Metrics", "CountStatus"]
