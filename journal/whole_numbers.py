"""Reading a whole number from text that came from outside (a record key, a URL, an HTTP header).

``str.isdigit()`` is true of characters ``int()`` refuses (``'²'``, ``'①'``), and ``int()``
refuses more than 4,300 digits: a check with one and a conversion with the other raises on
such text instead of treating it as not a number. One function decides for every caller.
"""

from __future__ import annotations

__all__ = ["whole_number"]

MAX_DIGITS = 18  # any count, offset, port or epoch fits; more is not a number anyone meant


def whole_number(text: str) -> int | None:
    """``text`` as an int when it is plain ASCII decimal digits (no sign, no space, at most
    ``MAX_DIGITS``); None for anything else."""
    if not text or len(text) > MAX_DIGITS or not text.isascii() or not text.isdigit():
        return None
    return int(text)
