"""A step's passes: what each reads, what it writes back, and the checks that order them."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from knitkit.storage.backends import SUPPORTED_DTYPES


@dataclass(frozen=True, slots=True)
class Output:
    """A per-token field a pass writes back into the stored trajectories (e.g. old log-probs)."""

    name: str
    dtype: str = "float32"
    """numpy dtype name of the stored rows (values are cast to it when written back)."""
    row_shape: tuple[int, ...] = ()
    """Shape of one token's row; ``()`` for one value per token."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or "/" in self.name:
            raise ValueError(f"Output.name={self.name!r} must be a non-empty field name")
        dtype = np.dtype(self.dtype).name
        if dtype not in SUPPORTED_DTYPES:
            raise ValueError(
                f"Output({self.name!r}).dtype={self.dtype!r}: use one of {sorted(SUPPORTED_DTYPES)}"
            )
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "row_shape", tuple(int(n) for n in self.row_shape))


@dataclass(frozen=True, slots=True)
class Pass:
    """One read of every admitted mini-batch by the trainer (old log-probs, reference, train).

    Every pass of a step is served from the mini-batch's one plan, in the order the step lists
    them; a pass is served only once every field it reads is produced for the whole mini-batch.
    """

    name: str
    reads: tuple[str, ...]
    """Stored fields its micro-batches carry, per-token and scalar alike (``position_ids``,
    ``cu_seqlens`` and a generated ``loss_mask`` come with every micro-batch)."""
    writes: tuple[Output, ...] = ()
    """Per-token fields its ranks write back (``PassWork.write_back``)."""
    forward_only: bool = False
    encodes: bool = False
    """True if its ranks run the multimodal encoder: they get their encoder inputs (read from
    the store once per such pass) and a dedup route; False reads no image at all."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or not self.name.isidentifier():
            raise ValueError(f"Pass.name={self.name!r} must be an identifier, e.g. 'old_logprobs'")
        reads, writes = self.reads, self.writes
        if isinstance(reads, str) or not all(isinstance(f, str) and f for f in reads):
            raise ValueError(f"Pass({self.name!r}).reads={reads!r} must be a tuple of field names")
        if not all(isinstance(w, Output) for w in writes):
            raise ValueError(f"Pass({self.name!r}).writes must hold Output values, got {writes!r}")
        object.__setattr__(self, "reads", tuple(dict.fromkeys(reads)))
        object.__setattr__(self, "writes", tuple(writes))
        names = [w.name for w in self.writes]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"Pass({self.name!r}) writes {twice} twice")
        both = sorted(set(names) & set(self.reads))
        if both:
            raise ValueError(
                f"Pass({self.name!r}) reads {both} and writes them: a pass reads what the "
                "rollout or an earlier pass produced"
            )


def check_passes(passes: Sequence[Pass]) -> tuple[Pass, ...]:
    """The step's passes, checked: at least one, names unique, every field written once, and no
    pass reads a field that the same or a later pass writes (its producer must come first)."""
    passes = tuple(passes)
    if not passes or not all(isinstance(p, Pass) for p in passes):
        raise ValueError(f"passes={passes!r}: give a non-empty tuple of Pass values")
    names = [p.name for p in passes]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"passes {twice} are declared twice; give each pass its own name")
    writer: dict[str, str] = {}
    for p in passes:
        for output in p.writes:
            if output.name in writer:
                raise ValueError(
                    f"field {output.name!r} is written by passes {writer[output.name]!r} and "
                    f"{p.name!r}; each written field has one producing pass"
                )
            writer[output.name] = p.name
    for index, p in enumerate(passes):
        for field in p.reads:
            producer = writer.get(field)
            if producer is not None and names.index(producer) > index:
                raise ValueError(
                    f"pass {p.name!r} reads {field!r}, which pass {producer!r} writes after it; "
                    f"list {producer!r} before {p.name!r}"
                )
    return passes


def rollout_fields(passes: Sequence[Pass]) -> tuple[str, ...]:
    """Fields the passes read that no pass writes: every trajectory must bring them."""
    written = {o.name for p in passes for o in p.writes}
    return tuple(dict.fromkeys(f for p in passes for f in p.reads if f not in written))


def written_by(passes: Sequence[Pass]) -> dict[str, Pass]:
    """Written field -> the pass that writes it."""
    return {o.name: p for p in passes for o in p.writes}


def read_next(passes: Sequence[Pass]) -> frozenset[str]:
    """Names of the passes whose outputs the pass right after them reads."""
    return frozenset(
        p.name
        for p, after in itertools.pairwise(passes)
        if any(o.name in after.reads for o in p.writes)
    )
