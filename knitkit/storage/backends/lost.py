"""``UnitsLostError``: units a backend can no longer read, named by key on every path to the trainer."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence

from knitkit.types import UnitKey

_MARK = "knitkit-lost-units: "
"""Precedes the JSON list of lost keys in the message, so text that crossed a process boundary
(a reorganizer's failure written to its ring) still names them exactly."""


class UnitsLostError(LookupError):
    """Units whose bytes are gone (their owner process or node died, their segment was shrunk).

    NOTE [ Lost units reach the trainer ]: a trainer must learn WHICH units were lost, whatever
    path the failure took, to drop or regenerate exactly those trajectories. So the error pickles
    with its fields (a Ray task or actor re-raises it typed, ``.keys`` intact, instead of an
    ``UnserializableException``); its message carries the keys as JSON after a fixed mark, so a
    reorganizer's failure text written to its ring is turned back into a typed error by the
    consumer (``lost_units_in``); and a backend that finds a loss remembers it, so every later
    reader, in any process, gets this error too rather than a ``KeyError`` saying the unit was
    never put.
    """

    def __init__(self, keys: Sequence[UnitKey], where: str, cause: str = "") -> None:
        self.keys = tuple(keys)
        """The lost units."""
        self.where = where
        """The backend or segment that lost them."""
        self.cause = cause
        detail = f" ({cause})" if cause else ""
        names = json.dumps([str(k) for k in self.keys])
        super().__init__(
            f"{len(self.keys)} unit(s) of {where} are lost{detail}: drop or regenerate the "
            f"trajectories that own them; {_MARK}{names}"
        )

    def __reduce__(self) -> tuple[type[UnitsLostError], tuple[tuple[UnitKey, ...], str, str]]:
        return (type(self), (self.keys, self.where, self.cause))


_NAME = re.compile(r'\s*"((?:[^"\\]|\\.)*)"\s*([,\]])')
"""One JSON string of the key list and what follows it."""


def lost_units_in(text: str) -> tuple[UnitKey, ...]:
    """The lost keys a ``UnitsLostError`` message inside ``text`` names, or ``()``.

    Text cut short (a ring keeps the first 4096 bytes of an error) yields the keys before the
    cut; of several messages (the error first, then its traceback) the longest list wins."""
    found: tuple[UnitKey, ...] = ()
    at = text.find(_MARK)
    while at >= 0:
        keys = _keys_at(text, at + len(_MARK))
        found = keys if len(keys) > len(found) else found
        at = text.find(_MARK, at + 1)
    return found


def _keys_at(text: str, pos: int) -> tuple[UnitKey, ...]:
    """The complete keys of the JSON list starting at ``pos``."""
    if text[pos : pos + 1] != "[":
        return ()
    keys, pos = [], pos + 1
    while (match := _NAME.match(text, pos)) is not None:
        try:
            keys.append(UnitKey.parse(json.loads(f'"{match.group(1)}"')))
        except ValueError:
            break
        if match.group(2) == "]":
            break
        pos = match.end()
    return tuple(keys)
