"""A rank's pass end is asynchronous: it returns before the driver takes its records, which still arrive exactly once, and a driver that dies after is still named."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import threading
import time
import traceback
from collections import defaultdict

import pytest
import torch
from job_harness import Hold, controller, driver_config, output_of, trajectories, wait_for

from knitkit.job import RankCoords, RankHandle, RankSpec
from knitkit.job.completion import PassEnds
from knitkit.job.ledger import PassLedger
from knitkit.job.records import RecordReader, RecordWriter
from knitkit.storage import RingSpec
from knitkit.storage.delivery import Producer


def serve_stoppable(conn: object) -> None:
    """A DP1 driver in its own process (spawn target; the test SIGSTOPs, SIGCONTs and SIGKILLs
    it): two mini-batches, a write-back ring of ONE slot, liveness 10 s. Sends its spec's JSON;
    on any message, waits until the first mini-batch is released and sends its counters."""
    data = trajectories(4, 2, seed=41)
    config = driver_config(1, 1, 1, 1, write_back_slots=1, liveness_timeout_s=10.0)
    with config.build(admission=controller(data, 2)) as driver:
        for trajectory in data:
            driver.write(trajectory)
        driver.finish()
        conn.send_bytes(driver.rank_spec().to_json().encode())  # type: ignore[attr-defined]
        conn.recv_bytes()  # type: ignore[attr-defined]
        wait_for(lambda: driver.progress().released == 1, 60, "tb0-mb0 released")
        figures = driver.metrics()
        counts = {k: figures[f"knitkit/job/{k}"] for k in ("passes_consumed", "write_back_records")}
        counts["old_lp"] = float(driver.produced("tb0-mb0", "old_lp"))
        conn.send_bytes(json.dumps(counts).encode())  # type: ignore[attr-defined]
        conn.recv_bytes()  # type: ignore[attr-defined]


class _Rank:
    """One rank in a thread: every pass, held in the passes of ``holds`` once it has their
    encoder inputs and first micro-batch (so the driver queued the pass on its reorganizers); sets
    ``ended[key]`` once ``with work`` returned; counts its write-back records and compares
    the written-back field bit for bit."""

    def __init__(self, spec: RankSpec, holds: dict[str, Hold]) -> None:
        self.holds = holds
        self.ended: defaultdict[str, threading.Event] = defaultdict(threading.Event)
        self.values: defaultdict[str, int] = defaultdict(int)
        self.mismatches: list[str] = []
        self.error = ""
        self.finished = 0.0
        self.thread = threading.Thread(target=self._run, args=(spec,), daemon=True)
        self.thread.start()

    def _run(self, spec: RankSpec) -> None:
        coords = RankCoords(rank=0, dp=0, encoder_rank=0)
        try:
            with RankHandle(spec, coords, device="cpu") as rank:
                for work in rank.passes():
                    key = f"{work.minibatch_id}/{work.pass_.name}"
                    hold = self.holds.get(key)
                    with work:
                        work.encoder_inputs()
                        for i, mb in enumerate(work.micro_batches()):
                            if hold is not None and i == 0:
                                hold.reached.set()
                                hold.release.wait(120)
                            if work.pass_.writes:
                                work.write_back(i, {"old_lp": output_of(mb["tokens"])})
                                self.values[key] += 1
                            else:
                                real = mb["loss_mask"] > 0
                                want = output_of(mb["tokens"][real])
                                if not torch.equal(mb["old_lp"][real], want):
                                    self.mismatches.append(f"{key} micro-batch {i}")
                    self.ended[key].set()
        except BaseException as error:  # recorded for the test to assert on
            self.error = f"{type(error).__name__}: {error}\n{traceback.format_exc()}"
        self.finished = time.monotonic()


def test_a_pass_ends_before_the_driver_takes_it_exactly_once_and_a_later_death_is_named() -> None:
    """The driver's process is SIGSTOPped while the rank runs mini-batch 0's forward-only pass
    (from its first micro-batch on; its write-back ring holds ONE record): the pass's write-backs and its end return at once,
    queued on the rank (before, the rank blocked until the driver took them). Once the driver
    runs again, every record arrives exactly once (the mini-batch released with exactly its
    records and pass ends; the train pass read the outputs bit for bit). Then the rank ends
    mini-batch 1's forward-only pass with the driver stopped again, and the driver is
    SIGKILLed: the rank, waiting for its train pass's data, raises ``DriverDiedError``
    within the liveness bound (its queued records cannot be delivered)."""
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    process = ctx.Process(target=serve_stoppable, args=(theirs,))  # it starts reorganizers
    process.start()
    holds = {key: Hold(*key.split("/")) for key in ("tb0-mb0/old", "tb0-mb1/old")}
    rank: _Rank | None = None
    try:
        assert ours.poll(120), "the driver process sent no spec"
        rank = _Rank(RankSpec.from_json(ours.recv_bytes().decode()), holds)
        assert holds["tb0-mb0/old"].reached.wait(60), rank.error
        os.kill(process.pid or 0, signal.SIGSTOP)
        try:
            holds["tb0-mb0/old"].release.set()
            returned = rank.ended["tb0-mb0/old"].wait(20)
        finally:
            os.kill(process.pid or 0, signal.SIGCONT)
        assert returned, "the rank's pass end waited for the stopped driver to take its records"
        assert holds["tb0-mb1/old"].reached.wait(60), rank.error
        ours.send_bytes(b"counts")
        assert ours.poll(60), "the driver never released tb0-mb0"
        counts = json.loads(ours.recv_bytes())
        assert counts == {
            "passes_consumed": 2.0,
            "write_back_records": float(rank.values["tb0-mb0/old"]),
            "old_lp": 1.0,
        }, counts
        assert rank.values["tb0-mb0/old"] >= 1 and rank.mismatches == []
        os.kill(process.pid or 0, signal.SIGSTOP)
        holds["tb0-mb1/old"].release.set()
        assert rank.ended["tb0-mb1/old"].wait(20), "the second pass end waited for the driver"
        os.kill(process.pid or 0, signal.SIGKILL)
        killed = time.monotonic()
        rank.thread.join(60)
        assert not rank.thread.is_alive(), "the rank did not leave after the driver died"
        assert rank.error.startswith("DriverDiedError"), rank.error
        assert rank.finished - killed < 30.0, rank.finished - killed
    finally:
        for hold in holds.values():
            hold.release.set()
        process.kill()
        process.join(30)
        if rank is not None:
            rank.thread.join(30)


def test_a_full_pass_end_queue_waits_bounded_and_a_failed_job_is_raised_to_the_rank() -> None:
    """With its one queued slot taken and its write-back ring full (a reader that never
    reads), a rank's next hand-off waits at most ``timeout_s``, then ``TimeoutError`` names
    the rank and what it queued; a job that raises is reported once (``on_failure``) and
    raised by every later hand-off."""
    ring = RingSpec.new(num_slots=1, slot_bytes=1 << 12, num_consumers=1)
    writer = RecordWriter(ring, owns_ring=True, role="rank 3")
    reader = RecordReader(ring, 0, producer=Producer("rank 3", "test"), liveness_timeout_s=30)
    failures: list[BaseException] = []
    ends = PassEnds(3, depth=1, timeout_s=0.5, on_failure=failures.append)
    try:
        ends.post("values record 0", lambda: writer.send({"i": 0}))  # fills the ring
        wait_for(lambda: writer.published == 1, 10, "the first record published")
        ends.post("values record 1", lambda: writer.send({"i": 1}))  # blocks on the full ring
        with pytest.raises(TimeoutError, match=r"rank 3 waited 0.5 s to queue done record"):
            ends.post("done record", lambda: writer.send({"i": 2}))
        assert reader.next(10) is not None  # the driver takes one: the queue moves on
        ends.wait(timeout_s=10)
        ends.post("a failing end", lambda: [][0])
        wait_for(lambda: failures != [], 10, "the failure reported")
        assert [type(f) for f in failures] == [IndexError]
        with pytest.raises(IndexError):
            ends.post("done record", lambda: None)
    finally:
        ends.stop(0.0)
        writer.stop()
        ends.join()
        reader.close()
        writer.close()


def test_a_pass_ledger_says_served_to_any_group() -> None:
    """``PassLedger.served_to_any`` (one group served its first micro-batches suffices: NOTE
    [ Serving as write-backs arrive ]), unlike ``MiniBatchLedger.served``."""
    assert not PassLedger().served_to_any
    assert PassLedger(started={"backbone/dp1/cp0"}).served_to_any


def test_a_held_pass_end_job_wakes_no_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    """A job posted held (``now=False``: a pass's write-back records and iterator close) wakes
    neither the pass-end thread nor a waiter: only a release that lets jobs run does, once, so
    the training thread does not hand the GIL to a thread with nothing to do (NOTE
    [ Asynchronous pass ends ]); the held jobs then run in order, once each."""
    wakes: list[str] = []

    class Counted(threading.Condition):
        def notify(self, n: int = 1) -> None:  # notify_all calls it too
            wakes.append("notify")
            super().notify(n)

    with monkeypatch.context() as patch:
        patch.setattr(threading, "Condition", Counted)
        ends = PassEnds(0, depth=8, timeout_s=10, on_failure=lambda error: None)
    ran: list[int] = []
    try:
        wakes.clear()
        for i in range(3):
            ends.post(f"values record {i}", lambda i=i: ran.append(i), now=False)
        assert wakes == [], wakes
        ends.release()
        assert wakes == ["notify"], wakes
        ends.release()  # nothing new to release
        ends.wait(timeout_s=10)
        assert ran == [0, 1, 2]
        wakes.clear()
        ends.post("done record", lambda: ran.append(3))
        assert wakes == ["notify"], wakes
        ends.wait(timeout_s=10)
        assert ran == [0, 1, 2, 3]
    finally:
        ends.stop(10.0)
        ends.join()
