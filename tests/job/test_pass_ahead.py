"""What a pass needs before its first micro-batch starts ahead of the loop (NOTE [ One pass ahead ]
in knitkit/job/rank.py): its prefetch iterator, and one dedup route per mini-batch."""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable

import torch
from job_harness import controller, driver_config, join, trajectories, wait_for, wait_freed

from knitkit.encoder_dedup import RankRoute, route_minibatch
from knitkit.job import (
    Pass,
    PassWork,
    ProcessPool,
    RankCoords,
    RankHandle,
    RankSpec,
    ReorganizerPool,
)
from knitkit.job.spec import encoder_rank_name, group_name
from knitkit.storage import ConsumerPlan, MiniBatchPlan, SharedMemoryBackend, TrajectoryStore
from knitkit.types import UnitKey

HANDED_OUT = "knitkit/delivery/handed_out"


def _run_job(
    rank: Callable[[RankSpec], None],
    *,
    published: list[float] | None = None,
    pool: ReorganizerPool | None = None,
    store: TrajectoryStore | None = None,
    **overrides: object,
) -> list[str]:
    """One DP1 rank (``rank(spec)`` in a thread) over two mini-batches; drains; ``published``
    gets the micro-batches its reorganizers published (data and encoder rings)."""
    data = trajectories(4, 2, seed=5)
    config = driver_config(1, 1, 1, 1, **overrides)
    with config.build(admission=controller(data, 2), store=store, pool=pool) as driver:
        thread = threading.Thread(target=rank, args=(driver.rank_spec(),), daemon=True)
        thread.start()
        for trajectory in data:
            driver.write(trajectory)
        served = driver.minibatches()
        driver.finish()
        driver.drain(120)
        join([thread])
        wait_freed(driver.store)
        if published is not None:
            published.append(driver.metrics()["knitkit/delivery/reorganizer_published"])
    return served


def _write_back(work: PassWork) -> None:
    for i, mb in enumerate(work.consumer.micro_batches):
        work.write_back(i, {"old_lp": torch.zeros(mb.num_tokens)})


def _published(handle: RankHandle) -> int:
    """Micro-batches the rank's data ring has published so far."""
    return handle._data.consumer._ring.published


def _handed_out(handle: RankHandle) -> float:
    """Micro-batches the rank's data ring has handed out so far."""
    return handle._data.metrics()[HANDED_OUT]


def test_a_pass_data_and_encoder_inputs_are_ready_before_the_loop_asks() -> None:
    """Once ``next_pass`` hands out a mini-batch's first (encoding) pass, its encoder units are
    taken from the encoder ring (by the pass-end thread) before the loop asks; once it hands out
    the train pass, its first micro-batch is published into the rank's data ring (the driver
    serves it when the old pass's write-backs are in) before the loop asks for
    ``micro_batches()``, and nothing takes it before the loop does (NOTE [ Passes inline ]). The
    loop then gets every micro-batch, in order, once, and the train pass the old pass's very
    encoder inputs."""
    errors: list[BaseException] = []
    ahead: list[float] = []
    inputs: dict[tuple[str, str], dict[UnitKey, torch.Tensor]] = {}

    def rank(spec: RankSpec) -> None:
        before = units = 0  # micro-batches of the passes before this one: data ring, encoder ring
        try:
            with RankHandle(spec, RankCoords(0, 0, 0, 0, encoder_rank=0), device="cpu") as handle:
                ring = handle._units  # the encoder ring's consumer: its own handed_out
                assert ring is not None
                for work in handle.passes():
                    with work:
                        if work.pass_.name == "old":
                            want = units + work.encoder_micro_batches()
                            wait_for(
                                lambda n=want: ring.metrics()[HANDED_OUT] >= n,
                                30,
                                "the encoder units taken before the loop asks",
                            )
                        else:
                            wait_for(
                                lambda n=before: _published(handle) > n,
                                30,
                                "the train pass's first micro-batch published before the loop asks",
                            )
                            ahead.append(_handed_out(handle) - before)
                        inputs[(work.minibatch_id, work.pass_.name)] = work.encoder_inputs()
                        indices = [mb.index for mb in work.micro_batches()]
                        assert indices == list(range(work.num_micro_batches)), indices
                        if work.pass_.writes:
                            _write_back(work)
                    before += work.num_micro_batches
                    units += work.encoder_micro_batches()
        except BaseException as error:  # asserted below
            errors.append(error)

    served = _run_job(rank)
    assert not errors, errors[0]
    assert ahead == [0.0] * len(served) and len(served) == 2
    for mb in served:
        old, train = inputs[(mb, "old")], inputs[(mb, "train")]
        assert old and all(train[key] is old[key] for key in old)


