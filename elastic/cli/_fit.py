"""Tables that fit the terminal (or 80 columns when piped) without cutting a name or a number.

Rich shrinks a table that is too wide by cutting its cells with an ellipsis: ``gpt-…`` for a
model's name, ``415.…`` for a parameter count. :func:`fit` instead drops the least important
columns (those a caller lists, in that order) until every word of every cell fits, gives each
column at least its longest word, and lets longer cells wrap between words: a value is shown
whole or not at all. Where even the columns that must stay cannot fit, cells fold (a long word
goes on over the next line) rather than lose characters.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table


def _text(value: Any) -> str:
    return value.plain if hasattr(value, "plain") else str(value)


def _cells(col: Any) -> list[Any]:
    return [col.header, *col._cells]


def _longest_word(console: Console, col: Any) -> int:
    return max((console.measure(w).maximum for c in _cells(col) for w in _text(c).split()), default=1)


def _widest_line(console: Console, col: Any) -> int:
    return max((console.measure(line).maximum for c in _cells(col) for line in _text(c).splitlines() or [""]),
               default=1)


def _room(table: Table, console: Console) -> int:
    """What the columns' contents may take in all: the width less borders and padding."""
    return console.width - table._extra_width - sum(table._get_padding_width(i) for i in range(len(table.columns)))


def fit(table: Table, console: Console, drop: Sequence[str] = ()) -> list[str]:
    """Make ``table`` fit ``console.width``: drop the columns named in ``drop``, first one first,
    while their words cannot all fit, then size the columns so that none is cut. Returns the
    names of the columns dropped (the caption says so too)."""
    dropped: list[str] = []
    for name in drop:
        if sum(_longest_word(console, c) for c in table.columns) <= _room(table, console):
            break
        keep = [c for c in table.columns if _text(c.header) != name]
        if len(keep) != len(table.columns):
            table.columns[:] = keep
            dropped.append(name)
    need = [_longest_word(console, c) for c in table.columns]
    room = _room(table, console)
    for col in table.columns:
        col.overflow = "fold"
    if sum(need) <= room:
        # each column its longest word, then what is left to the columns, left to right, up to
        # their widest line: Rich's own shrinking would narrow a name below its length
        spare = room - sum(need)
        for col, n in zip(table.columns, need, strict=True):
            grow = min(spare, _widest_line(console, col) - n)
            col.width = n + max(grow, 0)
            spare -= max(grow, 0)
    if dropped:
        note = "left out to fit the width: " + ", ".join(dropped) + " (--json has every field)"
        table.caption = f"{table.caption}\n{note}" if table.caption else note
    return dropped
