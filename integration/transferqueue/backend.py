"""TransferQueue as a physical backend under knitkit's logical storage: one TQ row per atomic unit."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from knitkit.storage import UnitBackend
from knitkit.storage.backends import ReadCounter, UnitSpec, check_unit, copy_ranges
from knitkit.types import SeqRange, UnitKey

UNIT_FIELD = "unit"
"""The single TQ column of a unit row: the unit's bytes as a flat uint8 tensor."""

# NOTE [ One TransferQueue row per atomic unit ]
#
# knitkit addresses atomic units (one trajectory's field, one content-addressed image), so each
# unit is one TQ KV row keyed by ``str(UnitKey)``: a per-field update rewrites one row, an image
# shared by a GRPO sample's n trajectories is one row, and every unit is readable alone. One row
# per trajectory (TQ's usual layout) would force every reader of one field to name the whole
# row's columns and would store a shared image n times. The row holds the unit's raw bytes in one
# uint8 column and its dtype/shape in the row's tag (TQ custom meta), so any process can answer
# ``spec`` from TQ, and no dtype goes through TQ's torch/nested-tensor conversion.
# TQ 0.1.11 moves whole rows: a range read fetches the unit and slices it here, and
# ``bytes_read`` counts the whole unit (the bytes TQ actually moved), not just the ranges.


@dataclass(frozen=True, slots=True)
class TransferQueueConnection:
    """How any process reaches a running TransferQueue: its merged config (picklable)."""

    config: Any
    """The ``DictConfig`` returned by ``transfer_queue.init`` (controller and storage ZMQ info)."""

    def client(self) -> Any:
        """A new ``TransferQueueClient`` for this process; no Ray connection needed."""
        from transfer_queue import TransferQueueClient

        client = TransferQueueClient(
            client_id=f"knitkit-{os.getpid()}-{id(self):x}",
            controller_info=self.config.controller.zmq_info,
        )
        name = self.config.backend.storage_backend
        client.initialize_storage_manager(manager_type=name, config=self.config.backend[name])
        return client


START_TIMEOUT_S = 300.0
"""Default bound of ``start_transfer_queue`` (a cold Ray start on a loaded node takes a minute)."""


def start_transfer_queue(
    num_cpus: int = 4, sampler: Any = None, *, timeout_s: float = START_TIMEOUT_S
) -> TransferQueueConnection:
    """Start Ray (if needed) and TQ with its default storage (two SimpleStorage units), in
    polling mode, with ``sampler`` (a TQ sampler class or instance, e.g. ``RankAwareSampler``
    for its ``StreamingDataLoader``) or TQ's default one.

    TQ's controller and each storage unit take one logical CPU, and ``transfer_queue.init``
    waits for all of them without a bound: with fewer CPUs it never returns (NOTE [ Bounded
    TransferQueue start ]). So a Ray with fewer logical CPUs than that is refused at once
    (``ValueError``), and a start that does not finish within ``timeout_s`` (CPUs held by
    other actors) is abandoned, its actors killed, with a ``TimeoutError`` saying what to do.
    ``num_cpus`` sizes a Ray started here (it may over-subscribe the machine's cores). A Ray
    runtime started here listens on loopback only (``knitkit.integration.ray.start_ray``);
    across nodes, start Ray first with ``start_ray(node_ip_address=...)`` or join one with
    ``ray.init(address=...)``.
    """
    import ray
    import transfer_queue as tq
    from omegaconf import OmegaConf

    from knitkit.integration.ray import start_ray

    if not ray.is_initialized():
        start_ray(num_cpus=num_cpus)  # loopback only: TQ unpickles what its sockets receive
    controller: dict[str, Any] = {"polling_mode": True}
    if sampler is not None:
        controller["sampler"] = sampler
    conf = OmegaConf.create({"controller": controller}, flags={"allow_objects": True})
    units = int(OmegaConf.load(_default_config()).backend.SimpleStorage.num_data_storage_units)
    need = 1 + units
    total = ray.cluster_resources().get("CPU", 0.0)
    if total < need:
        raise ValueError(
            f"TransferQueue needs {need} logical CPUs (its controller and {units} storage "
            f"units take one each) but this Ray cluster has {total:g}; it would wait forever. "
            f"Call start_transfer_queue(num_cpus={need}) or more, or give Ray more CPUs"
        )
    result: list[Any] = []
    thread = threading.Thread(
        target=_capture, args=(tq.init, conf, result), name="knitkit-tq-start", daemon=True
    )
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        free = ray.available_resources().get("CPU", 0.0)
        _abandon_start(units, thread)
        raise TimeoutError(
            f"TransferQueue did not start within {timeout_s:g} s: its controller and {units} "
            f"storage units need {need} free logical CPUs and {free:g} of {total:g} were free "
            "(other actors hold the rest). Free them, start Ray with more CPUs, or pass a "
            "larger timeout_s; the half-started TransferQueue was shut down"
        )
    if isinstance(result[0], BaseException):
        raise result[0]
    return TransferQueueConnection(result[0])


# NOTE [ Bounded TransferQueue start ]
#
# transfer_queue.init creates its controller and storage-unit actors (one logical CPU each) and
# then blocks in ray.get on each of them with no timeout: an actor Ray cannot place (too few
# free CPUs) keeps it waiting forever, with no error. start_transfer_queue refuses at once when
# the cluster has fewer CPUs than TQ needs at all, and otherwise runs init in a daemon thread
# joined for timeout_s; on expiry it kills TQ's named actors (so the blocked ray.get raises and
# the thread ends) and shuts TQ's module state down with transfer_queue.close().


