"""The driver's checkpoint as plain data: its shape, position and pending mini-batches; the shape check on load."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Protocol

from knitkit.job.passes import Pass
from knitkit.storage import EncoderTopology, Topology

FORMAT = "knitkit.driver/1"

# NOTE [ Resume rule ]:
# A driver checkpoint is taken at a STEP BOUNDARY, beside the model's and the optimizer's state
# of the same moment: ``Driver.state_dict(consumed=k)`` says "the model state saved with this
# has trained the first k mini-batches of the serving order, and no rank has started a pass of
# a later one that changes the model". It waits (bounded) until those k are released (every
# group reported every pass; a writer rank's last ``done`` may still be in flight when rank 0
# reaches the boundary) and refuses if a later mini-batch is released (the model state would
# not hold it: the checkpoint would train it never). On resume:
# - The k released mini-batches are done: never served again (their effect is in the model).
# - Every later admitted mini-batch (pending) is re-planned and re-served from its FIRST pass.
#   Passes of it that ran before the crash changed nothing the checkpoint holds: forward-only
#   passes only wrote back fields (recomputed, deterministically, by the same model state) and
#   its train pass cannot have run (it would be past the boundary). Keeping write-backs across
#   the crash would save at most one mini-batch's forward passes, and needs their units on a
#   durable backend; the simple rule holds on every backend.
# - Re-planning at resume makes the topology free to change: DP, CP, TP, pipeline, the encoder
#   and the reorganizers are the new job's (named in ``Resumed.replanned``); only the passes
#   must be the same (refused naming the difference: a pass's reads, writes and order define
#   what "trained once per pass" means). Admission's own config is checked by admission.
# - The units of the pending and the waiting trajectories are NOT in the checkpoint. On a
#   durable backend (``SafetensorsBackend``) they stay on it: the checkpoint holds the store's
#   index of just those trajectories' rollout fields (``TrajectoryStore.state_dict``, whose
#   units outlive later frees: NOTE [ Units outlive their last state ] in
#   knitkit/storage/units/retention.py), and a resumed driver over the same directory finds
#   them (``Resumed.restored``). The driver names the rest (every one on shared memory, Ray or
#   Mooncake, whose data dies with its owner: ``Driver.reissue()``) and the caller re-writes
#   them (a keyed rollout regenerates them; a durable copy re-reads them). They are stored
#   without being reported to admission again (admission's restored state holds them). Until
#   every named trajectory is back, other trajectories are refused and nothing is admitted or
#   served: the serving order stays the checkpoint's. Trajectories written after the checkpoint
#   (partial GRPO groups included) are not in it: the rollout re-issues their prompts (its own
#   state, saved at the same boundary).
# So, over the interrupted and the resumed run together, every admitted trajectory's effect on
# the model comes from exactly one run of each pass (the examples' exactly-once ledger checks it).


@dataclass(frozen=True, slots=True)
class Shape:
    """What a checkpoint's job looked like: passes (must match) and topology (may differ)."""

    passes: list[list[Any]]
    layout: dict[str, Any]

    @classmethod
    def of(
        cls,
        passes: tuple[Pass, ...],
        topology: Topology,
        pipeline: int,
        encoders: tuple[EncoderTopology, ...],
        reorganizers: list[str],
    ) -> Shape:
        return cls(
            [
                [
                    p.name,
                    list(p.reads),
                    [[o.name, o.dtype, list(o.row_shape)] for o in p.writes],
                    p.forward_only,
                    p.encodes,
                ]
                for p in passes
            ],
            {
                "dp": topology.dp,
                "cp": topology.cp,
                "tp": topology.tp,
                "pipeline": pipeline,
                "encoders": [[e.name, e.dp, e.tp] for e in encoders],
                "reorganizers": sorted(reorganizers),
            },
        )

    def as_dict(self) -> dict[str, Any]:
        return {"passes": self.passes, "layout": self.layout}


@dataclass(frozen=True, slots=True)
class Pending:
    """An admitted mini-batch the checkpoint's model state has not trained: re-served whole."""

    minibatch_id: str
    train_batch: int
    index: int
    trajectories: tuple[str, ...]
    """In admission order (the plan is rebuilt from them)."""
    sources: dict[str, int]


@dataclass(frozen=True, slots=True)
class DriverState:
    """A decoded, checked ``Driver.state_dict()``."""

    shape: Shape
    admission: dict[str, Any]
    order: list[str]
    released: int
    pending: list[Pending]
    waiting: list[str]
    token_fields: list[str] | None
    scalar_fields: list[str]
    groups_open: list[tuple[str, str, list[str]]]
    counts: dict[str, int]
    wait_s: float
    store: dict[str, Any] | None = None
    """On a durable backend: the store's index of ``reissue()``'s trajectories, rollout fields
    only (``TrajectoryStore.state_dict``); their units stay on the backend."""

    def reissue(self) -> list[str]:
        """Every trajectory the resumed driver needs re-written, pending ones first, in order."""
        ids = [t for p in self.pending for t in p.trajectories]
        return list(dict.fromkeys([*ids, *self.waiting]))


