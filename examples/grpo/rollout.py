"""The rollout stand-in: GRPO groups with an image as SGLang ``/generate`` outputs, every draw keyed, resumable."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from grpo.rewards import group_advantages, reward, rule
from knitkit.integration.sglang import RolloutRequest

JsonOutput = dict[str, Any]
"""One SGLang ``/generate`` output as the server returns it: ``output_ids`` and ``meta_info``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutConfig:
    """Shape of the stand-in rollout; vocabulary, image token and patch size are the model's."""

    sources: tuple[str, ...] = ("chart", "geometry")
    """Data sources; later sources take longer to generate (their groups complete later)."""
    prompts_per_source: int = 2
    """Prompts each rollout step issues per source."""
    group_size: int = 8
    """Responses per prompt (SGLang ``sampling_params.n``)."""
    vocab: int = 64
    image_token: int = 3
    """The image placeholder token; text and responses use tokens ``4 .. vocab - 1``."""
    patch_dim: int = 12
    text_tokens: int = 4
    image_patches: tuple[int, int] = (4, 8)
    """Inclusive range of an image's patches (= its placeholder tokens)."""
    response_tokens: tuple[int, int] = (6, 20)
    seed: int = 0

    @property
    def prompts_per_step(self) -> int:
        return len(self.sources) * self.prompts_per_source


@dataclass(frozen=True, slots=True)
class Group:
    """One prompt's ``n`` finished responses, as SGLang answers a request with ``n`` samples."""

    step: int
    """Rollout step that issued the prompt (also the policy version that generated it)."""
    index: int
    """The prompt's index within its rollout step."""
    requests: tuple[RolloutRequest, ...]
    outputs: tuple[JsonOutput, ...]
    rewards: tuple[float, ...]
    advantages: tuple[float, ...]
    """Group-normalised (``rewards.group_advantages``)."""
    duration_s: float
    """Simulated generation time: the group completes this long after its step was issued."""

    @property
    def sample_id(self) -> str:
        return sample_id(self.step, self.index)

    @property
    def source(self) -> str:
        return self.requests[0].source


def sample_id(step: int, index: int) -> str:
    return f"s{step}-p{index}"


def parse_trajectory_id(trajectory_id: str) -> tuple[int, int, int]:
    """``(step, prompt index, response)`` of a trajectory id this stand-in issued."""
    step, index, response = trajectory_id.split("-")
    return int(step[1:]), int(index[1:]), int(response)


def generate_group(config: RolloutConfig, step: int, index: int) -> Group:
    """The group of prompt ``index`` of rollout step ``step``: a pure function of its key.

    NOTE [ Keyed rollout draws ]: every random draw comes from a generator seeded with its key
    (seed, step, prompt, and the response for a response), never from a stream shared across
    prompts. A group is therefore the same whenever and wherever it is generated: after a crash
    the stand-in re-issues its in-flight prompts and gets the same responses (issue 21's resume
    test relies on this), and the plain reference loop regenerates exactly the trajectories the
    knitkit path was fed.
    """
    source_index = index // config.prompts_per_source
    source = config.sources[source_index]
    rng = np.random.default_rng([config.seed, step, index])
    patches = int(rng.integers(config.image_patches[0], config.image_patches[1] + 1))
    image = rng.standard_normal((patches, config.patch_dim)).astype(np.float32)
    text = rng.integers(4, config.vocab, config.text_tokens + 2).tolist()
    input_ids = (*text[:-2], *[config.image_token] * patches, *text[-2:])
    # Later sources are slower: the admission quota on them is what knittrans keeps.
    duration_s = float((1 + source_index) * rng.lognormal(4.0, 0.5))
    requests, outputs = [], []
    for response in range(config.group_size):
        tid = f"{sample_id(step, index)}-{response}"
        requests.append(
            RolloutRequest(
                tid, sample_id(step, index), source, step, input_ids, (image,), issued_version=step
            )
        )
        outputs.append(_output(config, tid, len(input_ids), step, index, response, duration_s))
    rewards = tuple(reward(out["output_ids"], config.vocab) for out in outputs)
    return Group(
        step, index, tuple(requests), tuple(outputs), rewards, group_advantages(rewards), duration_s
    )


def _output(
    config: RolloutConfig,
    rid: str,
    prompt_tokens: int,
    step: int,
    index: int,
    response: int,
    duration_s: float,
) -> JsonOutput:
    """One response in SGLang's ``/generate`` format (``return_logprob=True``)."""
    rng = np.random.default_rng([config.seed, step, index, response + 1])
    length = int(rng.integers(config.response_tokens[0], config.response_tokens[1] + 1))
    noise = rng.uniform(0.0, 0.9)
    ids = [int(rng.integers(4, config.vocab))]
    for _ in range(length - 1):
        follows = rng.random() >= noise
        ids.append(rule(ids[-1], config.vocab) if follows else int(rng.integers(4, config.vocab)))
    logprobs = (-rng.uniform(0.05, 3.0, length)).tolist()
    return {
        "text": "",
        "output_ids": ids,
        "meta_info": {
            "id": rid,
            "finish_reason": {"type": "stop", "matched": ids[-1]},
            "prompt_tokens": prompt_tokens,
            "completion_tokens": length,
            "output_token_logprobs": [[lp, t, None] for lp, t in zip(logprobs, ids, strict=True)],
            "weight_version": str(step),
            "e2e_latency": duration_s,
        },
    }


class RolloutStandIn:
    """Issues rollout steps and hands back their groups in completion order; deterministic and resumable.

    A rollout step issues ``prompts_per_step`` prompts at once; each group completes after its
    simulated duration (see NOTE [ Keyed rollout draws ]). The state is plain data: the next
    step to issue and the groups issued but not handed back yet (re-issued after a restore).
    """

    def __init__(self, config: RolloutConfig) -> None:
        self.config = config
        self._next_step = 0
        self._pending: list[tuple[int, int]] = []
        """(step, index) of issued groups not handed back yet, in completion order."""

    def issue(self) -> int:
        """Issue the next rollout step's prompts; returns the step."""
        step = self._next_step
        groups = [generate_group(self.config, step, i) for i in range(self.config.prompts_per_step)]
        groups.sort(key=lambda g: (g.duration_s, g.index))
        self._pending += [(g.step, g.index) for g in groups]
        self._next_step += 1
        return step

    def next_group(self) -> Group:
        """The next group to complete (issuing the next rollout step when none is in flight)."""
        if not self._pending:
            self.issue()
        step, index = self._pending.pop(0)
        return generate_group(self.config, step, index)

    def groups(self, count: int) -> Iterator[Group]:
        """The next ``count`` groups in completion order."""
        for _ in range(count):
            yield self.next_group()

    def state_dict(self) -> dict[str, Any]:
        """What was issued and is still in flight (JSON-able)."""
        return {"next_step": self._next_step, "pending": [list(p) for p in self._pending]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume: in-flight groups are re-issued and come back the same (keyed draws)."""
        self._next_step = int(state["next_step"])
        self._pending = [(int(s), int(i)) for s, i in state["pending"]]
