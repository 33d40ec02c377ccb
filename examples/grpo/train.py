"""One rank's GRPO step on megatron-core: forward-only log-prob passes, the train pass, its optimizer steps.

Both data paths (knitkit's handles and the plain reference loop) run their micro-batches through
the same ``Trainer``; they differ only in where the batches come from and in ``dedup``: knitkit
runs the schedule inside ``DedupVLMStep.run`` (each unique image encoded once per pass), the
plain loop calls ``get_forward_backward_func()`` with the vision path inside every micro-batch.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from grpo.loss import Batch, LossConfig, logprob_step, loss_scale, train_step
from knitkit.encoder_dedup import EncodeFn, RankRoute
from knitkit.integration.megatron import DedupVLMStep, ForwardStep, current_device
from knitkit.types import UnitKey

FIGURES = ("loss", "pg", "kl", "nll", "reward", "clipped", "sequences")
"""Per-step sums of the train pass (``loss.grpo_loss``), over the world."""


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One optimizer step as both loops report it."""

    step: int
    trajectory_ids: tuple[str, ...]
    """The mini-batch's trajectories, sorted."""
    figures: dict[str, float]
    """``FIGURES`` of the step, summed over the world."""
    timings: dict[str, float] = field(default_factory=dict)
    """This rank's ``StepClock`` figures of the step (``data_wait_s``, ``wall_s``, ``cpu_s``)."""


def figure_names(figures: dict[str, float]) -> dict[str, float]:
    """The step's figures named for ``knitkit.metrics`` (``knitkit/grpo/<figure>``)."""
    return {f"knitkit/grpo/{name}": value for name, value in figures.items()}


@dataclass(frozen=True, slots=True)
class Dedup:
    """What ``DedupVLMStep.run`` needs beyond the schedule's arguments, for one pass."""

    step: DedupVLMStep
    route: RankRoute
    encode: EncodeFn


# NOTE [ Encoder stand-in ]: ``StandIn.per_token`` stands in for a bigger backbone; without a
# stand-in of its own the vision path stayed the tiny example's (two small linears per image),
# so encoder dedup could save almost nothing, unlike in a real VLM. The vision path gets the
# same kind of work per image row it encodes, ``encoder_ratio`` of the backbone's per token,
# wherever an encode runs: in the plain loop with each micro-batch whose forward encodes its
# images, with dedup at each encode of the unique images (``DedupVLMStep``'s ``encode_fn``). A
# fraction of a matmul is carried to the next encode (an image's ~6 rows are ~0.3 matmul at
# benchmarks/grpo_step.py's ``--work 8``: rounding each encode would drop them all). Like the
# backbone's, it runs once per forward, none in a backward. The ratio of a real VLM and its
# arithmetic: ``ENCODER_WORK_RATIO`` in benchmarks/grpo_step.py.
@dataclass(slots=True)
class StandIn:
    """Fixed CPU work standing in for a bigger model, in 128 x 128 matmuls (each with a tanh):
    real compute, never a sleep, no effect on the results."""

    per_token: float = 0.0
    """The backbone's: matmuls per 64 tokens of each micro-batch (rounded per micro-batch)."""
    encoder_ratio: float = 0.0
    """The vision path's per image row it encodes, as a fraction of the backbone's per token."""
    owed: float = 0.0
    """The vision path's fraction of a matmul not run yet (NOTE [ Encoder stand-in ])."""
    ran: dict[str, int] = field(default_factory=lambda: {"backbone": 0, "encoder": 0})
    """Matmuls run so far, the backbone's and the vision path's."""

    def __bool__(self) -> bool:
        return bool(self.per_token)

    def after_each(self, batches: Iterable[Batch], *, encodes: bool) -> Iterator[Batch]:
        """``batches``, each preceded by the backbone's work for its tokens and, where its
        forward ``encodes`` its images, the vision path's for their rows."""
        for batch in batches:
            self._run("backbone", round(batch["tokens"].numel() / 64 * self.per_token))
            if encodes:
                self.encoded(sum(len(pixels) for pixels, _, _ in batch.get("images") or ()))
            yield batch

    def encoding(self, encode: EncodeFn) -> EncodeFn:
        """``encode``, each call followed by the vision path's work for the rows it returned
        (``encode`` itself where the vision path has none)."""
        if not (self.per_token and self.encoder_ratio):
            return encode

        def encoding(keys: Sequence[UnitKey]) -> torch.Tensor:
            rows = encode(keys)
            self.encoded(len(rows))
            return rows

        return encoding

    def encoded(self, rows: int) -> None:
        """The vision path's work for ``rows`` encoded image rows, with what was owed."""
        self.owed += rows * self.per_token * self.encoder_ratio / 64
        whole = int(self.owed)
        self.owed -= whole
        self._run("encoder", whole)

    def _run(self, part: str, matmuls: int) -> None:
        self.ran[part] += matmuls
        x = torch.ones(128, 128)
        weight = _weight()
        for _ in range(matmuls):
            x = torch.tanh(x @ weight)


@functools.cache
def _weight() -> torch.Tensor:
    return torch.randn(128, 128, generator=torch.Generator().manual_seed(0)) / 12


