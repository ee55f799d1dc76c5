"""Exception types that the CLI and the TUI turn into one-line messages.

Every expected failure raises a subclass of `EdgeLLMError`; its `str()` is the
whole message a user sees, so it names the thing that is wrong and, where
there is one, the fix.
"""

from __future__ import annotations


class EdgeLLMError(Exception):
    """Base class: an expected failure with a user-facing message."""

    exit_code = 1


class UsageError(EdgeLLMError):
    """Bad arguments or options."""

    exit_code = 2


class ModelNotFound(EdgeLLMError):
    """A name or path that is neither in the store nor on disk."""


class ModelExists(EdgeLLMError):
    """A name or output that already exists and would be overwritten."""


class GGUFError(EdgeLLMError):
    """A file that is not a valid GGUF, or whose contents contradict themselves."""


class StoreError(EdgeLLMError):
    """The model index cannot be read or written."""


class IntegrityError(EdgeLLMError):
    """A file whose sha256 or size does not match what was promised."""


class InsufficientResources(EdgeLLMError):
    """Not enough free disk or RAM for the job."""


class DownloadError(EdgeLLMError):
    """A download that failed after its retries."""


class OfflineError(EdgeLLMError):
    """Something needed the network while offline mode is on."""


class CatalogError(EdgeLLMError):
    """models.toml is malformed or names an unknown model/level."""


class RuntimeFailure(EdgeLLMError):
    """llama.cpp could not load or run a model."""


class BackendCrash(RuntimeFailure):
    """llama.cpp died in a guarded subprocess (a signal, not an exception)."""


class QuantizeError(EdgeLLMError):
    """A quantization or conversion that cannot be done."""


class EvalError(EdgeLLMError):
    """A perplexity/KLD evaluation that cannot be done."""


class Cancelled(EdgeLLMError):
    """The user cancelled a long job; nothing partial was kept."""

    exit_code = 130


def one_line(e: BaseException, limit: int = 300, *, typed: bool = False) -> str:
    """An exception as one line for a user: the first line of its message (its type's name when it has
    none), at most `limit` characters. `typed`: prefixed with its type's name, for an exception nobody
    expected (`internal error: KeyError: 'x'`), where the type is the clue."""
    text = str(e).strip()
    first = text.splitlines()[0] if text else ""
    if typed:
        return f"{type(e).__name__}: {first}"[:limit] if first else type(e).__name__
    return (first or type(e).__name__)[:limit]
