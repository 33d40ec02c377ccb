"""Sample-level baseline: same micro-batches as the reorganizer, TP x CP times the bytes read."""

from __future__ import annotations

import numpy as np
import pytest

from knitkit.storage.backends.shm import SharedMemoryBackend
from knitkit.storage.baselines.sample_level import (
    RankPosition,
    pack_local,
    read_share,
    receive_multimodal,
    send_multimodal,
    share_reads,
)
from knitkit.storage.baselines.synthetic import synthetic_trajectories
from knitkit.storage.delivery.consumer import MicroBatchConsumer
from knitkit.storage.delivery.publication import Publisher
from knitkit.storage.delivery.reorganizer import Reorganizer
from knitkit.storage.delivery.slot_ring import RingSpec, SlotRing
from knitkit.storage.planning.plan import EncoderTopology, Topology
from knitkit.storage.planning.planner import PlannerConfig, plan_minibatch
from knitkit.storage.units.store import TrajectoryStore

FIELDS = ("tokens", "logprobs", "loss_mask", "routing", "topp_mask")


@pytest.fixture
def store():
    made = TrajectoryStore(SharedMemoryBackend(slab_bytes=4 << 20))
    for trajectory in synthetic_trajectories(4, group_size=3, seed=3):
        made.write(trajectory)
    yield made
    made.backend.close()


@pytest.mark.parametrize(("dp", "cp", "tp"), [(1, 1, 1), (2, 2, 2), (1, 3, 2)])
def test_same_micro_batches_and_redundant_reads(store, dp, cp, tp):
    """Each sample-level rank packs bit-identical micro-batches to the reorganizer's; token fields
    cost TP x CP times the reorganizer's bytes, and only TP0/CP0 reads the images."""
    config = PlannerConfig(token_fields=FIELDS, max_tokens_per_micro_batch=512)
    plan = plan_minibatch(
        store.metas(), Topology(dp, cp, tp), config, (EncoderTopology("vision", 1),)
    )
    backend = store.backend
    knitkit_bytes = 0
    sample_bytes = {"token": 0, "image": 0}
    for group in plan.consumers:
        spec = RingSpec.new(num_slots=len(group.micro_batches), slot_bytes=1 << 20, num_consumers=1)
        owner = SlotRing.create(spec)
        publisher = Publisher(SlotRing.attach(spec))
        publisher.start()
        before = backend.bytes_read
        Reorganizer(backend, publisher).deliver("mb", group)
        publisher.finish()
        knitkit_bytes += backend.bytes_read - before
        with MicroBatchConsumer(spec, 0) as consumer:
            published = [(b.layout, {k: v.copy() for k, v in b.fields.items()}) for b in consumer]
        for t in range(tp):
            rank = RankPosition(group.dp_rank, group.cp_rank, t)
            before = backend.bytes_read
            local = read_share(backend, plan, rank)
            read = backend.bytes_read - before
            images = sum(
                backend.spec(k).nbytes for k in share_reads(plan, rank) if k.field == "image"
            )
            assert rank.reads_multimodal or images == 0
            sample_bytes["token"] += read - images
            sample_bytes["image"] += images
            for (layout, buffer), (expected_layout, expected) in zip(
                pack_local(group, local), published, strict=True
            ):
                assert layout.fields == expected_layout.fields
                assert layout.cu_seqlens_padded == expected_layout.cu_seqlens_padded
                views = layout.numpy_views(buffer)
                assert all(np.array_equal(views[k], v) for k, v in expected.items())
        publisher.close()
        owner.close()
        owner.unlink()
    sizes = {k: backend.spec(k).nbytes for k in list(backend.keys())}
    per_token = sum(n for k, n in sizes.items() if k.field in FIELDS)
    rewards = sum(n for k, n in sizes.items() if k.field == "reward")
    assert knitkit_bytes == per_token + cp * rewards
    assert sample_bytes["token"] == tp * cp * (per_token + rewards)
    image_refs = [ref.key for meta in store.metas() for ref in meta.multimodal]
    assert sample_bytes["image"] == sum(sizes[k] for k in image_refs)


