"""``SpecError``, the error of bad user input, in a module of its own.

Every layer raises it (the pure planners included), so it lives below everything: importing it
loads nothing else of elastic and no third-party library. ``elastic.model`` re-exports it.
"""

from __future__ import annotations


class SpecError(ValueError):
    """Bad user input. The message names the field and the fix; CLI prints it as one line."""


def _clip(text: str, n: int = 40) -> str:
    """At most ``n`` characters of a bad value for an error message (never the whole of a huge one)."""
    return text if len(text) <= n else f"{text[:n]}... ({len(text)} characters)"
