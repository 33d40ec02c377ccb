"""Write-backs placed where they arrive: a writer rank's per-token outputs assembled into units."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from knitkit.storage import MicroBatchPlan, UnitBackend
from knitkit.storage.backends import UnitSpec, check_write, paste_ranges, spec_of
from knitkit.types import UnitKey

# NOTE [ Write-backs stay on the writer's node ]: a forward-only pass's per-token outputs (ref
# log-probs, values) are written back by each (DP, CP) group's writer rank, one ``values``
# record per micro-batch, packed and CP-local. With ``LocalControl`` (or a backend that is not
# shared across nodes) the driver's collector unpacks them and writes them into the store
# (``TrajectoryStore.write_ranges``). With ``RayControl`` over a ``RayBackend`` that would carry
# every written byte to the driver's node and through its process, so the relay that reads the
# writer's ring, on the writer's node, places them instead: a ``WriteBackPlacer`` there undoes
# packing with the mini-batch's plan (the first pass's schedule record carries it; every relay
# republishes every record, so it keeps the plan until the mini-batch's last pass ended), pastes
# each trajectory's rows into its whole unit and ``put``s the unit once complete, from the
# relay's process: owner and object on the writer's node, recorded there in the unit directory,
# so losing the node drops them like the rollout units placed there (NOTE [ One error for a lost
# node ] in integration/ray/relay.py). The driver receives the record without its arrays: what
# was placed (``placed_header``) and the bytes per field; its collector adopts the units into
# the store's index (``TrajectoryStore.adopt_written``: one directory lookup, no payload) under
# its lock with the record's micro-batch marked received, so a pass that reads the field is
# served only once every unit is in.
#
# CP: a trajectory's tokens are split over its DP rank's CP groups, whose writer ranks may sit
# on different nodes. Each unit is assembled at ONE place, its DP rank's assembling relay: the
# relay of the node of that DP rank's CP 0 writer. A relay that reads a CP group's ring on
# another node hands each of its records (and its end or failure) to the assembling relay, in
# order, one call at a time (so bounds and order hold: the assembler's queue full stops the
# call, then the reader, then the writer rank), and the assembler treats them as its own; the
# driver pulls every record of the DP rank's groups from there. So every unit is assembled from
# all its pieces exactly once, and the record that completes a unit carries its placement to
# the driver. The cost, only where a DP rank's CP writers span nodes: the non-assembling writers'
# outputs cross one link to the assembler (never to the driver). Chosen over placing each CP
# piece as a unit of its own (every reader of the field would then stitch pieces, and the store
# indexes one unit per field) and over sending split units to the driver (its node carries them).
# Memory: a unit is held by the placer only until its last piece arrived; the plans of the
# mini-batches in flight (admission bounds them) until their last pass ended.


@dataclass(slots=True)
class _Partial:
    """A unit being assembled: its rows so far and which tokens are written."""

    unit: np.ndarray
    written: np.ndarray
    """One flag per token."""


class WriteBackPlacer:
    """Assembles a writer's ``values`` records into whole per-token units and puts each in
    ``backend`` once every token is in (see NOTE [ Write-backs stay on the writer's node ])."""

    def __init__(self, backend: UnitBackend) -> None:
        self.backend = backend
        self._partial: dict[UnitKey, _Partial] = {}

    def take(
        self, micro_batch: MicroBatchPlan, arrays: Mapping[str, np.ndarray]
    ) -> dict[UnitKey, UnitSpec]:
        """One micro-batch's outputs (packed, CP-local, by field): returns the units it completed
        and put, with their specs. ``ValueError`` / ``IndexError`` naming the unit for rows that
        do not fit (wrong count, dtype or row shape, a token written twice); nothing of that
        record is kept then."""
        lengths = {s.trajectory_id: s.num_tokens for s in micro_batch.sequences}
        pieces = [
            (UnitKey(piece.trajectory_id, name), piece.ranges, piece.rows)
            for name, rows in arrays.items()
            for piece in micro_batch.unpack(np.asarray(rows))
        ]
        for key, ranges, rows in pieces:  # check every piece before keeping any
            partial = self._partial.get(key)
            spec = spec_of(partial.unit) if partial else self._spec(key, lengths[key.owner], rows)
            check_write(key, spec, ranges, rows)
            if partial is not None and any(partial.written[a:b].any() for a, b in ranges):
                raise ValueError(
                    f"write-back of unit {key}: tokens {list(ranges)} were written before; a "
                    "writer rank sent a micro-batch twice"
                )
        done: dict[UnitKey, UnitSpec] = {}
        for key, ranges, rows in pieces:
            partial = self._partial.get(key)
            if partial is None:
                spec = self._spec(key, lengths[key.owner], rows)
                unit = np.zeros(spec.shape, np.dtype(spec.dtype))
                partial = self._partial[key] = _Partial(unit, np.zeros(spec.shape[0], bool))
            paste_ranges(partial.unit, ranges, rows)
            for start, stop in ranges:
                partial.written[start:stop] = True
            if partial.written.all():
                del self._partial[key]
                self.backend.put(key, partial.unit)
                done[key] = spec_of(partial.unit)
        return done

    @property
    def held_bytes(self) -> int:
        """Bytes of the units waiting for pieces."""
        return sum(p.unit.nbytes for p in self._partial.values())

    @staticmethod
    def _spec(key: UnitKey, length: int, rows: np.ndarray) -> UnitSpec:
        return UnitSpec(rows.dtype.name, (length, *rows.shape[1:]))


def placed_header(
    header: Mapping[str, Any],
    arrays: Mapping[str, np.ndarray],
    placed: Mapping[UnitKey, UnitSpec],
    node: str,
) -> dict[str, Any]:
    """A ``values`` record's header once its arrays were placed (sent instead of the arrays):
    the units it completed, the bytes of each field's rows, the node that placed them."""
    return {
        **header,
        "placed": [[str(k), s.dtype, list(s.shape)] for k, s in placed.items()],
        "bytes": {name: int(rows.nbytes) for name, rows in arrays.items()},
        "node": node,
    }


def parse_placed(header: Mapping[str, Any]) -> tuple[dict[UnitKey, UnitSpec], dict[str, int]]:
    """``placed_header``'s units and bytes per field (data only); ``ValueError`` naming the
    first bad entry."""
    try:
        units = {
            UnitKey.parse(str(key)): UnitSpec(np.dtype(str(dtype)).name, tuple(map(int, shape)))
            for key, dtype, shape in header["placed"]
        }
        sizes = {str(name): int(size) for name, size in dict(header["bytes"]).items()}
    except (KeyError, TypeError, ValueError) as error:
        raise ValueError(f"a placed write-back record has a bad header ({error!r})") from None
    return units, sizes