def _capture(init: Any, conf: Any, result: list[Any]) -> None:
    try:
        result.append(init(conf))
    except BaseException as error:  # handed to the caller's thread
        result.append(error)


def _abandon_start(units: int, thread: threading.Thread) -> None:
    """Kill the actors of a start that timed out and reset TQ (NOTE [ Bounded TransferQueue start ])."""
    import ray
    import transfer_queue as tq

    names: list[tuple[str, str | None]] = [("TransferQueueController", "transfer_queue")]
    names += [(f"TransferQueueStorageUnit#{i}", None) for i in range(units)]
    for name, namespace in names:
        try:
            ray.kill(ray.get_actor(name, namespace=namespace))
        except ValueError:
            continue
    thread.join(60)  # its ray.get on a killed actor raises now
    try:
        tq.close()
    except Exception:  # already half torn down: nothing more to free
        return


def _default_config() -> Any:
    from importlib import resources

    return resources.files("transfer_queue") / "config.yaml"


def stop_transfer_queue() -> None:
    """Close TQ (controller, storage units) and shut Ray down."""
    import ray
    import transfer_queue as tq

    tq.close()
    ray.shutdown()


class TransferQueueBackend(UnitBackend):
    """``UnitBackend`` over TransferQueue's KV rows (see NOTE [ One TransferQueue row per atomic
    unit ]); pickles to a reader elsewhere."""

    def __init__(self, connection: TransferQueueConnection, partition_id: str = "knitkit-units"):
        self.connection = connection
        self.partition_id = partition_id
        self._client: Any = None
        self._specs: dict[UnitKey, UnitSpec] = {}
        self._reads = ReadCounter()

    def put(self, key: UnitKey, array: np.ndarray) -> None:
        if self._row(key).size:
            raise KeyError(f"unit {key} already exists in TQ partition {self.partition_id!r}")
        self._write(key, np.asarray(check_unit(key, array), order="C"))

    def replace(self, key: UnitKey, array: np.ndarray) -> None:
        spec = self.spec(key)
        if np.dtype(spec.dtype) != array.dtype or spec.shape != array.shape:
            raise ValueError(
                f"replace of unit {key}: stored {spec.dtype}{list(spec.shape)}, got "
                f"{array.dtype}{list(array.shape)}; delete and put to change dtype or shape"
            )
        self._write(key, np.asarray(array, order="C"))

    def spec(self, key: UnitKey) -> UnitSpec:
        if key not in self._specs:
            tags = self._row(key).custom_meta
            if not tags:
                raise KeyError(f"unknown unit {key} in TQ partition {self.partition_id!r}")
            tag = tags[0]
            self._specs[key] = UnitSpec(str(tag["dtype"]), tuple(int(s) for s in tag["shape"]))
        return self._specs[key]

    def read(
        self,
        key: UnitKey,
        ranges: Sequence[SeqRange] | None = None,
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        spec = self.spec(key)

        def fill(checked: tuple[SeqRange, ...] | None, dst: np.ndarray) -> int:
            row = self._row(key).select_fields([UNIT_FIELD])
            column = self._client_or_new().get_data(row)[UNIT_FIELD]
            raw = column.unbind()[0] if column.is_nested else column[0]
            unit = raw.numpy().view(spec.dtype).reshape(spec.shape)
            copy_ranges(unit, checked, dst)
            return int(unit.nbytes)  # TQ moves whole units

        return self._reads.read(key, spec, ranges, out, fill)

    def delete(self, key: UnitKey) -> None:
        row = self._row(key)
        if not row.size:
            raise KeyError(f"unknown unit {key} in TQ partition {self.partition_id!r}")
        self._client_or_new().clear_samples(row)
        self._specs.pop(key, None)

    def keys(self) -> Iterator[UnitKey]:
        listed = self._client_or_new().kv_list(self.partition_id)
        return iter([UnitKey.parse(k) for k in listed.get(self.partition_id, {})])

    @property
    def bytes_read(self) -> int:
        return self._reads.bytes

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None

    def __getstate__(self) -> dict[str, Any]:
        return {"connection": self.connection, "partition_id": self.partition_id}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["connection"], state["partition_id"])  # type: ignore[misc]

    def _write(self, key: UnitKey, array: np.ndarray) -> None:
        import torch
        from tensordict import TensorDict

        client = self._client_or_new()
        row = client.kv_retrieve_meta(keys=[str(key)], partition_id=self.partition_id, create=True)
        spec = UnitSpec(array.dtype.name, tuple(int(s) for s in array.shape))
        row.update_custom_meta([{"dtype": spec.dtype, "shape": list(spec.shape)}])
        flat = torch.from_numpy(array.reshape(-1).view(np.uint8).copy())
        client.put(TensorDict({UNIT_FIELD: flat[None]}, batch_size=1), row)
        self._specs[key] = spec

    def _row(self, key: UnitKey) -> Any:
        return self._client_or_new().kv_retrieve_meta(
            keys=[str(key)], partition_id=self.partition_id, create=False
        )

    def _client_or_new(self) -> Any:
        if self._client is None:
            self._client = self.connection.client()
        return self._client
