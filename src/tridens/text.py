"""Text that someone else wrote (labels, values, names read from a store or an export), made safe
to show on a terminal: control characters are written as escapes instead of being obeyed, so a
stored ``"\\x1b[2J"`` cannot clear the screen or set the window title."""

from __future__ import annotations

import re

__all__ = ["printable"]

# C0 controls but newline and tab, DEL, C1 controls, and the bidirectional overrides and isolates
# (text that reads differently from what it is).
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def printable(text: str) -> str:
    """``text`` with every control character written as a visible escape (``\\x1b``, ``\\u202e``);
    newlines and tabs are kept.

    >>> printable("w\\x1b]0;title\\x07")
    'w\\\\x1b]0;title\\\\x07'
    >>> printable("plain text\\n")
    'plain text\\n'
    """
    return _CONTROL.sub(lambda m: m.group().encode("unicode_escape").decode("ascii"), text)
