"""Encoder dedup: dup (every micro-batch re-encodes its images) vs dedup (paper 5.3, Fig. 11c), on CPU.

A ViT-style encoder (patch embedding, transformer layers, projector) and a causal transformer
backbone train one GRPO mini-batch: ``samples`` prompts with one image each, ``n`` trajectories per
prompt, shuffled into backbone micro-batches of ``micro`` trajectories. Cases: ``n8`` and ``n16``
(4 prompts, micro-batches of 4: as many unique images as a micro-batch has trajectories) and
``grpo`` (16 prompts in groups of 8, micro-batches of 8 holding several images each).

- dup: each micro-batch encodes its trajectories' images, runs the backbone, back-propagates
  through both (the encoder's backward is timed apart via a detached boundary; same math).
- dedup: ``knitkit.encoder_dedup.DedupEncoder``: each unique image encoded once per mini-batch,
  cached leaves per micro-batch, one deferred encoder backward. Its encoder time holds all that
  dedup adds: building the routing plan, each micro-batch's feature gather, the gradient hooks
  at the leaves (``index_add_`` into the cache gradient) and the deferred backward.
- forward-only (old / reference log-prob passes, no grad): dup encodes per micro-batch as above;
  dedup is ``DedupEncoder.encode(keep_graph=False)`` plus the routing plan and the gathers.

Dedup's encoder batches hold as many images as dup's (``micro``), so the encoder ratio measures
the work dedup removes, not how a different batch size happens to run. ``--quick`` runs the same
model and mini-batches with fewer repeats.

Keys (``<case>`` = n8, n16, grpo): ``<case>.encoder_time_ratio`` (dup / dedup encoder seconds),
``<case>.forward_only_encoder_time_ratio``, ``<case>.step_time_ratio`` (dup / dedup mini-batch
step incl. AdamW), ``<case>.peak_memory_ratio`` (dedup / dup peak live tensor bytes), the raw
seconds and MiB, ``<case>.unique_per_micro`` (unique images / trajectories per micro-batch) and
``<case>.trajectories``; benchmarks/README.md has the contract. Every time is the median over
interleaved repeats.

Times are CPU seconds of the one thread that does all the work (``time.thread_time``, one torch
thread), so other load on a shared machine does not inflate them; ``--wall`` uses wall time.
Peak memory comes from a separate, untimed pass of ``LiveTensorBytes``: a ``TorchDispatchMode``
that adds the bytes of every tensor storage an op creates and subtracts them when the storage dies
(a weakref callback on the storage, which lives as long as its C++ StorageImpl), so parameters,
gradients, optimizer states, activations saved for backward and temporaries all count,
independent of the CPU allocator. Dedup keeps every unique image's encoder graph for the whole
mini-batch, so its peak stays below dup's while a mini-batch's unique images do not outnumber one
micro-batch's trajectories (``unique_per_micro`` <= 1).

A gloo world of ``--world`` ranks (default 2; 1 skips it) runs the same cases spread over the
ranks (micro-batch ``i`` on rank ``i % world``; dedup's unique images round robin over the
ranks, rows and gradients routed over gloo): ``world<W>.<case>.*`` keys, process CPU seconds of
the slowest rank (gloo's threads included, so routing and handshakes count).

    python benchmarks/encoder_dedup.py [--quick] [--json PATH] [--world N]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from lifetime import die_with_parent, end_on_sigterm
from progress import Progress
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from knitkit.encoder_dedup import (
    BackboneAssignment,
    DedupEncoder,
    EncoderAssignment,
    LocalTransport,
    ProcessGroupTransport,
    build_routing_plan,
    row_slices,
)
from knitkit.types import MultimodalRef, UnitKey

progress = Progress("encoder_dedup")


@dataclass(frozen=True, slots=True)
class Size:
    """Model sizes and repeats of one run (``--quick``: the same model, fewer repeats)."""

    width: int
    patches: int
    text: int
    layers: int
    repeats: int

    @property
    def image_at(self) -> int:
        return 4


@dataclass(frozen=True, slots=True)
class Case:
    """A GRPO mini-batch's shape: ``samples`` prompts with one image each, ``n`` trajectories per
    prompt, shuffled into backbone micro-batches of ``micro`` trajectories."""

    name: str
    samples: int
    n: int
    micro: int

    @property
    def unique_per_micro(self) -> float:
        """Unique images of the mini-batch per trajectory of a micro-batch: dedup keeps every
        unique image's encoder graph, dup one micro-batch's images at a time."""
        return self.samples / self.micro


CASES = (
    Case("n8", samples=4, n=8, micro=4),
    Case("n16", samples=4, n=16, micro=4),
    Case("grpo", samples=16, n=8, micro=8),
)
"""n8 / n16: as many unique images as a micro-batch has trajectories (dedup's encoder batch is
dup's); grpo: groups of 8 over 16 prompts, several images per micro-batch, twice as many unique
images as a micro-batch holds (dedup encodes them in batches of ``micro``, like dup)."""


class ViT(nn.Module):
    """Patch embedding + transformer layers + projector to the backbone width."""

    def __init__(self, size: Size) -> None:
        super().__init__()
        self.patch = nn.Linear(3 * 8 * 8, size.width)
        self.pos = nn.Parameter(torch.randn(size.patches, size.width) * 0.02)
        layer = nn.TransformerEncoderLayer(size.width, 4, 4 * size.width, 0.0, batch_first=True)
        self.layers = nn.TransformerEncoder(layer, size.layers, enable_nested_tensor=False)
        self.projector = nn.Sequential(nn.Linear(size.width, size.width), nn.GELU())

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """``[units, patches, 192]`` -> ``[units * patches, width]``."""
        h = self.layers(self.patch(images) + self.pos)
        return self.projector(h).flatten(0, 1)


class Backbone(nn.Module):
    """Causal transformer over text tokens with image features spliced in at ``image_at``."""

    def __init__(self, size: Size, vocab: int = 512) -> None:
        super().__init__()
        self.size = size
        self.embed = nn.Embedding(vocab, size.width)
        layer = nn.TransformerEncoderLayer(size.width, 4, 4 * size.width, 0.0, batch_first=True)
        self.layers = nn.TransformerEncoder(layer, size.layers, enable_nested_tensor=False)
        self.head = nn.Linear(size.width, vocab)

    def forward(self, tokens: torch.Tensor, features: torch.Tensor, norm: float) -> torch.Tensor:
        s = self.size
        x = self.embed(tokens)
        feats = features.view(len(tokens), s.patches, s.width)
        x = torch.cat([x[:, : s.image_at], feats, x[:, s.image_at + s.patches :]], dim=1)
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1])
        logits = self.head(self.layers(x, mask=mask, is_causal=True))
        return (
            F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten(), reduction="sum")
            / norm
        )


@dataclass(slots=True)
class MiniBatch:
    """A GRPO mini-batch: one image per prompt, n trajectories per prompt, shuffled micro-batches."""

    images: dict[UnitKey, torch.Tensor]
    refs: list[MultimodalRef]
    tokens: torch.Tensor
    micro_batches: list[list[int]]
    norm: float
    encoder_batch: int
    """Images per encoder call in dedup (dup encodes one micro-batch's images per call)."""


def make_minibatch(size: Size, case: Case) -> MiniBatch:
    gen = torch.Generator().manual_seed(0)
    seq = size.image_at + size.patches + size.text
    keys = [UnitKey(f"img{s:03d}", "image") for s in range(case.samples)]
    images = {k: torch.randn(size.patches, 3 * 8 * 8, generator=gen) for k in keys}
    refs = [MultimodalRef(k, size.image_at, size.patches) for k in keys for _ in range(case.n)]
    order = list(range(len(refs)))
    random.Random(0).shuffle(order)
    micro = [order[i : i + case.micro] for i in range(0, len(order), case.micro)]
    tokens = torch.randint(0, 512, (len(refs), seq), generator=gen)
    return MiniBatch(images, refs, tokens, micro, float(len(refs) * seq), case.micro)


_clock = time.thread_time
"""CPU seconds of this thread (all compute runs on it with one torch thread); ``--wall`` swaps it."""


@dataclass(slots=True)
class Timing:
    encoder_s: float = 0.0
    step_s: float = 0.0


def time_leaf_grad(leaf: torch.Tensor, timing: Timing) -> None:
    """Count in ``timing.encoder_s`` the backbone backward's work at the feature leaf: from its
    gradient arriving to the end of its post-accumulate hooks (the accumulation; for dedup also
    the ``index_add_`` into the cache gradient, a hook registered before this one)."""
    arrived: list[float] = []
    leaf.register_hook(lambda grad: arrived.append(_clock()))

    def done(_: torch.Tensor) -> None:
        timing.encoder_s += _clock() - arrived.pop()

    leaf.register_post_accumulate_grad_hook(done)


def dup_step(enc: ViT, bb: Backbone, opt: torch.optim.Optimizer, mb: MiniBatch) -> Timing:
    """Every micro-batch encodes its own trajectories' images (the non-dedup baseline)."""
    t = Timing()
    start = _clock()
    opt.zero_grad()
    for traj in mb.micro_batches:
        t0 = _clock()
        out = enc(torch.stack([mb.images[mb.refs[i].key] for i in traj]))
        t.encoder_s += _clock() - t0
        leaf = out.detach().requires_grad_()
        time_leaf_grad(leaf, t)
        bb(mb.tokens[traj], leaf, mb.norm).backward()
        t0 = _clock()
        out.backward(leaf.grad)
        t.encoder_s += _clock() - t0
        del out, leaf
    opt.step()
    t.step_s = _clock() - start
    return t


def dedup_encoder(mb: MiniBatch, width: int, rank: int = 0, world: int = 1) -> DedupEncoder:
    """Rank ``rank``'s DedupEncoder for the mini-batch: the routing plan over ``world`` ranks
    built (unique images round robin over the ranks, in encoder micro-batches of
    ``mb.encoder_batch``; micro-batch ``i`` on backbone rank ``i % world``), each unique image
    encoded once in the world; rows travel over gloo when ``world`` > 1."""
    keys = sorted(mb.images)
    mine = {r: keys[r::world] for r in range(world)}
    batches = {
        r: [ks[i : i + mb.encoder_batch] for i in range(0, len(ks), mb.encoder_batch)]
        for r, ks in mine.items()
    }
    encoder = EncoderAssignment(batches, {k: len(mb.images[k]) for k in keys})
    needs = {
        r: [
            [s for i in traj for s in row_slices([mb.refs[i]], [(0, 1 << 30)])]
            for traj in mb.micro_batches[r::world]
        ]
        for r in range(world)
    }
    plan = build_routing_plan(encoder, BackboneAssignment(needs), world_size=world)
    transport = LocalTransport() if world == 1 else ProcessGroupTransport()
    return DedupEncoder(plan.for_rank(rank), transport, hidden=width)


def dedup_step(
    enc: ViT, bb: Backbone, opt: torch.optim.Optimizer, mb: MiniBatch, rank: int = 0, world: int = 1
) -> Timing:
    """knitkit's DedupEncoder: unique images once, cached leaves, one deferred encoder backward;
    its encoder time holds everything dedup adds: the routing plan, the encoder, each micro-batch's
    feature gather and the gradient hooks at the leaves, the deferred backward."""
    t = Timing()
    start = _clock()
    opt.zero_grad()
    t0 = _clock()
    dedup = dedup_encoder(mb, bb.embed.embedding_dim, rank, world)
    dedup.encode(lambda ks: enc(torch.stack([mb.images[k] for k in ks])))
    t.encoder_s += _clock() - t0
    for micro, traj in enumerate(mb.micro_batches[rank::world]):
        t0 = _clock()
        features = dedup.features(micro)
        t.encoder_s += _clock() - t0
        time_leaf_grad(features, t)
        bb(mb.tokens[traj], features, mb.norm).backward()
        del features
    t0 = _clock()
    dedup.backward()
    t.encoder_s += _clock() - t0
    opt.step()
    t.step_s = _clock() - start
    return t


@torch.no_grad()
def dup_forward(enc: ViT, bb: Backbone, mb: MiniBatch) -> Timing:
    """A forward-only pass (old / reference log-probs) where every micro-batch encodes its images."""
    t = Timing()
    start = _clock()
    for traj in mb.micro_batches:
        t0 = _clock()
        out = enc(torch.stack([mb.images[mb.refs[i].key] for i in traj]))
        t.encoder_s += _clock() - t0
        bb(mb.tokens[traj], out, mb.norm)
    t.step_s = _clock() - start
    return t


@torch.no_grad()
def dedup_forward(enc: ViT, bb: Backbone, mb: MiniBatch, rank: int = 0, world: int = 1) -> Timing:
    """The same pass with ``DedupEncoder.encode(keep_graph=False)``: unique images once, no graph;
    encoder time includes the routing plan and the feature gathers."""
    t = Timing()
    start = _clock()
    dedup = dedup_encoder(mb, bb.embed.embedding_dim, rank, world)
    dedup.encode(lambda ks: enc(torch.stack([mb.images[k] for k in ks])), keep_graph=False)
    t.encoder_s += _clock() - start
    for micro, traj in enumerate(mb.micro_batches[rank::world]):
        t0 = _clock()
        features = dedup.features(micro)
        t.encoder_s += _clock() - t0
        bb(mb.tokens[traj], features, mb.norm)
    t.step_s = _clock() - start
    return t


Step = Callable[[ViT, Backbone, torch.optim.Optimizer, MiniBatch], Timing]


class LiveTensorBytes(TorchDispatchMode):
    """Peak bytes of live tensor storages: those given up front plus every one an op creates."""

    def __init__(self, *tensors: torch.Tensor) -> None:
        super().__init__()
        self.live = self.peak = 0
        self._refs: dict[int, weakref.ref[torch.UntypedStorage]] = {}
        for t in tensors:
            self._track(t)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage._cdata
        if key in self._refs:
            return
        nbytes = storage.nbytes()
        self._refs[key] = weakref.ref(storage, partial(self._free, key, nbytes))
        self.live += nbytes
        self.peak = max(self.peak, self.live)

    def _free(self, key: int, nbytes: int, _: object) -> None:
        if self._refs.pop(key, None) is not None:
            self.live -= nbytes


def peak_bytes(
    step: Step, enc: ViT, bb: Backbone, opt: torch.optim.Optimizer, mb: MiniBatch
) -> int:
    """Peak live tensor bytes of one step, parameters, gradients and optimizer states included."""
    held = [*enc.parameters(), *bb.parameters(), *mb.images.values(), mb.tokens]
    held += [
        v for state in opt.state.values() for v in state.values() if isinstance(v, torch.Tensor)
    ]
    with LiveTensorBytes(*held) as tracker:
        step(enc, bb, opt, mb)
    return tracker.peak


def measure(size: Size, case: Case) -> dict[str, float]:
    """Medians over interleaved repeats of every mode's encoder and step time; peak memory."""
    torch.manual_seed(0)
    enc, bb = ViT(size), Backbone(size)
    opt = torch.optim.AdamW([*enc.parameters(), *bb.parameters()], lr=1e-4)
    mb = make_minibatch(size, case)
    for step in (dup_step, dedup_step):  # warm-up; also creates the optimizer states
        step(enc, bb, opt, mb)
    dup_forward(enc, bb, mb)
    dedup_forward(enc, bb, mb)
    runs: dict[str, list[Timing]] = {"dup": [], "dedup": [], "dup_fwd": [], "dedup_fwd": []}
    for _ in range(size.repeats):  # interleaved, so background load hits all alike
        runs["dup"].append(dup_step(enc, bb, opt, mb))
        runs["dedup"].append(dedup_step(enc, bb, opt, mb))
        runs["dup_fwd"].append(dup_forward(enc, bb, mb))
        runs["dedup_fwd"].append(dedup_forward(enc, bb, mb))
    # Medians over interleaved repeats of thread CPU time: robust to the odd slow repeat
    # in either direction, so --quick and the full run agree (issue 14).
    best = {
        (mode, part): statistics.median(getattr(t, part) for t in ts)
        for mode, ts in runs.items()
        for part in ("encoder_s", "step_s")
    }
    dup_peak = peak_bytes(dup_step, enc, bb, opt, mb)
    dedup_peak = peak_bytes(dedup_step, enc, bb, opt, mb)
    k = case.name
    return {
        f"{k}.encoder_time_ratio": best["dup", "encoder_s"] / best["dedup", "encoder_s"],
        f"{k}.step_time_ratio": best["dup", "step_s"] / best["dedup", "step_s"],
        f"{k}.peak_memory_ratio": dedup_peak / dup_peak,
        f"{k}.forward_only_encoder_time_ratio": best["dup_fwd", "encoder_s"]
        / best["dedup_fwd", "encoder_s"],
        f"{k}.dup.forward_only_encoder_s": best["dup_fwd", "encoder_s"],
        f"{k}.dedup.forward_only_encoder_s": best["dedup_fwd", "encoder_s"],
        f"{k}.dup.encoder_s": best["dup", "encoder_s"],
        f"{k}.dedup.encoder_s": best["dedup", "encoder_s"],
        f"{k}.dup.step_s": best["dup", "step_s"],
        f"{k}.dedup.step_s": best["dedup", "step_s"],
        f"{k}.dup.peak_mib": dup_peak / 2**20,
        f"{k}.dedup.peak_mib": dedup_peak / 2**20,
        f"{k}.unique_per_micro": case.unique_per_micro,
        f"{k}.trajectories": float(case.samples * case.n),
    }


def world_rank(rank: int, world: int, size: Size, init: str, out_dir: str) -> None:
    """One rank of a gloo world of ``world`` (``--world``): micro-batch ``i`` runs on rank
    ``i % world``; dup encodes its own micro-batches' images, dedup each unique image once in
    the world (round robin over the ranks), rows and gradients routed over gloo. Times are CPU
    seconds of the whole rank process (``time.process_time``: gloo's threads included, so the
    routing and the handshakes count); figures per case, medians over interleaved repeats."""
    die_with_parent()
    global _clock
    _clock = time.process_time
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    figures: dict[str, float] = {}
    try:
        for case in CASES:
            torch.manual_seed(0)
            enc, bb = ViT(size), Backbone(size)
            opt = torch.optim.AdamW([*enc.parameters(), *bb.parameters()], lr=1e-4)
            mb = make_minibatch(size, case)
            mine = replace(mb, micro_batches=mb.micro_batches[rank::world])
            modes: dict[str, Callable[[], Timing]] = {
                "dup": partial(dup_step, enc, bb, opt, mine),
                "dedup": partial(dedup_step, enc, bb, opt, mb, rank, world),
                "dup_fwd": partial(dup_forward, enc, bb, mine),
                "dedup_fwd": partial(dedup_forward, enc, bb, mb, rank, world),
            }
            runs: dict[str, list[Timing]] = {mode: [] for mode in modes}
            for repeat in range(size.repeats + 1):  # the first is a warm-up
                for mode, run in modes.items():  # interleaved
                    dist.barrier()
                    timing = run()
                    if repeat:
                        runs[mode].append(timing)
            for mode, timings in runs.items():
                for part in ("encoder_s", "step_s"):
                    figures[f"{case.name}.{mode}.{part}"] = statistics.median(
                        getattr(t, part) for t in timings
                    )
    finally:
        dist.destroy_process_group()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as fh:
        json.dump(figures, fh)


def measure_world(size: Size, world: int) -> dict[str, float]:
    """``world_rank`` on ``world`` spawned gloo ranks; per case, the slowest rank's seconds and
    dup / dedup ratios, as ``world<W>.<case>.*`` keys."""
    with tempfile.TemporaryDirectory(prefix="encoder-dedup-") as tmp:
        init = f"file://{tmp}/init"
        mp.spawn(world_rank, args=(world, size, init, tmp), nprocs=world)
        ranks = []
        for rank in range(world):
            with open(os.path.join(tmp, f"rank{rank}.json")) as fh:
                ranks.append(json.load(fh))
    out: dict[str, float] = {}
    for case in CASES:
        k, w = case.name, f"world{world}.{case.name}"
        slowest = {key: max(r[key] for r in ranks) for key in ranks[0] if key.startswith(k + ".")}
        for key, value in slowest.items():
            out[f"world{world}.{key}"] = value
        out[f"{w}.encoder_time_ratio"] = (
            slowest[f"{k}.dup.encoder_s"] / slowest[f"{k}.dedup.encoder_s"]
        )
        out[f"{w}.forward_only_encoder_time_ratio"] = (
            slowest[f"{k}.dup_fwd.encoder_s"] / slowest[f"{k}.dedup_fwd.encoder_s"]
        )
        out[f"{w}.step_time_ratio"] = slowest[f"{k}.dup.step_s"] / slowest[f"{k}.dedup.step_s"]
    return out


def main() -> None:
    end_on_sigterm()  # a SIGTERM ends the gloo world's ranks too (lifetime.py)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="the same mini-batches, 3 repeats instead of 7"
    )
    parser.add_argument("--json", metavar="PATH", help="write the flat figures to PATH")
    parser.add_argument("--wall", action="store_true", help="time with wall clock, not thread CPU")
    parser.add_argument(
        "--world",
        type=int,
        default=2,
        help="also run a gloo world of this many ranks (2-4; 1 skips it)",
    )
    args = parser.parse_args()
    if args.wall:
        global _clock
        _clock = time.perf_counter
    size = Size(width=192, patches=128, text=64, layers=2, repeats=3 if args.quick else 7)
    # NOTE: one thread: on a shared 2-core machine, intra-op threads mostly add scheduling noise.
    torch.set_num_threads(1)
    figures: dict[str, float] = {"loadavg_1m_at_start": os.getloadavg()[0]}
    print(f"{size}; clock: {'wall' if args.wall else 'thread CPU'} seconds")
    print(
        f"{'case':<5} {'enc dup s':>9} {'enc dedup s':>11} {'enc ratio':>9} {'fwd-only':>9} "
        f"{'step dup s':>10} {'step dedup s':>12} {'step ratio':>10}  peak ratio (dedup/dup MiB)"
    )
    for case in CASES:
        f = measure(size, case)
        progress(f"case {case.name}: done")
        figures.update(f)
        k = case.name
        print(
            f"{k:<5} {f[f'{k}.dup.encoder_s']:9.3f} {f[f'{k}.dedup.encoder_s']:11.3f} "
            f"{f[f'{k}.encoder_time_ratio']:9.2f} {f[f'{k}.forward_only_encoder_time_ratio']:9.2f} "
            f"{f[f'{k}.dup.step_s']:10.3f} {f[f'{k}.dedup.step_s']:12.3f} "
            f"{f[f'{k}.step_time_ratio']:10.2f}  {f[f'{k}.peak_memory_ratio']:.2f} "
            f"({f[f'{k}.dedup.peak_mib']:.1f}/{f[f'{k}.dup.peak_mib']:.1f}; "
            f"{f[f'{k}.unique_per_micro']:.0f} unique images per micro-batch of trajectories)"
        )
    print(
        f"target: n16.encoder_time_ratio and n16.forward_only_encoder_time_ratio >= {0.75 * 16:.0f}"
        " (ideal 16); peak_memory_ratio <= 1 while unique images per micro-batch <= 1"
    )
    if args.world > 1:
        progress(f"gloo world of {args.world} ranks")
        world = measure_world(size, args.world)
        figures.update(world)
        print(f"gloo world of {args.world} ranks (process CPU seconds of the slowest rank):")
        for case in CASES:
            w = f"world{args.world}.{case.name}"
            print(
                f"{case.name:<5} encoder ratio {world[f'{w}.encoder_time_ratio']:.2f}, "
                f"forward-only {world[f'{w}.forward_only_encoder_time_ratio']:.2f}, "
                f"step ratio {world[f'{w}.step_time_ratio']:.2f}"
            )
    figures["loadavg_1m_at_end"] = os.getloadavg()[0]
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(figures, fh, indent=1, sort_keys=True)


if __name__ == "__main__":
    main()
