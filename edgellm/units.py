"""The one convention for sizes, in and out, and the one loopback check.

Sizes: SI prefixes are decimal and binary prefixes binary, as disks, macOS's
Finder and the Hugging Face Hub count: `2GB` (or `2G`) is 2,000,000,000 bytes,
`2GiB` is 2 x 2^30. Every size option (--budget, --gpu-mem, worker --mem)
reads its value with `parse_size` and says so in its --help (`SIZE_HELP`);
every size printed goes through `human_size`.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Optional

from edgellm.errors import UsageError

# For each size option's --help: which convention it reads.
SIZE_HELP = "GB = 10^9 bytes, GiB = 2^30"

_PREFIX = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}
_SIZE_RE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]?)(i?)(b?)\s*", re.I)


def parse_size(text: Optional[str], *, option: str, minimum: int = 1) -> Optional[int]:
    """`512MB`, `1.5G`, `2GiB`, `95MiB` or plain bytes → bytes; None or blank → None.

    Raises `UsageError` naming `option` for anything else or for less than `minimum` bytes.
    """
    if text is None or str(text).strip() == "":
        return None
    m = _SIZE_RE.fullmatch(str(text))
    if not m or (m.group(3) and not m.group(2)):  # "5iB" is no unit
        raise UsageError(f"{option}: {text!r} is not a size like 512MB, 2GB or 2GiB ({SIZE_HELP})")
    power = _PREFIX[m.group(2).lower()]
    n = int(float(m.group(1)) * ((1 << (10 * power)) if m.group(3) else 10 ** (3 * power)))
    if n < minimum:
        raise UsageError(f"{option}: {text!r} is less than {human_size(minimum)}")
    return n


def human_size(n: float) -> str:
    """SI units (1 MB = 1,000,000 bytes), as disks, macOS's Finder and the
    Hugging Face Hub show sizes: a file edgellm reports as 98.4 MB is listed
    with that figure on the model's Hub page."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def is_loopback(host: str) -> bool:
    """Reachable from this machine only: `localhost`, 127.0.0.0/8, ::1 (bracketed or not)."""
    h = host.strip().lower()
    if h == "localhost" or h.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(h.strip("[]")).is_loopback
    except ValueError:
        return False