@dataclass(frozen=True, slots=True)
class Resumed:
    """What ``Driver.load_state_dict`` did."""

    released: int
    """Mini-batches the checkpoint's model state trained (never served again)."""
    pending: tuple[str, ...]
    """Admitted mini-batches re-planned and re-served from their first pass."""
    reissue: tuple[str, ...]
    """Trajectories to re-write before anything is served (``Driver.reissue()``)."""
    replanned: dict[str, tuple[Any, Any]]
    """Layout entries that differ from the checkpoint's: name -> (saved, now)."""
    restored: tuple[str, ...] = ()
    """Trajectories the checkpoint needs that a durable backend still held (not re-written)."""


class StateSnapshot(Protocol):
    """A part's state copied at one instant (admission's ``snapshot()``, the store's): its
    ``state_dict()`` encodes it, without the part."""

    def state_dict(self) -> dict[str, Any]: ...


@dataclass(frozen=True, slots=True)
class Snapshot:
    """A driver checkpoint copied under the driver's lock (NOTE [ Checkpoint without holding
    writers ] in driver.py); ``encode()`` builds ``Driver.state_dict()``'s plain data."""

    state: DriverState
    """Everything but admission's and the store's parts (``admission`` empty, ``store`` None)."""
    admission: StateSnapshot
    store: StateSnapshot | None
    """On a durable backend: the store's index of ``state.reissue()``'s trajectories."""

    def encode(self) -> dict[str, Any]:
        admission = self.admission.state_dict()
        store = None if self.store is None else self.store.state_dict()
        return encode(replace(self.state, admission=admission, store=store))


def encode(state: DriverState) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "shape": state.shape.as_dict(),
        "admission": state.admission,
        "order": list(state.order),
        "released": state.released,
        "pending": [
            {
                "id": p.minibatch_id,
                "train_batch": p.train_batch,
                "index": p.index,
                "trajectories": list(p.trajectories),
                "sources": dict(p.sources),
            }
            for p in state.pending
        ],
        "waiting": list(state.waiting),
        "fields": None
        if state.token_fields is None
        else {"token": list(state.token_fields), "scalar": list(state.scalar_fields)},
        "groups_open": [[s, sample, list(ids)] for s, sample, ids in state.groups_open],
        "counts": dict(state.counts),
        "wait_s": state.wait_s,
        "store": state.store,
    }


def decode(saved: Any) -> DriverState:
    """Read ``encode``'s output, naming the first malformed field (nothing is trusted)."""
    if not isinstance(saved, dict) or saved.get("format") != FORMAT:
        got = saved.get("format") if isinstance(saved, dict) else type(saved).__name__
        raise ValueError(f"driver state: format {got!r}, expected {FORMAT!r} (Driver.state_dict())")
    try:
        fields = saved["fields"]
        state = DriverState(
            shape=Shape(list(saved["shape"]["passes"]), dict(saved["shape"]["layout"])),
            admission=dict(saved["admission"]),
            order=[str(m) for m in saved["order"]],
            released=int(saved["released"]),
            pending=[
                Pending(
                    str(p["id"]),
                    int(p["train_batch"]),
                    int(p["index"]),
                    tuple(str(t) for t in p["trajectories"]),
                    {str(k): int(v) for k, v in p["sources"].items()},
                )
                for p in saved["pending"]
            ],
            waiting=[str(t) for t in saved["waiting"]],
            token_fields=None if fields is None else [str(f) for f in fields["token"]],
            scalar_fields=[] if fields is None else [str(f) for f in fields["scalar"]],
            groups_open=[
                (str(s), str(g), [str(t) for t in ids]) for s, g, ids in saved["groups_open"]
            ],
            counts={str(k): int(v) for k, v in saved["counts"].items()},
            wait_s=float(saved["wait_s"]),
            store=_optional_dict(saved.get("store"), "store"),
        )
    except (KeyError, TypeError, ValueError, AttributeError) as error:
        raise ValueError(
            f"driver state: malformed ({error!r}); give Driver.state_dict()'s output"
        ) from None
    if [p.minibatch_id for p in state.pending] != state.order[state.released :]:
        raise ValueError(
            "driver state: 'pending' is not the serving order after the released mini-batches"
        )
    return state


def _optional_dict(value: Any, name: str) -> dict[str, Any] | None:
    if value is not None and not isinstance(value, dict):
        raise TypeError(f"{name!r} is a {type(value).__name__}, not a mapping")
    return value


def check_shape(saved: Shape, now: Shape) -> dict[str, tuple[Any, Any]]:
    """Refuse different passes (naming each); return the layout entries that differ (re-planned)."""
    if saved.passes != now.passes:
        names = ([p[0] for p in saved.passes], [p[0] for p in now.passes])
        differ = [
            f"{a[0]!r}: saved {a[1:]} now {b[1:]}"
            for a, b in zip(saved.passes, now.passes, strict=False)
            if a != b
        ]
        raise ValueError(
            f"driver state: the checkpoint's passes {names[0]} differ from this driver's "
            f"{names[1]}{': ' + '; '.join(differ) if differ else ''}; resume with the same passes "
            "(reads, writes, order): they define what 'trained once per pass' means"
        )
    return {k: (saved.layout.get(k), v) for k, v in now.layout.items() if saved.layout.get(k) != v}