@dataclass(kw_only=True, slots=True)
class Trainer:
    """One rank's policy, frozen reference, optimizer and loss."""

    policy: Any
    reference: Any
    optimizer: Any
    loss: LossConfig
    seq_length: int
    """Megatron's ``seq_length`` (an upper bound on a micro-batch's tokens)."""
    epochs: int = 1
    """Optimizer steps per train pass (``GRPOConfig.ppo_epochs``)."""
    work: StandIn = field(default_factory=StandIn)
    """Extra fixed CPU work standing in for a bigger model (benchmarks; none by default)."""
    gradients: list[list[torch.Tensor]] | None = None
    """When a list, each train pass appends a copy of this rank's reduced gradients
    (``main_grad`` after megatron's finalize, in ``parameters()`` order): the equivalence check."""

    def logprobs(
        self,
        model: Any,
        data: Iterable[Batch],
        num_microbatches: int,
        dedup: Dedup | None,
        *,
        wrap: Callable[[ForwardStep], ForwardStep] | None = None,
    ) -> list[dict[str, torch.Tensor]]:
        """A forward-only pass of ``model``: per micro-batch, ``{"logprobs": log p(label) [b, s]}``;
        ``wrap``: applied to the forward step (knitkit: write each one back as computed)."""
        step = logprob_step if wrap is None else wrap(logprob_step)
        with torch.no_grad():
            return list(self._schedule(model, step, data, num_microbatches, True, dedup))

    def train(
        self, data: Iterable[Batch], num_microbatches: int, dedup: Dedup | None
    ) -> dict[str, float]:
        """The train pass: ``epochs`` optimizer steps on the mini-batch (PPO epochs), each over
        all of its micro-batches, all against the old log-probs they carry. The first epoch
        streams ``data`` (prefetch overlaps it as before) and keeps a copy of each batch for the
        next ones. Returns the step's ``FIGURES`` summed over the world and averaged over the
        epochs, and ``images_encoded``: the vision path's runs on every rank per epoch (one per
        unique image with dedup, one per micro-batch's image on every TP rank without)."""
        kept: list[Batch] = []
        sums: dict[str, float] = {}
        for epoch in range(self.epochs):
            source = _Kept(iter(data), kept if self.epochs > 1 else None) if epoch == 0 else kept
            figures = self._epoch(source, num_microbatches, dedup)
            sums = {k: sums.get(k, 0.0) + v for k, v in figures.items()}
        return {k: v / self.epochs for k, v in sums.items()}

    def _epoch(
        self, data: Iterable[Batch], num_microbatches: int, dedup: Dedup | None
    ) -> dict[str, float]:
        """One optimizer step over every micro-batch of ``data``."""
        self.policy.zero_grad_buffer()
        step = functools.partial(train_step, self.loss, loss_scale(num_microbatches))
        counted = _ImageCount(iter(data))
        out = self._schedule(self.policy, step, counted, num_microbatches, False, dedup)
        if self.gradients is not None:
            self.gradients.append([p.main_grad.detach().clone() for p in self.policy.parameters()])
        self.optimizer.step()
        encoded = counted.images if dedup is None else dedup.step.last_encoded_units
        return reduce_figures(out) | {"images_encoded": world_sum(encoded)}

    def _schedule(
        self,
        model: Any,
        forward_step: Any,
        data: Iterable[Batch],
        num_microbatches: int,
        forward_only: bool,
        dedup: Dedup | None,
    ) -> Sequence[dict[str, torch.Tensor]]:
        if self.work:
            data = self.work.after_each(data, encodes=dedup is None)
        kwargs: dict[str, Any] = {
            "forward_step_func": forward_step,
            "data_iterator": iter(data),
            "num_microbatches": num_microbatches,
            "seq_length": self.seq_length,
            "micro_batch_size": 1,
            "forward_only": forward_only,
        }
        if dedup is not None:
            encode = self.work.encoding(dedup.encode)
            return dedup.step.run(route=dedup.route, encode_fn=encode, **kwargs)
        from megatron.core.pipeline_parallel import get_forward_backward_func

        return get_forward_backward_func()(model=model, **kwargs)


class _ImageCount:
    """The data iterator, counting the images the batches hand the vision path."""

    def __init__(self, source: Iterator[Batch]) -> None:
        self._source, self.images = source, 0

    def __iter__(self) -> _ImageCount:
        return self

    def __next__(self) -> Batch:
        batch = next(self._source)
        self.images += len(batch.get("images") or ())
        return batch


class _Kept:
    """The data iterator, keeping a copy of each batch in ``into`` (``None``: no copies); a
    delivered batch may view a slot that is refilled once the next one is taken."""

    def __init__(self, source: Iterator[Batch], into: list[Batch] | None) -> None:
        self._source, self._into = source, into

    def __iter__(self) -> _Kept:
        return self

    def __next__(self) -> Batch:
        batch = next(self._source)
        if self._into is not None:
            self._into.append(
                {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
            )
        return batch


def world_sum(value: float) -> float:
    """``value`` summed over every rank."""
    total = torch.tensor([float(value)], dtype=torch.float64, device=current_device())
    dist.all_reduce(total)
    return float(total[0])


def reduce_figures(out: Sequence[dict[str, torch.Tensor]]) -> dict[str, float]:
    """Sum the micro-batches' figures on this rank, then over DP (TP peers hold the same values)."""
    from megatron.core import parallel_state

    local = torch.zeros(len(FIGURES), dtype=torch.float64, device=current_device())
    for item in out:
        local += torch.stack([item[name].double() for name in FIGURES])
    dist.all_reduce(local, group=parallel_state.get_data_parallel_group(with_context_parallel=True))
    return dict(zip(FIGURES, local.tolist(), strict=True))
