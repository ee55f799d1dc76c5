"""matplotlib for `--plot` (eval and bench): the one place that loads it.

It is the `plot` extra, imported only when a plot is asked for: it takes
~0.5 s to import, which `edgellm --help` and every other command must not pay.
"""

from __future__ import annotations

from typing import Any

from edgellm.errors import UsageError


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend (no display needed), or a one-line error."""
    try:
        import matplotlib  # matplotlib (~0.5 s) only with --plot

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # matplotlib (~0.5 s) only with --plot
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'edgellm[plot]'") from None
    return plt
