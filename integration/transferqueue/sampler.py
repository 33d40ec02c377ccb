"""knitkit's mini-batch admission as a TransferQueue sampler: quota-preserving ``get_meta`` batches."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig, OmegaConf
from transfer_queue import BaseSampler

from knitkit.admission import AdmissionConfig, AdmissionController
from knitkit.storage.planning import karmarkar_karp
from knitkit.types import TrajectoryMeta

TAG_KEYS = ("source", "sample_id", "rollout_step", "num_tokens", "min_version", "max_version")
"""Per-sample tags (TransferQueue ``custom_meta``) a producer must set for admission to see it."""

ADMITTED_KEYS = ("knitkit_train_batch", "knitkit_minibatch", "knitkit_dp_rank")
"""Tags the sampler adds to every admitted sample: its train batch, mini-batch index and DP rank."""


def trajectory_tags(meta: TrajectoryMeta) -> dict[str, Any]:
    """The tags to put with a trajectory (``tq.kv_batch_put(..., tags=[...])``) so it can be admitted."""
    return {
        "trajectory_id": meta.trajectory_id,
        "source": meta.source,
        "sample_id": meta.sample_id,
        "rollout_step": meta.rollout_step,
        "num_tokens": meta.num_tokens,
        "min_version": meta.min_version,
        "max_version": meta.max_version,
        "accepted": meta.accepted,
    }


def sampler_conf(sampler: BaseSampler, **sections: Any) -> DictConfig:
    """A ``tq.init(conf)`` config installing ``sampler`` in polling mode, plus other config sections.

    e.g. ``sampler_conf(s, backend={"SimpleStorage": {"num_data_storage_units": 1}})``.
    """
    controller = {"sampler": sampler, "polling_mode": True}
    return OmegaConf.create({"controller": controller, **sections}, flags={"allow_objects": True})


@dataclass(slots=True)
class _PartitionState:
    """Admission state of one TransferQueue partition, shared by every task that consumes it."""

    controller: AdmissionController
    reported: set[int] = field(default_factory=set)
    index_of: dict[str, int] = field(default_factory=dict)
    admitted: list[list[list[int]]] = field(default_factory=list)
    """Every admitted mini-batch in admission order, as one list of global indexes per DP rank."""
    cursor: dict[tuple[str, int], int] = field(default_factory=dict)
    """Per (task, DP rank): how many admitted mini-batches it has fetched."""


class AdmissionSampler(BaseSampler):
    """Returns knitkit-admitted mini-batches from ``get_meta(mode="fetch")``, or nothing yet.

    Each call reports newly ready samples (by their tags) to one ``AdmissionController`` per
    partition and hands out the caller's share of the next admitted mini-batch: every task
    (``task_name`` in ``sampling_config``, as ``StreamingDataset`` sends it) receives the same
    mini-batches in the same order, and with ``dp_size > 1`` each ``dp_rank`` gets whole GRPO
    groups balanced by tokens, the same number on every rank. A mini-batch's size is set by
    admission, not by ``batch_size``: ask with a small one (1) so admission sees every completion
    early. Needs ``polling_mode=True`` (``sampler_conf``): "not yet" is an empty result.

    NOTE [ Tags arrive after production ]: ``TransferQueueClient.put`` flips the samples'
    production bits before it sends their ``custom_meta``, so a ready sample may have no tags
    yet. Such samples are left unreported and picked up by a later call, never guessed.
    """

    def __init__(self, config: AdmissionConfig, *, dp_size: int = 1) -> None:
        super().__init__()
        controller = AdmissionController(config)  # a bad config fails here, in the caller
        groups = [size // config.group_size for size in controller.minibatch_sizes]
        if dp_size < 1 or any(g % dp_size for g in groups):
            raise ValueError(
                f"dp_size={dp_size} must divide the groups of every mini-batch {groups} "
                f"(group_size={config.group_size}) so each DP rank gets as many"
            )
        self.config = config
        self.dp_size = dp_size
        self._partitions: dict[str, _PartitionState] = {}

    def sample(
        self,
        ready_indexes: list[int],
        batch_size: int,
        *args: Any,
        task_name: str = "",
        dp_rank: int = 0,
        partition: Any = None,
        **kwargs: Any,
    ) -> tuple[list[int], list[int]]:
        if partition is None:
            raise ValueError(
                "AdmissionSampler needs the controller's partition (kwarg 'partition'); "
                "use it as a TransferQueueController sampler, e.g. tq.init(sampler_conf(sampler))"
            )
        if not 0 <= dp_rank < self.dp_size:
            raise ValueError(f"dp_rank={dp_rank} is outside dp_size={self.dp_size}")
        state = self._partitions.get(partition.partition_id)
        if state is None:
            state = _PartitionState(AdmissionController(self.config))
            self._partitions[partition.partition_id] = state
        self._report_new(state, partition, ready_indexes)
        cursor = state.cursor.get((task_name, dp_rank), 0)
        if cursor == len(state.admitted):
            self._admit(state, partition)
        if cursor == len(state.admitted):
            return [], []
        share = state.admitted[cursor][dp_rank]
        if not set(share) <= set(ready_indexes):
            return [], []  # this task's fields are not all produced for the share yet
        state.cursor[(task_name, dp_rank)] = cursor + 1
        return list(share), list(share)

    def has_cached_result(
        self, partition_id: str, task_name: str, sampling_config: dict[str, Any] | None = None
    ) -> bool:
        """True when an admitted share awaits this (task, DP rank), however few samples are ready."""
        state = self._partitions.get(partition_id)
        config = sampling_config or {}
        key = (config.get("task_name", ""), config.get("dp_rank", 0))
        return state is not None and state.cursor.get(key, 0) < len(state.admitted)

    def _report_new(self, state: _PartitionState, partition: Any, ready: list[int]) -> None:
        new = [i for i in ready if i not in state.reported]
        tags: Mapping[int, Mapping[str, Any]] = partition.get_custom_meta(new)
        keys: Mapping[int, str] = partition.revert_keys_mapping
        for index in new:
            meta = _meta_from_tags(index, tags.get(index, {}), keys.get(index))
            if meta is None:
                continue  # tags not set yet; see NOTE [ Tags arrive after production ]
            state.controller.report(meta)
            state.reported.add(index)
            state.index_of[meta.trajectory_id] = index

    def _admit(self, state: _PartitionState, partition: Any) -> None:
        minibatch = state.controller.next_minibatch()
        if minibatch is None:
            return
        groups: dict[tuple[str, str], list[TrajectoryMeta]] = {}
        for meta in minibatch.trajectories:  # a GRPO group is (source, sample_id), as in admission
            key = meta.sample_id if self.config.group_size > 1 else meta.trajectory_id
            groups.setdefault((meta.source, key), []).append(meta)
        members = list(groups.values())
        costs = [sum(t.num_tokens for t in group) for group in members]
        shares = [
            [state.index_of[t.trajectory_id] for g in part for t in members[g]]
            for part in karmarkar_karp(costs, self.dp_size, equal_size=True)
        ]
        tags = partition.get_custom_meta([i for share in shares for i in share])
        updates = {}
        for rank, share in enumerate(shares):
            admitted = dict(
                zip(ADMITTED_KEYS, (minibatch.train_batch, minibatch.index, rank), strict=True)
            )
            updates.update({i: {**tags.get(i, {}), **admitted} for i in share})
        partition.set_custom_meta(updates)
        state.admitted.append(shares)

    def clear_cache(self, partition_id: str) -> None:
        """TransferQueue clears a partition: forget its admission state too."""
        super().clear_cache(partition_id)
        self._partitions.pop(partition_id, None)


def _meta_from_tags(index: int, tags: Mapping[str, Any], key: str | None) -> TrajectoryMeta | None:
    if not tags:
        return None
    missing = [k for k in TAG_KEYS if k not in tags]
    if missing:
        raise ValueError(
            f"sample {key or index} has tags {sorted(tags)} without {missing}; "
            "put trajectory_tags(meta) as its tags"
        )
    return TrajectoryMeta(
        trajectory_id=str(tags.get("trajectory_id") or key or index),
        sample_id=str(tags["sample_id"]),
        source=str(tags["source"]),
        rollout_step=int(tags["rollout_step"]),
        num_tokens=int(tags["num_tokens"]),
        min_version=int(tags["min_version"]),
        max_version=int(tags["max_version"]),
        accepted=bool(tags.get("accepted", True)),
    )