def test_the_next_pass_is_published_while_the_current_one_runs() -> None:
    """Two passes that read rollout fields only: once the loop has taken every micro-batch of
    the first, the second's first micro-batch is published into the ring while the first pass
    is still running and holds its last lease (NOTE [ Data ring slots ] in
    knitkit/job/driver.py)."""
    errors: list[BaseException] = []
    ahead: list[int] = []
    passes = (Pass("a", reads=("tokens",)), Pass("b", reads=("tokens",)))

    def rank(spec: RankSpec) -> None:
        handed = 0  # micro-batches of every pass so far, this one included
        try:
            with RankHandle(spec, RankCoords(0, 0, 0, 0, encoder_rank=0), device="cpu") as handle:
                for work in handle.passes():
                    with work:
                        handed += work.num_micro_batches
                        for _ in work.micro_batches():
                            pass
                        if work.pass_.name == "a":
                            wait_for(
                                lambda n=handed: _published(handle) > n,
                                30,
                                "pass b's first micro-batch published while pass a runs",
                            )
                            ahead.append(_published(handle) - handed)
        except BaseException as error:  # asserted below
            errors.append(error)

    served = _run_job(rank, passes=passes)
    assert not errors, errors[0]
    assert len(ahead) == len(served) == 2


def test_cpu_passes_hand_out_on_the_loop_thread_and_give_the_last_lease_back_at_done() -> None:
    """On CPU with no ``convert``, a pass's iterator takes its leases on the training loop's
    thread (``PassTake.next_lease``, with the pass's checks): the rank starts no prefetch thread,
    and ``done`` gives the pass's last lease (held by a loop that never asks past the last
    micro-batch) back to the ring at once, not when the rank's pass-end thread gets to it (NOTE [ Passes inline ] in knitkit/job/rank.py; held up here)."""
    errors: list[BaseException] = []
    left: list[float] = []
    started: list[int] = []

    def rank(spec: RankSpec) -> None:
        try:
            with RankHandle(spec, RankCoords(0, 0, 0, 0, encoder_rank=0), device="cpu") as handle:
                data = handle._data
                for work in handle.passes():
                    hold = threading.Event()
                    handle._ends.post("held up by the test", lambda h=hold: h.wait(30))
                    try:
                        work.encoder_inputs()
                        batches = work.micro_batches()
                        for _ in range(work.num_micro_batches):  # as megatron's schedule takes
                            next(batches)
                        if work.pass_.writes:
                            _write_back(work)
                        work.done()
                        released = data.consumer._ring.released(data.index)
                        left.append(data.metrics()[HANDED_OUT] - released)
                    finally:
                        hold.set()
                started.append(handle._threads.started)
        except BaseException as error:  # asserted below
            errors.append(error)

    served = _run_job(rank)
    assert not errors, errors[0]
    assert left == [0.0] * 2 * len(served) and len(served) == 2
    assert started == [0]


def test_a_pass_the_loop_never_iterates_ends_cleanly() -> None:
    """A train pass whose loop never asks for its micro-batches (they were staged ahead) ends
    without error; what was staged is released unread and the next mini-batch reads its own."""
    errors: list[BaseException] = []
    read: list[tuple[str, str]] = []

    def rank(spec: RankSpec) -> None:
        try:
            with RankHandle(spec, RankCoords(0, 0, 0, 0, encoder_rank=0), device="cpu") as handle:
                for index, work in enumerate(handle.passes()):
                    with work:
                        work.encoder_inputs()
                        if index == 1:  # the first mini-batch's train pass
                            continue
                        for _ in work.micro_batches():
                            pass
                        read.append((work.minibatch_id, work.pass_.name))
                        if work.pass_.writes:
                            _write_back(work)
        except BaseException as error:  # asserted below
            errors.append(error)

    served = _run_job(rank)
    assert not errors, errors[0]
    assert read == [(served[0], "old"), (served[1], "old"), (served[1], "train")]


