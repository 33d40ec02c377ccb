"""Write-backs placed where they arrive (issue 32): ``WriteBackPlacer`` assembles a pass's
packed, CP-local outputs into whole units and puts each once; ``TrajectoryStore.adopt_written``
indexes them with no payload, refusing what does not match by name."""

from __future__ import annotations

import numpy as np
import pytest

from knitkit.job.write_back import WriteBackPlacer, parse_placed, placed_header
from knitkit.storage import (
    MemoryBackend,
    MiniBatchPlan,
    PlannerConfig,
    Topology,
    Trajectory,
    TrajectoryStore,
    plan_minibatch,
)
from knitkit.storage.backends import UnitSpec
from knitkit.types import UnitKey

LENGTHS = {"a": 13, "b": 6, "c": 9}


def _store() -> TrajectoryStore:
    store = TrajectoryStore(MemoryBackend())
    for tid, n in LENGTHS.items():
        store.write(Trajectory(tid, f"s-{tid}", {"tokens": np.arange(n, dtype=np.int32)}))
    store.declare_field("lp", "float32")
    store.declare_field("topk", "int64", (2,))
    return store


def _plan(store: TrajectoryStore) -> MiniBatchPlan:
    """DP1 x CP2: every trajectory's tokens split over the two CP groups, in several
    micro-batches."""
    config = PlannerConfig(max_tokens_per_micro_batch=16)
    return plan_minibatch(store.metas(), Topology(dp=1, cp=2), config, (), "mb")


def _outputs(plan: MiniBatchPlan, cp: int, index: int) -> dict[str, np.ndarray]:
    """What the writer rank of CP group ``cp`` sends for micro-batch ``index``: one row per
    packed token (padding included), a function of the trajectory and token position."""
    micro_batch = plan.consumer(0, cp).micro_batches[index]
    lp, topk = [], []
    for seq in micro_batch.sequences:
        for start, stop in seq.chunks:
            positions = np.arange(start, stop)
            lp.append(positions * 0.5 + ord(seq.trajectory_id[0]))
            topk.append(np.stack([positions, -positions], axis=1))
    return {
        "lp": np.concatenate(lp).astype(np.float32),
        "topk": np.concatenate(topk).astype(np.int64),
    }


def test_cp_pieces_from_two_writers_make_each_unit_once_as_write_ranges_would() -> None:
    """Invariant: every unit is put exactly once, when its last piece arrived, equal bit for
    bit to what the driver's ``write_ranges`` makes of the same records; until then only the
    incomplete units are held (``held_bytes``), none after. The CP 1 writer's records arrive
    after all of CP 0's (as from another node's relay): nothing is complete before them."""
    reference, placed_store = _store(), _store()
    plan = _plan(reference)
    placer = WriteBackPlacer(placed_store.backend)
    records = [(cp, i) for cp in (0, 1) for i in range(len(plan.consumer(0, cp).micro_batches))]
    assert len(records) > 2, "the plan should split the trajectories over micro-batches"
    done: dict[UnitKey, UnitSpec] = {}
    for cp, index in records:
        arrays = _outputs(plan, cp, index)
        micro_batch = plan.consumer(0, cp).micro_batches[index]
        for name, rows in arrays.items():
            for piece in micro_batch.unpack(rows):
                reference.write_ranges(piece.trajectory_id, name, piece.ranges, piece.rows)
        completed = placer.take(micro_batch, arrays)
        assert not set(completed) & set(done), "a unit was put twice"
        if cp == 0:
            assert completed == {} and placer.held_bytes > 0
        done.update(completed)
    keys = {UnitKey(t, f) for t in LENGTHS for f in ("lp", "topk")}
    assert set(done) == keys and placer.held_bytes == 0
    header = placed_header({"kind": "values"}, _outputs(plan, 0, 0), done, "10.0.0.2")
    units, sizes = parse_placed(header)
    assert units == done and set(sizes) == {"lp", "topk"}
    placed_store.adopt_written(units, placed_on="10.0.0.2")
    for key in keys:
        assert placed_store.field_complete(key.owner, key.field)
        np.testing.assert_array_equal(placed_store.read(key), reference.read(key))
    figures = placed_store.metrics()
    total = sum(s.nbytes for s in units.values())
    assert figures["knitkit/storage/written_back_bytes_adopted"] == total
    assert figures["knitkit/storage/written_back_bytes_adopted_on/10.0.0.2"] == total
    assert (
        figures["knitkit/storage/bytes_live"] == reference.metrics()["knitkit/storage/bytes_live"]
    )


def test_a_piece_sent_twice_or_misshapen_is_refused_naming_the_unit_keeping_nothing() -> None:
    """A micro-batch sent twice before its units completed, or rows of the wrong count: the
    placer raises naming the unit and keeps nothing of that record."""
    store = _store()
    plan = _plan(store)
    placer = WriteBackPlacer(store.backend)
    micro_batch = plan.consumer(0, 0).micro_batches[0]
    placer.take(micro_batch, _outputs(plan, 0, 0))
    held = placer.held_bytes
    with pytest.raises(ValueError, match=r"lp: tokens .* were written before"):
        placer.take(micro_batch, _outputs(plan, 0, 0))
    assert placer.held_bytes == held
    with pytest.raises(ValueError, match="rows to unpack"):
        placer.take(micro_batch, {"lp": np.zeros(3, np.float32)})
    assert placer.held_bytes == held and not list(store.backend.keys())[3:]


def test_adopt_written_refuses_unknown_mismatched_or_undeclared_units_by_name() -> None:
    """Units the backend lacks, a recorded spec other than the field's declared dtype and rows
    over the trajectory's tokens, or other than what the backend holds, an undeclared field or
    one the trajectory has already: refused naming the unit; nothing is indexed."""
    store = _store()
    lp = UnitSpec("float32", (13,))
    with pytest.raises(KeyError, match=r"\['a/lp'\] are not in MemoryBackend"):
        store.adopt_written({UnitKey("a", "lp"): lp})
    store.backend.put(UnitKey("a", "lp"), np.zeros(13, np.float32))
    with pytest.raises(ValueError, match=r"a/lp recorded float32\[12\], declared float32\[13\]"):
        store.adopt_written({UnitKey("a", "lp"): UnitSpec("float32", (12,))})
    store.backend.put(UnitKey("b", "lp"), np.zeros(5, np.float32))
    with pytest.raises(ValueError, match=r"b/lp stored float32\[5\], recorded float32\[6\]"):
        store.adopt_written({UnitKey("a", "lp"): lp, UnitKey("b", "lp"): UnitSpec("float32", (6,))})
    assert not store.field_complete("a", "lp")  # nothing indexed
    with pytest.raises(KeyError, match="field 'nope' is not declared"):
        store.adopt_written({UnitKey("a", "nope"): lp})
    with pytest.raises(KeyError, match="unknown trajectory 'zz'"):
        store.adopt_written({UnitKey("zz", "lp"): lp})
    store.adopt_written({UnitKey("a", "lp"): lp})
    assert store.field_complete("a", "lp")
    with pytest.raises(ValueError, match="a/lp is stored already"):
        store.adopt_written({UnitKey("a", "lp"): lp})
