"""Unit lifetimes: which consumers of which mini-batch still have to read each unit."""

from __future__ import annotations

from collections import Counter
from typing import Any

from knitkit.storage.planning.plan import MiniBatchPlan
from knitkit.types import UnitKey


class ConsumerLedger:
    """Reference counts of units over the outstanding consumers of registered mini-batch plans.

    A unit's count is the number of consumers (backbone (DP, CP) groups and encoder ranks) that
    still have to read it. The store frees a unit when its count reaches zero, and a mini-batch's
    trajectories once its last consumer is done.
    """

    def __init__(self) -> None:
        self._outstanding: dict[str, dict[str, frozenset[UnitKey]]] = {}
        self._trajectories: dict[str, frozenset[str]] = {}
        self._counts: Counter[UnitKey] = Counter()

    def register(self, plan: MiniBatchPlan) -> None:
        """Raises before any change: a registered id, a trajectory planned twice in ``plan``
        (``MiniBatchPlan.check``) or already in another registered mini-batch (its units would
        be freed under that one)."""
        if plan.minibatch_id in self._outstanding:
            raise KeyError(f"mini-batch {plan.minibatch_id!r} is already registered")
        plan.check()
        trajectories = frozenset(
            s.trajectory_id for c in plan.consumers for mb in c.micro_batches for s in mb.sequences
        )
        for tid in sorted(trajectories):
            other = self.planned(tid)
            if other is not None:
                raise ValueError(
                    f"trajectory {tid!r} of mini-batch {plan.minibatch_id!r} is already planned "
                    f"in mini-batch {other!r}; a trajectory is trained once per registration"
                )
        by_consumer = {
            name: frozenset(r.key for r in reads)
            for name, reads in plan.reads_by_consumer().items()
        }
        self._outstanding[plan.minibatch_id] = by_consumer
        self._trajectories[plan.minibatch_id] = trajectories
        for keys in by_consumer.values():
            self._counts.update(keys)

    def consumed(self, minibatch_id: str, consumer: str) -> tuple[UnitKey, ...]:
        """Mark one consumer done; returns the units nobody needs any more."""
        pending = self._pending(minibatch_id)
        if consumer not in pending:
            raise KeyError(
                f"consumer {consumer!r} of mini-batch {minibatch_id!r} is not outstanding; "
                f"outstanding: {sorted(pending)}"
            )
        dead = []
        for key in pending.pop(consumer):
            self._counts[key] -= 1
            if self._counts[key] == 0:
                del self._counts[key]
                dead.append(key)
        return tuple(dead)

    def finished(self, minibatch_id: str) -> bool:
        return not self._pending(minibatch_id)

    def close(self, minibatch_id: str) -> frozenset[str]:
        """Forget a mini-batch (done or aborted); returns its trajectory ids."""
        for keys in self._pending(minibatch_id).values():
            self._counts.subtract(keys)
        self._counts = +self._counts
        del self._outstanding[minibatch_id]
        return self._trajectories.pop(minibatch_id)

    def state_dict(self) -> dict[str, dict[str, Any]]:
        """Every registered mini-batch's outstanding consumers (with the units each still reads)
        and trajectories, as plain data."""
        return {
            minibatch_id: {
                "consumers": {c: sorted(map(str, keys)) for c, keys in pending.items()},
                "trajectories": sorted(self._trajectories[minibatch_id]),
            }
            for minibatch_id, pending in self._outstanding.items()
        }

    def load_state_dict(self, state: dict[str, dict[str, Any]]) -> None:
        """Restore ``state_dict``'s mini-batches into an empty ledger (validated by the caller)."""
        if self._outstanding:
            raise ValueError("load_state_dict needs an empty ledger")
        for minibatch_id, entry in state.items():
            pending = {
                c: frozenset(UnitKey.parse(k) for k in keys)
                for c, keys in entry["consumers"].items()
            }
            self._outstanding[minibatch_id] = pending
            self._trajectories[minibatch_id] = frozenset(entry["trajectories"])
            for keys in pending.values():
                self._counts.update(keys)

    def minibatches(self) -> tuple[str, ...]:
        """Registered mini-batches not yet closed."""
        return tuple(self._outstanding)

    def needed(self, key: UnitKey) -> bool:
        return self._counts[key] > 0

    def planned(self, trajectory_id: str) -> str | None:
        """The registered mini-batch a trajectory belongs to, if any."""
        for minibatch_id, tids in self._trajectories.items():
            if trajectory_id in tids:
                return minibatch_id
        return None

    def outstanding(self, minibatch_id: str) -> tuple[str, ...]:
        return tuple(sorted(self._pending(minibatch_id)))

    def _pending(self, minibatch_id: str) -> dict[str, frozenset[UnitKey]]:
        try:
            return self._outstanding[minibatch_id]
        except KeyError:
            raise KeyError(f"mini-batch {minibatch_id!r} is not registered") from None
