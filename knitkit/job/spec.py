"""What a rank needs from the driver (``RankSpec``, plain JSON) and where the rank sits (``RankCoords``)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from knitkit.job.passes import Output, Pass
from knitkit.storage import EncoderTopology, RingSpec, Topology

PREFETCH_DEPTH = 2
"""Micro-batches a rank's prefetch stages ahead of the one its loop holds, by default
(``RankHandle.Config.depth``; the driver's data rings are sized from it: ``Driver.Config``'s
``num_slots``)."""


def group_name(dp: int, cp: int) -> str:
    """A backbone (DP, CP) consumer group's name (``ConsumerPlan.name``)."""
    return f"backbone/dp{dp}/cp{cp}"


def data_rings(group: str, pipeline: int) -> tuple[str, ...]:
    """The data rings serving a store consumer: a backbone group's ring per pipeline stage
    (``<group>/pp<s>``, ``ConsumerPlan.for_stage``'s names) when ``pipeline > 1``, else its own
    (see NOTE [ One ring per pipeline stage ] in knitkit/storage/planning/plan.py)."""
    if pipeline == 1 or not group.startswith("backbone/"):
        return (group,)
    return tuple(f"{group}/pp{stage}" for stage in range(pipeline))


def encoder_rank_name(encoder: str, dp: int) -> str:
    """An encoder DP rank's consumer name (``EncoderRankPlan.name``)."""
    return f"{encoder}/dp{dp}"


