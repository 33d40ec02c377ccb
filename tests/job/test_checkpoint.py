"""Driver checkpoints: resume re-serves exactly the untrained mini-batches; saves are atomic and owner-only."""

from __future__ import annotations

import json
import os
import shutil
import stat
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from job_harness import (
    PASSES,
    Hold,
    Seen,
    assert_trained_once,
    controller,
    driver_config,
    grid,
    join,
    run_ranks,
    token_ids,
    trajectories,
    wait_for,
)

from knitkit.job import Output, Pass, checkpoint_state
from knitkit.job.checkpoint import CheckpointDir, read_json, write_json
from knitkit.storage import SafetensorsBackend, Trajectory, TrajectoryStore


def test_resume_trains_every_admitted_trajectory_once_per_pass(tmp_path: Path) -> None:
    """Invariant over an interrupted run and its resumption together: every admitted token is
    consumed exactly once per pass (nothing lost, nothing twice) although the resumed job has
    another layout (DP 1 -> DP 2: its untrained mini-batches are re-planned), the checkpoint is
    plain JSON, and the resumed driver names exactly the trajectories to re-write."""
    data = trajectories(8, 2, seed=3)
    by_id = {t.trajectory_id: t for t in data}
    order, seen_first, state = _checkpoint_after_two(data, data, tmp_path)
    assert len(order) == 4
    assert state["released"] == 2 and [p["id"] for p in state["pending"]] == list(order[2:])

    second = driver_config(2, 1, 1, 1).build(admission=controller(data, 4))
    with second:
        resumed = second.load_state_dict(state)
        assert resumed.released == 2 and resumed.pending == tuple(order[2:])
        assert resumed.replanned["dp"] == (1, 2)
        pending_ids = {t for p in state["pending"] for t in p["trajectories"]}
        assert set(second.reissue()) == pending_ids
        with pytest.raises(ValueError, match="reissue"):
            second.write(next(t for t in data if t.trajectory_id not in pending_ids))
        threads, seen_second = run_ranks(second.rank_spec(), grid(2, 1, 1, 1))
        for tid in second.reissue():
            second.write(by_id[tid])
        assert second.reissue() == ()
        second.finish()
        second.drain(120)
        join(threads)
        assert second.minibatches() == order
    assert not [s.error for s in seen_second if s.error]
    assert not [m for s in seen_first + seen_second for m in s.mismatches]
    assert_trained_once(seen_first, order[:2], seen_second, data)
    first_mbs = {mb for s in seen_first for (mb, name) in s.tokens if name == "train"}
    assert first_mbs == set(order[:2]), "the first run trained past its checkpoint"


def test_a_durable_store_resumes_without_re_writing_anything(tmp_path: Path) -> None:
    """Over a ``SafetensorsBackend`` the checkpoint holds the store's index of the untrained
    and waiting trajectories (rollout fields); the first driver stops after its checkpoint (its
    clean-up frees those trajectories: their units outlive the frees) and a new driver over a
    new backend of the same directory, with another layout, restores them all: nothing to
    re-write, and every admitted token is still consumed exactly once per pass over both runs.
    On 6bc5c38 the resumed driver demanded every trajectory again, and a driver over a
    ``SafetensorsBackend`` failed its first pass (its buffered units were never flushed for the
    reorganizers)."""
    data = trajectories(8, 2, seed=4)
    directory = str(tmp_path / "units")
    first_store = TrajectoryStore(SafetensorsBackend(directory))
    order, seen_first, state = _checkpoint_after_two(data, data[:15], tmp_path, first_store)
    first_store.close()
    assert len(order) == 3
    needed = {t for p in state["pending"] for t in p["trajectories"]} | set(state["waiting"])
    assert len(needed) == 7  # the third mini-batch (4) and the 3 waiting

    store = TrajectoryStore(SafetensorsBackend(directory))
    with driver_config(2, 1, 1, 1).build(admission=controller(data, 4), store=store) as second:
        resumed = second.load_state_dict(state)
        assert set(resumed.restored) == needed and resumed.reissue == second.reissue() == ()
        threads, seen_second = run_ranks(second.rank_spec(), grid(2, 1, 1, 1))
        second.write(data[15])  # the rest of the rollout goes on
        wait_for(lambda: len(second.minibatches()) == 4, what="the fourth mini-batch admitted")
        second.finish()
        second.drain(120)
        join(threads)
        assert second.minibatches()[:3] == order
    store.close()
    assert not [s.error for s in seen_second if s.error]  # the first run's rank saw the close
    assert not [m for s in seen_first + seen_second for m in s.mismatches]
    assert_trained_once(seen_first, order[:2], seen_second, data)


