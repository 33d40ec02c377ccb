"""DedupEncoder: encode each unique unit once per mini-batch, serve cached leaves, run one deferred backward."""

from __future__ import annotations

import contextlib
import enum
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial

import torch

from knitkit.encoder_dedup.agreement import Verdict, agree
from knitkit.encoder_dedup.plan import Exchange, RankRoute
from knitkit.encoder_dedup.transport import RowTransport
from knitkit.types import UnitKey

EncodeFn = Callable[[Sequence[UnitKey]], torch.Tensor]
"""Encodes one encoder micro-batch of units into their rows ``[sum of num_rows, hidden]``, in order."""


@dataclass(frozen=True, slots=True)
class Folded:
    """A caller's agreement folded into ``encode``'s handshake (``agree``'s ``extra`` and
    ``verdict``): e.g. the Megatron step's (NOTE [ One handshake per step ] in
    ``integration/megatron/step.py``)."""

    extra: tuple[int, ...]
    verdict: Verdict


class Phase(enum.Enum):
    """Where a DedupEncoder is in its mini-batch: before encode, serving features, or done."""

    READY = "ready"
    ENCODED = "encoded"
    DONE = "done"


class DedupEncoder:
    """One mini-batch of deduplicated encoding on one rank (see README: encode -> features -> backward).

    NOTE [ Graph lifetime ]: the encoder outputs of ``encode`` keep their autograd graphs until
    ``backward``; backbone micro-batches see only ``detach().requires_grad_()`` gathers of the local
    cache, so their backward stops at that leaf. A post-accumulate hook adds each leaf's gradient
    into ``cache_grad`` by cache row (``index_add_``) and drops the leaf's ``.grad``, so a finished
    micro-batch holds nothing once the caller drops its features. ``backward`` returns each rank's
    owned gradient rows to the encoding ranks, sums them there and runs ONE backward through the
    retained graphs. Every rank of the transport must call ``encode`` and ``backward`` (collectives);
    each runs its local work, then a bounded handshake that checks the ranks agree and carries any
    rank's local failure to its peers, then the row exchange, bounded too (NOTE [ Handshake before
    rows move ] in ``agreement.py``).
    """

    def __init__(
        self,
        route: RankRoute,
        transport: RowTransport,
        *,
        hidden: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        grad_dtype: torch.dtype | None = None,
        handshake_timeout_s: float = 600.0,
    ) -> None:
        """``grad_dtype`` is where feature gradients accumulate across micro-batches; by default
        ``dtype`` widened to at least float32 (float64 stays float64, bfloat16 sums in float32).
        ``handshake_timeout_s`` bounds the wait for peers at the start of ``encode`` and
        ``backward`` (NOTE [ Handshake before rows move ] in ``agreement.py``); it must cover the
        skew between ranks, e.g. one rank still running backbone micro-batches."""
        if transport.rank != route.rank:
            raise ValueError(
                f"route is for rank {route.rank} but the transport is rank {transport.rank}"
            )
        spans = {len(route.forward.send_counts), len(route.backward.send_counts)}
        if spans != {transport.world_size}:
            raise ValueError(
                f"route spans {sorted(spans)} ranks but the transport has {transport.world_size}; "
                "build the routing plan with the transport's world_size"
            )
        self.route = route
        self.transport = transport
        self.hidden, self.dtype, self.device = hidden, dtype, torch.device(device)
        self.grad_dtype = grad_dtype or torch.promote_types(dtype, torch.float32)
        self.handshake_timeout_s = handshake_timeout_s
        self.phase = Phase.READY
        self.keep_graph = True
        self.encoded_units = 0
        self.encode_s = 0.0
        self.backward_s = 0.0
        self._outputs: list[torch.Tensor] = []
        self._cache = torch.empty(0, hidden, dtype=dtype, device=self.device)
        self._cache_grad = torch.empty(0, hidden, dtype=self.grad_dtype, device=self.device)
        self._index = [ix.to(self.device) for ix in route.micro_batch_index]

    def encode(
        self, encode_fn: EncodeFn, *, keep_graph: bool = True, folded: Folded | None = None
    ) -> None:
        """Run this rank's encoder micro-batches (graphs kept) and route detached rows to consumers.

        ``keep_graph=False`` is for forward-only passes (old / reference log-probs): the encoder
        runs under ``torch.no_grad()``, no outputs or gradient buffer are kept, ``features``
        returns plain gathers and ``backward`` is refused. If ``encode_fn`` raises on one rank,
        that rank raises its error and every peer raises ``PeerFailed`` naming it, before any row
        moves. ``folded``: a caller's agreement that rides in the same handshake (its verdict
        judges every rank's row first, on every rank, also when this rank failed).
        """
        started = time.perf_counter()
        expect = partial(self._expect, Phase.READY, "encode")
        self._locally("encode", keep_graph, expect, folded)
        self.keep_graph = keep_graph
        run = partial(self._run_encoder, encode_fn, keep_graph)
        self._locally("encode", keep_graph, run, folded)
        self._agree("encode", None, keep_graph, folded)
        table = self._table([out.detach().to(self.dtype) for out in self._outputs], self.dtype)
        received = self._exchange(table, self.route.forward, "encode")
        self._cache = table.new_empty(self.route.cache_rows, self.hidden)
        self._cache.index_copy_(0, self.route.forward.recv_index.to(self.device), received)
        if not keep_graph:
            self._outputs = []
        else:
            self._cache_grad = torch.zeros(
                self.route.cache_rows, self.hidden, dtype=self.grad_dtype, device=self.device
            )
        self.phase = Phase.ENCODED
        self.encode_s = time.perf_counter() - started

    def features(self, micro_batch: int) -> torch.Tensor:
        """Features of backbone micro-batch ``micro_batch``: a fresh leaf gathered from the cache."""
        self._expect(Phase.ENCODED, "features")
        index = self._index[micro_batch]
        if not self.keep_graph:
            return self._cache.index_select(0, index)
        leaf = self._cache.index_select(0, index).detach().requires_grad_()
        # see NOTE [ Graph lifetime ]: the backbone's backward stops at this leaf
        leaf.register_post_accumulate_grad_hook(partial(self._accumulate, index))
        return leaf

    def backward(self, *, scale: float = 1.0) -> None:
        """Return owned gradient rows to the encoding ranks and run the one deferred encoder backward.

        ``scale`` multiplies the summed feature gradients before the encoder backward (a trainer
        that averages encoder gradients over more replicas than encoded, e.g. Megatron's TP
        average: see ``integration/megatron/grads.py``).
        """
        started = time.perf_counter()
        self._locally("backward", self.keep_graph, self._check_backward)
        self._agree("backward", None, self.keep_graph)
        received = self._exchange(self._cache_grad, self.route.backward, "backward")
        grad = torch.zeros(
            self.route.table_rows, self.hidden, dtype=self.grad_dtype, device=self.device
        )
        grad.index_add_(0, self.route.backward.recv_index.to(self.device), received)
        if scale != 1.0:
            grad.mul_(scale)
        self._cache = self._cache.new_empty(0, self.hidden)  # a [:0] view would keep the storage
        self._cache_grad = self._cache_grad.new_empty(0, self.hidden)
        outputs, self._outputs = self._outputs, []
        pairs = [
            (out, g.to(out.dtype))
            for out, g in zip(outputs, grad.split(list(self.route.encoder_rows)), strict=True)
            if out.requires_grad  # a frozen encoder has nothing to back-propagate
        ]
        if pairs:
            torch.autograd.backward([out for out, _ in pairs], [g for _, g in pairs])
        self.phase = Phase.DONE
        self.backward_s = time.perf_counter() - started

    def metrics(self) -> dict[str, float]:
        """This rank's figures for the mini-batch (see the metrics convention in the README).

        ``knitkit/dedup/units_encoded``: unique units this rank encoded;
        ``knitkit/dedup/rows_encoded``: feature rows they produced;
        ``knitkit/dedup/rows_cached``: distinct feature rows this rank's backbone consumes;
        ``knitkit/dedup/rows_served``: feature rows handed to its backbone micro-batches (a row
        used by several micro-batches, or twice in one, counts each time);
        ``knitkit/dedup/encode_s`` / ``backward_s``: host wall seconds of ``encode`` (encoder,
        handshake, row exchange) and ``backward`` (handshake, exchange, encoder backward); on
        CUDA, kernels still queued when they return are not counted.
        """
        return {
            "knitkit/dedup/units_encoded": float(self.encoded_units),
            "knitkit/dedup/rows_encoded": float(self.route.table_rows),
            "knitkit/dedup/rows_cached": float(self.route.cache_rows),
            "knitkit/dedup/rows_served": float(sum(len(ix) for ix in self.route.micro_batch_index)),
            "knitkit/dedup/encode_s": self.encode_s,
            "knitkit/dedup/backward_s": self.backward_s,
        }

    @property
    def cache_grad(self) -> torch.Tensor:
        """Gradient accumulated so far per cache row (summed over micro-batches and repeats)."""
        return self._cache_grad

    def _accumulate(self, index: torch.Tensor, leaf: torch.Tensor) -> None:
        assert leaf.grad is not None
        self._cache_grad.index_add_(0, index, leaf.grad.to(self.grad_dtype))
        leaf.grad = None

    def _agree(
        self,
        phase: str,
        failure: Exception | None,
        keep_graph: bool,
        folded: Folded | None = None,
    ) -> None:
        """The bounded handshake; ``failure`` (this rank's local error) travels to the peers."""
        if self.transport.world_size == 1 and folded is None:
            return
        agree(
            self.route,
            self.transport,
            phase,
            device=self.device,
            timeout_s=self.handshake_timeout_s,
            problem="" if failure is None else f"{type(failure).__name__}: {failure}",
            keep_graph=keep_graph,
            extra=() if folded is None else folded.extra,
            verdict=None if folded is None else folded.verdict,
        )

    def _run_encoder(self, encode_fn: EncodeFn, keep_graph: bool) -> None:
        """This rank's encoder micro-batches, outputs kept; nothing kept if one of them fails."""
        try:
            for keys, rows in zip(
                self.route.encoder_micro_batches, self.route.encoder_rows, strict=True
            ):
                with torch.set_grad_enabled(keep_graph and torch.is_grad_enabled()):
                    out = encode_fn(keys)
                if tuple(out.shape) != (rows, self.hidden):
                    raise ValueError(
                        f"encode_fn({[str(k) for k in keys]}) returned shape {tuple(out.shape)}; "
                        f"expected ({rows}, {self.hidden}): one row per placeholder token, in key "
                        "order"
                    )
                self._outputs.append(out)
                self.encoded_units += len(keys)
        except Exception:
            self._outputs, self.encoded_units = [], 0
            raise

    def _check_backward(self) -> None:
        self._expect(Phase.ENCODED, "backward")
        if not self.keep_graph:
            raise RuntimeError(
                "DedupEncoder.backward() after encode(keep_graph=False): a forward-only pass "
                "has no encoder backward; encode with keep_graph=True for a training step"
            )

    def _locally(
        self,
        phase: str,
        keep_graph: bool,
        work: Callable[[], None],
        folded: Folded | None = None,
    ) -> None:
        """Run this rank's local ``work`` for ``phase``; if it raises, tell the peers, then re-raise.

        The failure travels in the handshake (NOTE [ Handshake before rows move ] in
        ``agreement.py``): peers raise ``PeerFailed`` naming it; here it stays the error raised.
        """
        try:
            work()
        except Exception as error:
            with contextlib.suppress(Exception):  # peers failed too, or never came: ours wins
                self._agree(phase, error, keep_graph, folded)
            raise

    def _exchange(self, rows: torch.Tensor, step: Exchange, phase: str) -> torch.Tensor:
        """One routed row exchange, after the handshake; bounded, naming the phase and the peers."""
        send = rows.index_select(0, step.send_index.to(self.device))
        me, limit = self.transport.rank, self.handshake_timeout_s
        direction = "feature" if phase == "encode" else "gradient"
        try:
            return self.transport.exchange(
                send, step.send_counts, step.recv_counts, timeout_s=limit
            )
        except TimeoutError as error:
            raise TimeoutError(
                f"rank {me}, phase {phase!r}: the {direction} row exchange did not complete within "
                f"{limit:g} s after every rank agreed ({error}); that peer stopped after the "
                "handshake (it died or blocks outside knitkit)"
            ) from error
        except RuntimeError as error:
            raise RuntimeError(
                f"rank {me}, phase {phase!r}: the {direction} row exchange failed after every rank "
                f"agreed ({error}); a peer stopped after the handshake"
            ) from error

    def _table(self, outputs: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        if not outputs:
            return torch.empty(0, self.hidden, dtype=dtype, device=self.device)
        return torch.cat(outputs)

    def _expect(self, phase: Phase, call: str) -> None:
        if self.phase is not phase:
            raise RuntimeError(
                f"DedupEncoder.{call}() in phase {self.phase.value!r}; the order per mini-batch is "
                "encode() -> features()/backbone backward per micro-batch -> backward()"
            )