@dataclass(frozen=True, slots=True)
class RankSpec:
    """Everything a rank needs to attach to the job: topology, passes and every ring's spec.

    A plain value, JSON round-trippable (``to_json`` / ``from_json``), so the driver's process
    hands it to ranks by any channel (``broadcast_rank_spec`` over torch.distributed, a file,
    an environment variable); nothing in it is code.
    """

    topology: Topology
    pipeline: int
    """Pipeline stages; each stage's TP ranks read their (DP, CP) group's ring of that stage
    (``data_rings``)."""
    passes: tuple[Pass, ...]
    encoders: tuple[EncoderTopology, ...]
    rings: Mapping[str, RingSpec]
    """Data rings by name: ``backbone/dp<d>/cp<c>`` (``.../pp<s>`` per stage when
    ``pipeline > 1``) and ``<encoder>/dp<r>``."""
    schedule: RingSpec
    """Driver -> every rank: one record per (mini-batch, pass), in serving order (ranks on
    several nodes: ``nodes[0]``'s ring; see ``schedule_of``)."""
    write_back: Mapping[str, RingSpec]
    """Per backbone group: its writer rank -> the driver (outputs, pass ends, errors)."""
    liveness_timeout_s: float = 30.0
    wait_timeout_s: float = 600.0
    extra: Mapping[str, Any] = field(default_factory=dict)
    """Anything else the job wants every rank to know (JSON values)."""
    nodes: tuple[str, ...] = ()
    """Ranks on several nodes: the node of each rank, by rank; each node's ranks read that
    node's schedule ring (``schedules``). Empty: every rank reads ``schedule``."""
    schedules: Mapping[str, RingSpec] = field(default_factory=dict)
    """Per node of ``nodes``: its schedule ring (NOTE [ Control across nodes ] in control.py)."""

    def __post_init__(self) -> None:
        if self.nodes and len(self.nodes) != self.world_size:
            raise ValueError(
                f"RankSpec.nodes names {len(self.nodes)} ranks' nodes; the job has "
                f"{self.world_size} ranks: give every rank's node, or none"
            )
        lacking = sorted(set(self.nodes) - set(self.schedules))
        if lacking:
            raise ValueError(f"RankSpec.schedules has no schedule ring for nodes {lacking}")

    @property
    def world_size(self) -> int:
        """Ranks of the job: DP x CP x TP x PP."""
        t = self.topology
        return t.dp * t.cp * t.tp * self.pipeline

    def schedule_of(self, rank: int) -> tuple[RingSpec, int]:
        """The schedule ring ``rank`` reads and its consumer index there: ``schedule`` at its
        rank, or its node's ring at its place among that node's ranks (in rank order)."""
        if not self.nodes:
            return self.schedule, rank
        node = self.nodes[rank]
        return self.schedules[node], self.nodes[:rank].count(node)

    def to_json(self) -> str:
        return json.dumps(
            {
                "topology": asdict(self.topology),
                "pipeline": self.pipeline,
                "passes": [_pass(p) for p in self.passes],
                "encoders": [asdict(e) for e in self.encoders],
                "rings": {n: asdict(s) for n, s in self.rings.items()},
                "schedule": asdict(self.schedule),
                "write_back": {n: asdict(s) for n, s in self.write_back.items()},
                "liveness_timeout_s": self.liveness_timeout_s,
                "wait_timeout_s": self.wait_timeout_s,
                "extra": dict(self.extra),
                "nodes": list(self.nodes),
                "schedules": {n: asdict(s) for n, s in self.schedules.items()},
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> RankSpec:
        """Parse ``to_json``'s text (data only); ``ValueError`` names what is malformed."""
        try:
            raw = json.loads(text)
            return cls(
                topology=Topology(**raw["topology"]),
                pipeline=_int(raw["pipeline"], "pipeline"),
                passes=tuple(_unpass(p) for p in raw["passes"]),
                encoders=tuple(
                    EncoderTopology(e["name"], e["dp"], e["tp"], tuple(e["kinds"]))
                    for e in raw["encoders"]
                ),
                rings={str(n): _ring(s) for n, s in raw["rings"].items()},
                schedule=_ring(raw["schedule"]),
                write_back={str(n): _ring(s) for n, s in raw["write_back"].items()},
                liveness_timeout_s=float(raw["liveness_timeout_s"]),
                wait_timeout_s=float(raw["wait_timeout_s"]),
                extra=dict(raw.get("extra", {})),
                nodes=tuple(str(n) for n in raw.get("nodes", ())),
                schedules={str(n): _ring(s) for n, s in raw.get("schedules", {}).items()},
            )
        except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as error:
            raise ValueError(
                f"not a RankSpec ({type(error).__name__}: {error}); pass RankSpec.to_json()'s text"
            ) from error


@dataclass(frozen=True, slots=True)
class RankCoords:
    """Where one rank sits in the job: its schedule index, (DP, CP, TP) group and pipeline stage,
    and the encoder rank it hosts (if any)."""

    rank: int
    """Its index among the job's ranks (``[0, spec.world_size)``; the global rank under torchrun)."""
    dp: int
    cp: int = 0
    tp: int = 0
    stage: int = 0
    """Pipeline stage."""
    encoder_rank: int | None = None
    """Its DP rank in ``spec.encoders[0]`` (it reads that encoder rank's ring); ``None``: it
    encodes nothing."""
    encoder_consumer: int = 0
    """Its index among that encoder rank's consumers (TP peers of a TP-sharded encoder)."""

    def check(self, spec: RankSpec) -> None:
        """``ValueError`` naming the coordinate that does not fit ``spec``."""
        t = spec.topology
        bounds = {
            "rank": spec.world_size,
            "dp": t.dp,
            "cp": t.cp,
            "tp": t.tp,
            "stage": spec.pipeline,
        }
        for name, bound in bounds.items():
            value = getattr(self, name)
            if not 0 <= value < bound:
                raise ValueError(f"RankCoords.{name}={value} outside [0, {bound}) of the job")
        if self.encoder_rank is not None:
            if not spec.encoders:
                raise ValueError("RankCoords.encoder_rank is set but the job has no encoder")
            encoder = spec.encoders[0]
            if not 0 <= self.encoder_rank < encoder.dp:
                raise ValueError(
                    f"RankCoords.encoder_rank={self.encoder_rank} outside encoder "
                    f"{encoder.name!r}'s {encoder.dp} DP ranks"
                )
            if not 0 <= self.encoder_consumer < encoder.tp:
                raise ValueError(
                    f"RankCoords.encoder_consumer={self.encoder_consumer} outside encoder "
                    f"{encoder.name!r}'s {encoder.tp} consumers per rank"
                )

    def is_writer(self, spec: RankSpec) -> bool:
        """The rank that sends its group's write-backs: TP rank 0 of the last pipeline stage."""
        return self.tp == 0 and self.stage == spec.pipeline - 1

    def data_ring(self, spec: RankSpec) -> str:
        """The name of the data ring it reads: its (DP, CP) group's, of its stage."""
        return data_rings(group_name(self.dp, self.cp), spec.pipeline)[self.stage]

    def consumer_index(self, spec: RankSpec) -> int:
        """Its index among its data ring's consumers (the TP ranks of its stage)."""
        return self.tp


def _pass(p: Pass) -> dict[str, Any]:
    return {
        "name": p.name,
        "reads": list(p.reads),
        "writes": [asdict(o) for o in p.writes],
        "forward_only": p.forward_only,
        "encodes": p.encodes,
    }


def _unpass(raw: dict[str, Any]) -> Pass:
    writes = tuple(Output(o["name"], o["dtype"], tuple(o["row_shape"])) for o in raw["writes"])
    return Pass(
        raw["name"],
        tuple(raw["reads"]),
        writes,
        forward_only=bool(raw["forward_only"]),
        encodes=bool(raw["encodes"]),
    )


def _ring(raw: dict[str, Any]) -> RingSpec:
    return RingSpec(
        str(raw["name"]),
        _int(raw["num_slots"], "num_slots"),
        _int(raw["slot_bytes"], "slot_bytes"),
        _int(raw["num_consumers"], "num_consumers"),
        _int(raw["meta_bytes"], "meta_bytes"),
    )


def _int(value: object, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"RankSpec {what}={value!r} must be an int >= 1")
    return value
