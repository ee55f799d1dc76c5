"""The screen table: which screens the app has, their keys and their order.

Its own module so the app (which registers the screens) and the nav bar
(which shows their keys) both read it without importing each other.
"""

from __future__ import annotations

from typing import NamedTuple


class Mode(NamedTuple):
    name: str  # the Textual mode name
    key: str  # the key that switches to it from every screen
    label: str


# The order is the order of the nav bar. F-keys, not digits: a digit typed
# while a text field has focus must reach the field, an F-key never does.
SCREENS: tuple[Mode, ...] = (
    Mode("models", "f1", "Models"),
    Mode("quantize", "f2", "Quantize"),
    Mode("evaluate", "f3", "Evaluate"),
    Mode("chat", "f4", "Chat"),
    Mode("bench", "f5", "Bench"),
    Mode("system", "f6", "System"),
)

QUIT_KEY = "ctrl+q"


def key_label(key: str) -> str:
    """How a key is written on screen: F1, ^q."""
    if key.startswith("ctrl+"):
        return "^" + key[5:]
    return key.upper() if key.startswith("f") and key[1:].isdigit() else key
