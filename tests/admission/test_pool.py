"""The ready pool's bookkeeping against a naive model (FIFO per source, expiry by version)."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from knitkit.admission.pool import ReadyPool, Unit
from knitkit.types import TrajectoryMeta

Op = tuple[str, str, int]


@settings(max_examples=150, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["push", "push", "push", "take", "expire"]),
            st.sampled_from("AB"),
            st.integers(0, 6),
        ),
        max_size=400,
    )
)
def test_pool_matches_a_naive_model(ops: list[Op]) -> None:
    """Whatever the interleaving of pushes, takes and expiries, the pool holds exactly the
    model's units, in completion order per source, with counters equal to the sums; its version
    buckets hold exactly those units (nothing left for a sweep to clean), and expiry removes
    exactly the units below the version."""
    pool = ReadyPool("AB")
    model: dict[str, list[Unit]] = {"A": [], "B": []}
    for seq, (op, source, value) in enumerate(ops):
        if op == "push":
            meta = TrajectoryMeta(f"t{seq}", f"s{seq}", source, 0, 1, value, value + 1)
            unit = Unit.of(seq, source, (meta,) * (1 + value % 2))
            pool.push(unit)
            model[source].append(unit)
        elif op == "take":
            count = min(value, len(model[source]))
            assert pool.take({source: count}) == model[source][:count]
            del model[source][:count]
        else:
            expired = pool.expire_older_than(value)
            expected = [u for s in "AB" for u in model[s] if u.min_version < value]
            assert sorted(u.seq for u in expired) == sorted(u.seq for u in expected)
            for s in "AB":
                model[s] = [u for u in model[s] if u.min_version >= value]
        for s in "AB":
            assert list(pool.head(s)) == model[s]
            assert pool.ready[s] == sum(u.size for u in model[s])
        assert len(pool) == sum(pool.ready.values())
        # NOTE [ Version buckets without rebuilds ]: the buckets hold exactly the ready units,
        # never an entry left behind by a take, so no call ever sweeps them.
        assert sum(len(b) for b in pool._buckets.values()) == len(model["A"]) + len(model["B"])
    assert pool.clear() == [u for s in "AB" for u in model[s]]
    assert len(pool) == 0 and pool.expire_older_than(10**9) == []


def test_no_call_sweeps_the_pool() -> None:
    """Work per call is bounded by the units it moves: after a million-report-like churn of
    pushes and takes at one version (the case that made one report() in ~1M rebuild every
    bucket, 0.9 s at 1M pending), the buckets hold only the ready units, and each take
    removes exactly its units' entries (one bucket move per unit)."""
    pool = ReadyPool("AB")
    backlog = 5000
    metas = [TrajectoryMeta(f"t{k}", f"s{k}", "A", 0, 1, 0, 0) for k in range(3 * backlog)]
    for seq in range(backlog):
        pool.push(Unit.of(seq, "B", (metas[seq],)))
    for seq in range(backlog, 3 * backlog):
        pool.push(Unit.of(seq, "A", (metas[seq],)))
        before = sum(len(b) for b in pool._buckets.values())
        pool.take({"A": 1})
        assert sum(len(b) for b in pool._buckets.values()) == before - 1 == backlog
