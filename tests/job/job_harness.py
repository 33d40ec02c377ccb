"""Shared pieces of the job tests: a two-pass step, a rank loop that records what it saw, checks."""

from __future__ import annotations

import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from knitkit.admission import build_controller
from knitkit.job import Driver, Output, Pass, RankCoords, RankHandle, RankSpec
from knitkit.storage import EncoderTopology, PlannerConfig, Topology, Trajectory, TrajectoryStore
from knitkit.storage.baselines import synthetic_trajectories

PASSES = (
    Pass("old", reads=("tokens",), writes=(Output("old_lp"),), forward_only=True, encodes=True),
    Pass("train", reads=("tokens", "old_lp", "reward"), encodes=True),
)
"""A forward-only pass writing a per-token output, then a pass reading it (and a scalar)."""


def output_of(tokens: torch.Tensor) -> torch.Tensor:
    """The forward-only pass's per-token output: exact in float32 (a function of the token id)."""
    return (tokens % 1000).float() * 0.5 + (tokens // 2**20).float()


@dataclass
class Seen:
    """What one rank saw: per (mini-batch, pass), its tokens (real, in order), encoder units, and
    whether the written-back field matched the forward-only outputs bit for bit."""

    coords: RankCoords
    tokens: dict[tuple[str, str], list[int]] = field(default_factory=dict)
    packed: dict[tuple[str, str], list[bytes]] = field(default_factory=dict)
    units: dict[tuple[str, str], list[str]] = field(default_factory=dict)
    mismatches: list[str] = field(default_factory=list)
    error: str = ""


@dataclass
class Hold:
    """Stop every rank that gets to the start of one pass of one mini-batch until ``release``
    is set; ``reached`` is set once ``parties`` ranks got there."""

    minibatch_id: str
    pass_name: str
    parties: int = 1
    reached: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)
    seen: Seen | None = None
    """What the last rank to arrive saw before the hold."""
    _arrived: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def arrive(self, seen: Seen) -> None:
        """A rank got to the held pass, having seen ``seen``."""
        with self._lock:
            self.seen = seen
            self._arrived += 1
            if self._arrived >= self.parties:
                self.reached.set()


def rank_loop(
    spec: RankSpec,
    coords: RankCoords,
    *,
    skip_write: tuple[str, int] | None = None,
    hold: Hold | None = None,
) -> Seen:
    """One rank: every pass to the end; the forward-only pass writes ``output_of(tokens)``, the
    next pass compares what it reads against it. ``skip_write=(minibatch, index)`` leaves one
    micro-batch's output out; ``hold`` stops the rank at the start of one pass."""
    seen = Seen(coords)
    try:
        with RankHandle(spec, coords, device="cpu") as rank:
            for work in rank.passes():
                key = (work.minibatch_id, work.pass_.name)
                if hold is not None and key == (hold.minibatch_id, hold.pass_name):
                    hold.arrive(seen)
                    hold.release.wait(120)
                with work:
                    seen.units[key] = sorted(str(k) for k in work.encoder_inputs())
                    tokens, packed = [], []
                    for i, mb in enumerate(work.micro_batches()):
                        real = mb["loss_mask"] > 0
                        tokens += mb["tokens"][real].tolist()
                        packed.append(mb.flat.numpy().tobytes())
                        if work.pass_.writes:
                            if skip_write != (work.minibatch_id, i):
                                work.write_back(i, {"old_lp": output_of(mb["tokens"])})
                        elif "old_lp" in mb.tensors:
                            got, want = mb["old_lp"][real], output_of(mb["tokens"][real])
                            if not torch.equal(got, want):
                                seen.mismatches.append(f"{key} micro-batch {i}")
                    seen.tokens[key], seen.packed[key] = tokens, packed
    except BaseException as error:  # recorded for the test to assert on
        seen.error = f"{type(error).__name__}: {error}\n{traceback.format_exc()}"
    return seen


def run_ranks(
    spec: RankSpec, coords: Sequence[RankCoords], **kwargs: object
) -> tuple[list[threading.Thread], list[Seen]]:
    """Each rank in its own thread of this process (one consumer index per ring each)."""
    results: list[Seen] = [Seen(c) for c in coords]

    def run(i: int) -> None:
        results[i] = rank_loop(spec, coords[i], **kwargs)  # type: ignore[arg-type]

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(coords))]
    for thread in threads:
        thread.start()
    return threads, results


def grid(dp: int, cp: int, tp: int, encoder_dp: int) -> list[RankCoords]:
    """Every rank of a DP x CP x TP job; encoder rank e on rank e (one consumer each)."""
    coords = []
    for d in range(dp):
        for c in range(cp):
            for t in range(tp):
                rank = (d * cp + c) * tp + t
                encoder = rank if rank < encoder_dp else None
                coords.append(RankCoords(rank=rank, dp=d, cp=c, tp=t, encoder_rank=encoder))
    return coords


