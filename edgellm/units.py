"""The one size formatter, so every size a user sees has the same units."""

from __future__ import annotations


def human_size(n: float) -> str:
    """SI units (1 MB = 1,000,000 bytes), as disks, macOS's Finder and the
    Hugging Face Hub show sizes: a file edgellm reports as 98.4 MB is listed
    with that figure on the model's Hub page."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"
