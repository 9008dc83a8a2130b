"""Text that someone else wrote (labels, values, names, errors read from a store or an export, or
typed by a user), made safe to show. One function, :func:`printable`, does it for a terminal:
control characters are written as escapes instead of being obeyed, so a stored ``"\\x1b[2J"``
cannot clear the screen or set the window title. Two thin wrappers add what one output reads as
commands: :func:`markup_text` for rich (``[/x]``, ``[link=...]`` are text, not markup) and
:func:`plot_text` for matplotlib (``$...$`` is text, not mathtext). Every printing path passes
stored or user text through one of the three."""

from __future__ import annotations

import re
from typing import Any

__all__ = ["printable", "markup_text", "plot_text"]

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


def markup_text(value: Any) -> str:
    """``str(value)`` to place inside rich markup: :func:`printable`, and every ``[`` that would
    start a tag escaped, so rich prints it as written.

    >>> markup_text("logs[/tmp]")
    'logs\\\\[/tmp]'
    """
    from rich.markup import escape

    return escape(printable(str(value)))


def plot_text(value: Any) -> str:
    """``str(value)`` as a matplotlib label: :func:`printable`, and ``$`` escaped, so a name such as
    ``$\\frac{$`` is drawn as written instead of parsed as mathtext.

    >>> plot_text("cost $")
    'cost \\\\$'
    """
    return printable(str(value)).replace("$", "\\$")