def test_a_durable_resume_after_a_kill_at_the_train_pass_serves_the_new_write_backs(
    tmp_path: Path,
) -> None:
    """Issue 30.7, the deterministic case: a job over a ``SafetensorsBackend`` is killed at the
    train pass of its first untrained mini-batch, after that mini-batch's forward-only
    write-backs were flushed into a shard of their own (the kill: the directory as it is then).
    The resumed driver's reorganizers start before ``load_state_dict`` deletes those
    write-backs and unlinks their shard; the resumed job writes them again, and its train pass
    reads them from their new shard (NOTE [ Disk readers follow the owner ]): no
    ``FileNotFoundError``, no old bytes, every token trained once per pass over both runs."""
    data = trajectories(8, 2, seed=5)
    store = TrajectoryStore(SafetensorsBackend(str(tmp_path / "units")))
    first = driver_config(1, 1, 1, 1).build(admission=controller(data, 4), store=store)
    hold = Hold("", "train")
    killed = tmp_path / "killed"
    try:
        for trajectory in data:
            first.write(trajectory)
        order = first.minibatches()
        hold.minibatch_id = order[2]
        threads, seen_first = run_ranks(first.rank_spec(), grid(1, 1, 1, 1), hold=hold)
        assert hold.reached.wait(120), "the rank never reached the third mini-batch's train pass"
        state = json.loads(json.dumps(first.state_dict(trained=2, timeout_s=60)))
        # the directory as a kill at one instant leaves it: every method of the backend that
        # writes (put, flush's shard and its rename, the journal) holds its state lock (NOTE
        # [ Owner threads ]), and the driver's scheduler thread may flush during the copy
        with store.backend._state_lock:  # type: ignore[attr-defined]
            shutil.copytree(tmp_path / "units", killed)
    finally:
        first.close()
        hold.release.set()
    join(threads)
    store.close()

    store = TrajectoryStore(SafetensorsBackend(str(killed)))
    with driver_config(1, 1, 1, 1).build(admission=controller(data, 4), store=store) as second:
        resumed = second.load_state_dict(state)
        assert resumed.reissue == () and resumed.pending == order[2:]
        threads, seen_second = run_ranks(second.rank_spec(), grid(1, 1, 1, 1))
        second.finish()
        second.drain(120)
        join(threads)
    store.close()
    assert not [s.error for s in seen_second if s.error]
    assert not [m for s in seen_second for m in s.mismatches]
    assert_trained_once(seen_first, order[:2], seen_second, data)