def test_images_redistributed_from_tp0_cp0(store):
    """Only TP0/CP0 reads the images; its TP/CP peers receive exactly those arrays over a
    node-local ring, without touching storage."""
    config = PlannerConfig(token_fields=FIELDS, max_tokens_per_micro_batch=512)
    plan = plan_minibatch(store.metas(), Topology(1, 2, 2), config)
    backend = store.backend
    leader = read_share(backend, plan, RankPosition(0, 0, 0))
    images = {k: a for k, a in leader.units.items() if k.field == "image"}
    assert images
    spec = RingSpec.new(num_slots=1, slot_bytes=1 << 20, num_consumers=3)
    owner = SlotRing.create(spec)
    publisher = Publisher(SlotRing.attach(spec))
    publisher.start()
    peers = [RankPosition(0, c, t) for c in range(2) for t in range(2)][1:]
    try:
        sent = send_multimodal(publisher, leader)
        assert sent == sum(a.nbytes for a in images.values())
        for index, peer in enumerate(peers):
            before = backend.bytes_read
            local = read_share(backend, plan, peer)
            assert backend.bytes_read - before == sum(local.units[k].nbytes for k in local.units)
            assert not any(k.field == "image" for k in local.units)
            with MicroBatchConsumer(spec, index) as consumer:
                receive_multimodal(consumer, local)
            for key, array in images.items():
                assert np.array_equal(local.units[key], array)
    finally:
        publisher.close()
        owner.close()
        owner.unlink()


# Encoder inputs (reorganizer encoder ranks, sample-level redistribution) travel as unit layouts.


def _unit_ring(num_slots: int, num_consumers: int = 1) -> tuple[SlotRing, Publisher, RingSpec]:
    spec = RingSpec.new(num_slots=num_slots, slot_bytes=1 << 20, num_consumers=num_consumers)
    owner = SlotRing.create(spec)
    publisher = Publisher(SlotRing.attach(spec))
    publisher.start()
    return owner, publisher, spec


def test_reorganizer_encoder_micro_batches_list_their_units(store):
    """Each encoder micro-batch names exactly its planned units, in plan order, in
    ``layout.units`` (no unit keys posing as trajectory ids), and ``unit_views`` gives each
    unit's stored bytes under its key."""
    config = PlannerConfig(token_fields=("tokens",), max_tokens_per_micro_batch=256)
    encoder = EncoderTopology("vision", dp=1, kinds=("image",))
    plan = plan_minibatch(store.metas(), Topology(1), config, (encoder,))
    rank = plan.encoder("vision").ranks[0]
    assert sum(len(mb) for mb in rank.micro_batches) > 1
    owner, publisher, spec = _unit_ring(len(rank.micro_batches))
    try:
        Reorganizer(store.backend, publisher).deliver("mb", rank)
        publisher.finish()
        with MicroBatchConsumer(spec, 0) as consumer:
            for units, batch in zip(rank.micro_batches, consumer, strict=True):
                assert batch.layout.units == units
                assert batch.layout.trajectory_ids == ()
                arrays = batch.layout.unit_views(batch.buffer)
                assert list(arrays) == list(units)
                for key, array in arrays.items():
                    np.testing.assert_array_equal(array, store.backend.read(key))
    finally:
        publisher.close()
        owner.close()
        owner.unlink()


def test_sample_level_redistribution_lists_its_units(store):
    """The images TP0/CP0 redistributes travel as a unit layout: the peer learns every key from
    ``layout.units`` and gets the leader's arrays."""
    config = PlannerConfig(token_fields=("tokens",), max_tokens_per_micro_batch=256)
    plan = plan_minibatch(store.metas(), Topology(1, 1, 2), config)
    leader = read_share(store.backend, plan, RankPosition(0, 0, 0))
    images = {k: a for k, a in leader.units.items() if k.field == "image"}
    owner, publisher, spec = _unit_ring(1, num_consumers=2)
    try:
        send_multimodal(publisher, leader)
        peer = read_share(store.backend, plan, RankPosition(0, 0, 1))
        with MicroBatchConsumer(spec, 0) as consumer:
            receive_multimodal(consumer, peer)
        with MicroBatchConsumer(spec, 1) as onlooker:
            layout = onlooker.next_micro_batch(timeout_s=30).layout
        assert layout.units == tuple(images) and layout.trajectory_ids == ()
        for key, array in images.items():
            np.testing.assert_array_equal(peer.units[key], array)
    finally:
        publisher.close()
        owner.close()
        owner.unlink()
