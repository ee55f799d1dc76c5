"""edgellm: a local, CPU-first LLM tool built around GGUF quantization.

The core API lives in the sub-packages (gguf, models, engine, chat, serve,
profile; docs/architecture.md). This package root stays import-light on purpose: the CLI
imports it on every start and `edgellm --help` must stay fast.
"""

from __future__ import annotations

__version__ = "0.1.0"