def test_the_route_is_built_once_per_minibatch_off_the_loop() -> None:
    """The route function runs once per mini-batch, on the rank's pass-end thread as the
    mini-batch's first encoding pass is handed out (the loop waits here until it ran, then
    asks); every pass of the mini-batch gets that very route."""
    errors: list[BaseException] = []
    built: list[str] = []
    routes: dict[tuple[str, str], RankRoute] = {}

    def route(plan: MiniBatchPlan) -> RankRoute:
        built.append(threading.current_thread().name)
        encoder = plan.encoder("vision")
        return route_minibatch({0: plan.consumer(0, 0)}, encoder.ranks, world_size=1).for_rank(0)

    def rank(spec: RankSpec) -> None:
        coords = RankCoords(0, 0, 0, 0, encoder_rank=0)
        try:
            with RankHandle(spec, coords, device="cpu", route=route) as handle:
                for index, work in enumerate(handle.passes()):
                    with work:
                        if work.pass_.name == "old":
                            wait_for(lambda n=index: len(built) > n // 2, 30, "the route built")
                        routes[(work.minibatch_id, work.pass_.name)] = work.route
                        work.encoder_inputs()
                        for _ in work.micro_batches():
                            pass
                        if work.pass_.writes:
                            _write_back(work)
        except BaseException as error:  # asserted below
            errors.append(error)

    served = _run_job(rank)
    assert not errors, errors[0]
    assert built == ["knitkit-pass-end-0"] * len(served) and len(served) == 2
    for mb in served:
        assert routes[(mb, "train")] is routes[(mb, "old")]
    assert routes[(served[0], "old")] is not routes[(served[1], "old")]


def test_the_next_minibatch_opens_while_the_last_pass_runs() -> None:
    """While a mini-batch's last pass runs, the rank's pass-end thread reads the next
    mini-batch's schedule record, builds its route and starts its first pass (NOTE [ One
    mini-batch ahead ] in knitkit/job/rank.py): the second mini-batch's route exists, built on
    that thread, before the loop leaves the first one's last pass; every pass still gets its
    own mini-batch's data, in the schedule's order."""
    errors: list[BaseException] = []
    built: list[tuple[str, str]] = []
    read: list[tuple[str, str, int]] = []

    def route(plan: MiniBatchPlan) -> RankRoute:
        built.append((plan.minibatch_id, threading.current_thread().name))
        encoder = plan.encoder("vision")
        return route_minibatch({0: plan.consumer(0, 0)}, encoder.ranks, world_size=1).for_rank(0)

    def rank(spec: RankSpec) -> None:
        coords = RankCoords(0, 0, 0, 0, encoder_rank=0)
        try:
            with RankHandle(spec, coords, device="cpu", route=route) as handle:
                for index, work in enumerate(handle.passes()):
                    with work:
                        assert work.route is not None
                        work.encoder_inputs()
                        count = sum(1 for _ in work.micro_batches())
                        assert count == work.num_micro_batches
                        read.append((work.minibatch_id, work.pass_.name, count))
                        if work.pass_.writes:
                            _write_back(work)
                        if index == 1:  # the first mini-batch's last pass
                            wait_for(
                                lambda: len(built) == 2,
                                15,
                                "the next mini-batch's route built during the last pass",
                            )
        except BaseException as error:  # asserted below
            errors.append(error)

    served = _run_job(rank)
    assert not errors, errors[0]
    assert [mb for mb, _ in built] == list(served) and len(served) == 2
    assert built[1] == (served[1], "knitkit-pass-end-0"), built
    assert [(mb, name) for mb, name, _ in read] == [
        (mb, name) for mb in served for name in ("old", "train")
    ]


def test_encoder_units_are_served_once_per_minibatch() -> None:
    """The driver serves a mini-batch's encoder units once, with its first encoding pass (NOTE
    [ Encoder inputs once per mini-batch ] in knitkit/job/rank.py): the encoder ring publishes
    each encoder micro-batch once per mini-batch and the rank takes them once (the old pass's
    tag), the train pass takes nothing from it and gets the old pass's very inputs, and the
    job drains. On 1cebb89 the driver served them again with the train pass and the rank's
    pass-end thread took and released that copy unread."""
    errors: list[BaseException] = []
    takes: list[str] = []
    counts: dict[tuple[str, str], tuple[int, int]] = {}
    inputs: dict[tuple[str, str], dict[UnitKey, torch.Tensor]] = {}
    published: list[float] = []

    def rank(spec: RankSpec) -> None:
        try:
            with RankHandle(spec, RankCoords(0, 0, 0, 0, encoder_rank=0), device="cpu") as handle:
                take = handle._watch.take

                def watched(source: object, count: int, expect: str, **gates: object) -> object:
                    if source is handle._units:
                        takes.extend([expect] * count)
                    return take(source, count, expect, **gates)  # type: ignore[arg-type]

                handle._watch.take = watched  # type: ignore[method-assign]
                for work in handle.passes():
                    with work:
                        key = (work.minibatch_id, work.pass_.name)
                        inputs[key] = work.encoder_inputs()
                        counts[key] = (work.num_micro_batches, work.encoder_micro_batches())
                        for _ in work.micro_batches():
                            pass
                        if work.pass_.writes:
                            _write_back(work)
        except BaseException as error:  # asserted below
            errors.append(error)

    served = _run_job(rank, published=published)
    assert not errors, errors[0]
    units = {mb: counts[(mb, "old")][1] for mb in served}
    assert all(units.values()), units  # every mini-batch has encoder micro-batches
    assert takes == [f"{mb}/old" for mb in served for _ in range(units[mb])], takes
    data = sum(n for n, _ in counts.values())
    assert published == [data + sum(units.values())], (published, data, units)
    for mb in served:
        old, later = inputs[(mb, "old")], inputs[(mb, "train")]
        assert old and all(later[key] is old[key] for key in old)


class _SubmitOrder:
    """The job's real ``ProcessPool``, recording the order of the driver's submissions."""

    def __init__(self, pool: ProcessPool) -> None:
        self.pool = pool
        self.order: list[tuple[str, str]] = []
        """(pass id, group) in submission order, a pass's consecutive parts once (NOTE
        [ Serving as write-backs arrive ])."""
        self.micro_batches: Counter[tuple[str, str]] = Counter()
        """(pass id, group) -> micro-batches submitted."""

    def __getattr__(self, name: str) -> object:
        return getattr(self.pool, name)

    def submit(self, name: str, minibatch_id: str, assignment: ConsumerPlan) -> None:
        if self.order[-1:] != [(minibatch_id, name)]:
            self.order.append((minibatch_id, name))
        self.micro_batches[minibatch_id, name] += len(assignment.micro_batches)
        self.pool.submit(name, minibatch_id, assignment)


def test_encoder_inputs_are_submitted_before_the_backbone_micro_batches() -> None:
    """A mini-batch's first encoding pass queues the encoder ranks' assignments before its
    groups' (a rank takes its encoder inputs first: NOTE in ``Scheduler._serve``), so the
    encoder reorganizers do not wake behind the backbone ones; every pass is still submitted
    once per group: each of its micro-batches once, in consecutive parts."""
    backbone, vision = group_name(0, 0), encoder_rank_name("vision", 0)
    store = TrajectoryStore(SharedMemoryBackend())
    pool = _SubmitOrder(ProcessPool(store.backend, {backbone: 1, vision: 1}, slot_bytes=1 << 20))
    counts: dict[str, int] = {}

    def rank(spec: RankSpec) -> None:
        with RankHandle(spec, RankCoords(0, 0, 0, 0, encoder_rank=0), device="cpu") as handle:
            for work in handle.passes():
                counts[f"{work.minibatch_id}/{work.pass_.name}"] = work.num_micro_batches
                with work:
                    work.encoder_inputs()
                    for _ in work.micro_batches():
                        pass
                    if work.pass_.name == "old":
                        _write_back(work)

    try:
        served = _run_job(rank, pool=pool, store=store)
    finally:
        store.close()
    expected = []
    for minibatch_id in served:
        expected += [(f"{minibatch_id}/old", vision), (f"{minibatch_id}/old", backbone)]
        expected += [(f"{minibatch_id}/train", backbone)]
    assert pool.order == expected
    assert {k: n for (k, g), n in pool.micro_batches.items() if g == backbone} == counts