def driver_config(dp: int, cp: int, tp: int, encoder_dp: int, **overrides: object) -> Driver.Config:
    settings: dict[str, object] = {
        "passes": PASSES,
        "topology": Topology(dp=dp, cp=cp, tp=tp),
        "encoders": (EncoderTopology("vision", dp=encoder_dp),),
        "planner": PlannerConfig(max_tokens_per_micro_batch=256),
        "slot_bytes": 1 << 20,
        "num_slots": 2,
        "schedule_slot_bytes": 1 << 20,
        "write_back_slot_bytes": 1 << 16,
        "wait_timeout_s": 120.0,
    }
    settings.update(overrides)
    return Driver.Config(**settings)  # type: ignore[arg-type]


def controller(trajectories: Sequence[Trajectory], minibatches: int) -> object:
    sources = sorted({t.source for t in trajectories})
    return build_controller(
        "streaming",
        train_batch_size=len(trajectories),
        num_minibatches=minibatches,
        sources=sources,
    )


def trajectories(samples: int, group: int, seed: int) -> list[Trajectory]:
    return synthetic_trajectories(
        samples, group_size=group, min_tokens=20, max_tokens=200, seed=seed
    )


def join(threads: Sequence[threading.Thread], timeout_s: float = 120.0) -> None:
    for thread in threads:
        thread.join(timeout_s)
        assert not thread.is_alive(), f"rank thread {thread.name} did not finish"


def feed_one_rank(
    driver: Driver, data: Sequence[Trajectory], rank: Callable[[RankSpec], object]
) -> None:
    """``rank(spec)`` on a thread while every trajectory is written and the driver finishes;
    then drain the driver and join the thread."""
    thread = threading.Thread(target=rank, args=(driver.rank_spec(),), daemon=True)
    thread.start()
    for trajectory in data:
        driver.write(trajectory)
    driver.finish()
    driver.drain(120)
    join([thread])


def token_ids(trajectory: Trajectory) -> list[int]:
    return np.asarray(trajectory.token_fields["tokens"]).tolist()


Check = Callable[[list[Seen]], None]


def assert_trained_once(
    first: Sequence[Seen],
    trained: Sequence[str],
    second: Sequence[Seen],
    data: Sequence[Trajectory],
) -> None:
    """Over an interrupted run (only its ``trained`` mini-batches count: the checkpoint's model
    state holds them, later ones are void) and its resumption, every token of ``data`` was
    consumed exactly once per pass."""
    whole = Counter(tok for t in data for tok in token_ids(t))
    for p in PASSES:
        before = Counter(
            tok
            for seen in first
            for (mb, name), tokens in seen.tokens.items()
            if name == p.name and mb in trained
            for tok in tokens
        )
        after = Counter(
            tok
            for seen in second
            for (_, name), tokens in seen.tokens.items()
            if name == p.name
            for tok in tokens
        )
        assert before + after == whole, p.name


def wait_for(predicate: Callable[[], bool], timeout_s: float = 60.0, what: str = "") -> None:
    """Poll ``predicate`` until it holds (bounded); for states another thread reaches."""
    pause = threading.Event()
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"not reached within {timeout_s} s: {what}"
        pause.wait(0.02)


def wait_freed(store: TrajectoryStore) -> None:
    """Every unit freed: the driver's scheduler frees a released mini-batch's units right after
    its reorganizers published it (see NOTE [ Reorganizer restart ] in knitkit/job/recovery.py)."""
    wait_for(lambda: store.metrics()["knitkit/storage/units_live"] == 0, 60, "every unit freed")


def serve_driver(conn: object) -> None:
    """A driver in its own process (spawn target): sends its spec's JSON, then waits forever."""
    data = trajectories(1, 2, seed=0)
    config = driver_config(1, 1, 1, 1, liveness_timeout_s=5.0)
    with config.build(admission=controller(data, 1)) as driver:
        conn.send_bytes(driver.rank_spec().to_json().encode())  # type: ignore[attr-defined]
        conn.recv_bytes()  # type: ignore[attr-defined]


def serve_held_job(conn: object) -> None:
    """A DP2 x CP2 driver in its own process (spawn target), liveness 5 s: writes two
    mini-batches, sends its spec's JSON; on any message, waits until both dp1 groups finished
    ``tb0-mb0``'s train pass (dp0's cannot: the test holds dp0/cp1 before it writes back), says
    so, and waits for the next message (the test SIGKILLs it first)."""
    data = trajectories(4, 2, seed=34)
    config = driver_config(2, 2, 1, 1, liveness_timeout_s=5.0)
    with config.build(admission=controller(data, 2)) as driver:
        for trajectory in data:
            driver.write(trajectory)
        conn.send_bytes(driver.rank_spec().to_json().encode())  # type: ignore[attr-defined]
        conn.recv_bytes()  # type: ignore[attr-defined]
        dp1 = {"backbone/dp1/cp0", "backbone/dp1/cp1"}
        done = driver.ledger("tb0-mb0").passes["train"].done
        wait_for(lambda: dp1 <= done, 120, "dp1 finished tb0-mb0's train pass")
        conn.send_bytes(b"dp1 trained")  # type: ignore[attr-defined]
        conn.recv_bytes()  # type: ignore[attr-defined]


def rank_process(spec_json: str, coords: RankCoords, results: object) -> None:
    """A rank in its own spawned process: ``rank_loop``, its record put on ``results``."""
    torch.set_num_threads(1)
    results.put(rank_loop(RankSpec.from_json(spec_json), coords))  # type: ignore[attr-defined]