def test_a_checkpoint_holds_writers_only_for_its_copy_and_names_only_fsynced_shards(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 30.3, the driver's part: ``state_dict`` holds the driver's lock only to copy what
    it saves (NOTE [ Checkpoint without holding writers ]): with its encoding held on an event,
    a rollout write completes, and the state is the copy from before that write. Issue 30.13:
    over a ``SafetensorsBackend`` every shard holding a unit the state names, and the shard
    directory, are fsynced before the checkpoint holding the state is committed (NOTE
    [ Durable shards ]); observed through ``os.fsync`` (a wrapper that records each
    descriptor's path, then syncs)."""
    encoding, release, wrote = threading.Event(), threading.Event(), threading.Event()
    encode, fsync = checkpoint_state.encode, os.fsync
    synced: list[str] = []

    def held(state: checkpoint_state.DriverState) -> dict[str, Any]:
        encoding.set()
        assert release.wait(60), "the test never released the encoding"
        return encode(state)

    def recording(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        fsync(fd)

    monkeypatch.setattr(checkpoint_state, "encode", held)
    monkeypatch.setattr(os, "fsync", recording)
    data = trajectories(4, 2, seed=6)
    directory = (tmp_path / "units").resolve()
    ckpt = CheckpointDir(tmp_path / "ckpt")
    saved: dict[str, Any] = {}
    store = TrajectoryStore(SafetensorsBackend(str(directory)))
    with driver_config(1, 1, 1, 1).build(admission=controller(data, 2), store=store) as driver:
        for trajectory in data[:2]:  # waiting: less than a mini-batch
            driver.write(trajectory)
        saver = threading.Thread(target=lambda: saved.update(driver.state_dict(trained=0)))
        writer = threading.Thread(target=lambda: (driver.write(data[2]), wrote.set()))
        saver.start()
        try:
            assert encoding.wait(60), "state_dict never reached its encoding"
            writer.start()
            assert wrote.wait(30), "the write waited for the checkpoint's encoding"
        finally:
            release.set()
            saver.join(60)
            writer.join(60)
        assert saved["waiting"] == sorted(t.trajectory_id for t in data[:2])
        named = {str(p) for p in directory.glob("shard-*.safetensors")}
        ckpt.stage(0)
        write_json(ckpt.staging(0) / "knitkit.json", saved)
        ckpt.commit(0)
    store.close()
    assert named
    committing = next(i for i, p in enumerate(synced) if not p.startswith(str(directory)))
    assert named | {str(directory)} <= set(synced[:committing]), (named, synced)


def _checkpoint_after_two(
    data: list[Trajectory],
    written: list[Trajectory],
    directory: Path,
    store: TrajectoryStore | None = None,
) -> tuple[tuple[str, ...], list[Seen], dict[str, Any]]:
    """A DP1 job writes ``written``; its rank consumes the first two mini-batches and stops at
    the third (the step boundary); the driver's checkpoint (``trained=2``) goes through a JSON
    file, then the driver closes. Returns the serving order, what the rank saw, the state."""
    first = driver_config(1, 1, 1, 1).build(admission=controller(data, 4), store=store)
    hold = Hold("", "old")
    try:
        for trajectory in written:
            first.write(trajectory)
        order = first.minibatches()
        hold.minibatch_id = order[2]
        threads, seen = run_ranks(first.rank_spec(), grid(1, 1, 1, 1), hold=hold)
        assert hold.reached.wait(120), "the rank never reached the third mini-batch"
        write_json(directory / "driver.json", first.state_dict(trained=2, timeout_s=60))
    finally:
        first.close()
        hold.release.set()
    join(threads)
    return order, seen, read_json(directory / "driver.json")


def test_resume_refuses_other_passes_naming_them() -> None:
    """A checkpoint of other passes is refused naming the pass that differs; a checkpoint whose
    mini-batches are not released yet times out naming them; nothing changes on refusal."""
    data = trajectories(4, 2, seed=1)
    with driver_config(1, 1, 1, 1).build(admission=controller(data, 2)) as driver:
        for trajectory in data:
            driver.write(trajectory)
        with pytest.raises(TimeoutError, match="tb0-mb0"):
            driver.state_dict(trained=1, timeout_s=0.5)
        with pytest.raises(ValueError, match="only 2 mini-batches"):
            driver.state_dict(trained=3)
        state = json.loads(json.dumps(driver.state_dict(trained=0)))
    other = (PASSES[0], Pass("train", reads=("tokens", "old_lp"), encodes=True))
    with driver_config(1, 1, 1, 1, passes=other).build(admission=controller(data, 2)) as driver:
        with pytest.raises(ValueError, match="'train': saved"):
            driver.load_state_dict(state)
        assert driver.minibatches() == () and driver.reissue() == ()
    changed = (Pass("old", reads=("tokens",), writes=(Output("old_lp", "float16"),)), PASSES[1])
    config = driver_config(1, 1, 1, 1, passes=changed)
    with (
        config.build(admission=controller(data, 2)) as driver,
        pytest.raises(ValueError, match="'old': saved"),
    ):
        driver.load_state_dict(state)


def test_resume_of_nothing_trained_serves_everything(tmp_path: Path) -> None:
    """A checkpoint taken before any pass (``trained=0``) resumes every admitted mini-batch and
    every waiting trajectory; the job then admits and serves as if never interrupted. The state
    sits beside a model's in a ``torch.save`` checkpoint and loads with ``weights_only=True``
    (plain data: nothing to unpickle)."""
    data = trajectories(6, 2, seed=5)
    by_id = {t.trajectory_id: t for t in data}
    with driver_config(1, 1, 1, 1).build(admission=controller(data, 3)) as driver:
        for trajectory in data[:9]:
            driver.write(trajectory)
        admitted = driver.minibatches()
        model = torch.nn.Linear(2, 2)
        saved = {"model": model.state_dict(), "knitkit": driver.state_dict(trained=0)}
        torch.save(saved, tmp_path / "ckpt.pt")
    state = torch.load(tmp_path / "ckpt.pt", weights_only=True)["knitkit"]
    assert len(admitted) == 2 and len(state["waiting"]) == 1
    with driver_config(1, 1, 1, 1).build(admission=controller(data, 3)) as driver:
        driver.load_state_dict(state)
        threads, seen = run_ranks(driver.rank_spec(), grid(1, 1, 1, 1))
        assert len(driver.reissue()) == 9
        for tid in driver.reissue():
            driver.write(by_id[tid])
        for trajectory in data[9:]:
            driver.write(trajectory)
        wait_for(lambda: len(driver.minibatches()) == 3, what="the third mini-batch admitted")
        driver.finish()
        driver.drain(120)
        join(threads)
    assert not [s.error for s in seen if s.error]
    train = Counter(
        tok for (_, name), toks in seen[0].tokens.items() if name == "train" for tok in toks
    )
    assert train == Counter(tok for t in data for tok in token_ids(t))


def test_checkpoint_dir_keeps_the_previous_one_until_the_rename(tmp_path: Path) -> None:
    """A save interrupted at any point before the rename leaves the previous checkpoint the
    newest loadable one; a directory with a missing or lying marker is never picked; staging
    leftovers and all but the newest ``keep`` are pruned; everything is owner-only."""
    root = CheckpointDir(tmp_path / "ckpt", keep=2)
    assert root.latest() is None
    for step in (1, 2):
        write_json(root.stage(step) / "knitkit.json", {"step": step})
        root.commit(step)
    assert root.latest() == root.path(2)
    # Crash after the files of step 3 are written, before commit: step 2 stays the newest.
    staged = root.stage(3)
    write_json(staged / "knitkit.json", {"step": 3})
    assert root.latest() == root.path(2)
    # A directory named like a checkpoint but without its marker, or whose marker names a
    # missing file (the rename reached the disk before the data), is skipped.
    root.path(5).mkdir()
    write_json(root.path(5) / "knitkit.json", {"step": 5})
    root.path(4).mkdir()
    (root.path(4) / "COMPLETE").write_text(json.dumps({"files": ["rank0.pt"]}))
    assert root.latest() == root.path(2)
    # The retried save of step 3 starts fresh, commits, and prunes.
    staged = root.stage(3)
    assert list(staged.iterdir()) == []
    write_json(staged / "knitkit.json", {"step": 3})
    root.commit(3)
    assert root.latest() == root.path(3)
    names = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert names == ["step-000000002", "step-000000003", "step-000000004", "step-000000005"]
    assert read_json(root.latest() / "knitkit.json") == {"step": 3}
    assert stat.S_IMODE(os.stat(root.path(3)).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(root.path(3) / "knitkit.json").st_mode) == 0o600
    with pytest.raises(FileExistsError):
        root.stage(3)
