"""``mrope_positions`` against the real transformers 5.23.0 Qwen2.5-VL and Qwen3-VL ``get_rope_index``.

Invariant (NOTE [ Qwen-VL mRoPE positions ] in integration/megatron/mrope.py): every token gets the
position the model gives it, for text, images, videos and mixtures of several of each. Where
transformers' single-pass prefill and its own generation path agree (text, images, Qwen3-VL,
Qwen2.5-VL videos whose temporal extent fits their spatial one), the reference is one padded batch
call (left and right padding, attention mask); after a Qwen2.5-VL video the reference is its
generation path (prefill through the video, then ``rope_deltas``), as the rollout engine positions
the tokens that follow. Grids and layouts are drawn by hypothesis.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from qwen_vl_reference import (
    IMAGE_TOKEN,
    MERGE,
    TOKENS_PER_SECOND,
    VIDEO_TOKEN,
    VISION_END,
    VISION_START,
    generation_positions,
    get_rope_index,
)

from knitkit.integration.megatron import mrope_positions

SETTINGS = settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    derandomize=True,
)


@dataclass
class Layout:
    """One processor-expanded sequence and its vision metadata."""

    ids: list[int] = field(default_factory=list)
    images: list[tuple[int, int, int]] = field(default_factory=list)
    videos: list[tuple[int, int, int]] = field(default_factory=list)
    seconds: list[float] = field(default_factory=list)

    def text(self, n: int, seed: int = 0) -> None:
        self.ids += [1000 + (seed + 7 * i) % 5000 for i in range(n)]

    def image(self, grid: tuple[int, int, int]) -> None:
        """``<|vision_start|>`` + the image's pads + ``<|vision_end|>``, as the processor writes it."""
        self.images.append(grid)
        self.ids += [VISION_START, *[IMAGE_TOKEN] * (grid[0] * grid[1] * grid[2] // MERGE**2)]
        self.ids.append(VISION_END)

    def video(self, scheme: str, grid: tuple[int, int, int], seconds: float = 1.0) -> None:
        """The processor's layout: Qwen2.5-VL ``<|vision_start|>`` + all pads + ``<|vision_end|>``;
        Qwen3-VL per temporal patch ``<t seconds><|vision_start|>`` + its pads + ``<|vision_end|>``."""
        t, h, w = grid
        self.videos.append(grid)
        if scheme == "qwen2_5_vl":
            self.seconds.append(seconds)
            self.ids += [VISION_START, *[VIDEO_TOKEN] * (t * h * w // MERGE**2), VISION_END]
            return
        for frame in range(t):
            self.text(3, seed=frame)
            self.ids += [VISION_START, *[VIDEO_TOKEN] * (h * w // MERGE**2), VISION_END]

    def positions(self, scheme: str) -> np.ndarray:
        return mrope_positions(
            self.ids,
            self.images,
            image_token_id=IMAGE_TOKEN,
            video_token_id=VIDEO_TOKEN,
            video_grid_thw=self.videos,
            second_per_grid_ts=self.seconds,
            tokens_per_second=TOKENS_PER_SECOND,
            spatial_merge_size=MERGE,
            scheme=scheme,  # type: ignore[arg-type]
        )


SIDES = st.sampled_from([2, 4, 6, 8])
IMAGE_GRIDS = st.tuples(st.just(1), SIDES, SIDES)
VIDEO_GRIDS = st.tuples(st.integers(1, 4), SIDES, SIDES)
SECONDS = st.sampled_from([0.25, 0.5, 2 / 3, 1.0, 1.5, 2.0])
"""``temporal_patch_size / fps`` for fps 8, 4, 3, 2, 4/3, 1."""


def _fits(grid: tuple[int, int, int], seconds: float) -> bool:
    """The video's temporal extent stays within its spatial one (transformers' prefill agrees)."""
    t, h, w = grid
    interval = np.float32(TOKENS_PER_SECOND) * np.float32(seconds)
    return int(np.float32(t - 1) * interval) <= max(h, w) // MERGE - 1


@st.composite
def sequences(draw: st.DrawFn, scheme: str, videos_fit: bool) -> Layout:
    """Text, images and videos in any order, separated by text as the processors write them."""
    seq = Layout()
    seq.text(draw(st.integers(0, 4)), seed=draw(st.integers(0, 99)))
    for _ in range(draw(st.integers(0, 4))):
        if draw(st.booleans()):
            seq.image(draw(IMAGE_GRIDS))
        else:
            grid, seconds = draw(VIDEO_GRIDS), draw(SECONDS)
            if videos_fit and scheme == "qwen2_5_vl":
                assume(_fits(grid, seconds))
            seq.video(scheme, grid, seconds)
        seq.text(draw(st.integers(1, 4)), seed=draw(st.integers(0, 99)))
    seq.text(draw(st.integers(0, 5)))
    assume(seq.ids)
    return seq


@pytest.mark.parametrize("padding", ["left", "right"])
@pytest.mark.parametrize("scheme", ["qwen2_5_vl", "qwen3_vl"])
@SETTINGS
@given(data=st.data())
def test_batches_match_transformers_get_rope_index(scheme: str, padding: str, data) -> None:  # type: ignore[no-untyped-def]
    """1-3 sequences of text, images and videos in one padded batch: each sequence's positions
    equal transformers' under the attention mask (Qwen2.5-VL videos drawn to fit, see module doc)."""
    batch = data.draw(st.lists(sequences(scheme, videos_fit=True), min_size=1, max_size=3))
    reference = get_rope_index(
        scheme,
        [s.ids for s in batch],
        [g for s in batch for g in s.images],
        [g for s in batch for g in s.videos],
        [x for s in batch for x in s.seconds],
        padding=padding,
    )
    for seq, expected in zip(batch, reference, strict=True):
        np.testing.assert_array_equal(seq.positions(scheme), expected)


@pytest.mark.parametrize("scheme", ["qwen2_5_vl", "qwen3_vl"])
@SETTINGS
@given(data=st.data())
def test_generation_matches_transformers_where_it_continues_at_max_plus_one(
    scheme: str, data
) -> None:  # type: ignore[no-untyped-def]
    """A prompt in the processor's layout (every vision run closed by ``<|vision_end|>``, then the
    question), then the generated answer: every position equals transformers' own generation path
    (prefill, then ``rope_deltas``) for images, Qwen3-VL videos, and Qwen2.5-VL videos whose
    temporal extent fits their spatial one (where transformers 5.x continues at max + 1 too)."""
    seq = data.draw(sequences(scheme, videos_fit=True))
    assume(seq.images or seq.videos)  # text alone: transformers takes its 1-D path
    prompt = len(seq.ids)
    seq.text(data.draw(st.integers(1, 8)))
    args = (seq.images, seq.videos, seq.seconds)
    expected = generation_positions(scheme, seq.ids[:prompt], len(seq.ids) - prompt, *args)
    np.testing.assert_array_equal(seq.positions(scheme), expected)


@SETTINGS
@given(data=st.data())
def test_qwen2_5_video_overhang_continues_at_max_plus_one(data) -> None:  # type: ignore[no-untyped-def]
    """A Qwen2.5-VL video whose temporal extent E = trunc((t - 1) * interval) exceeds its spatial
    one (max(h', w') - 1), in the processor's layout, then text: knitkit gives the video block
    transformers' own positions and continues the text at the block's max + 1 (Qwen's original
    rule, SGLang's and vLLM's: the positions the rollout engine used). transformers 5.23.0
    continues at p + max(h', w') instead, and generates from its prefill's max + 1: with only
    ``<|vision_end|>`` after the video, its answer sits exactly 1 below knitkit's (NOTE [ Qwen-VL
    mRoPE positions ]); a change of either side shows here."""
    seq = data.draw(sequences("qwen2_5_vl", videos_fit=True))
    grid, seconds = data.draw(VIDEO_GRIDS), data.draw(SECONDS)
    assume(not _fits(grid, seconds))
    start = len(seq.ids) + 1  # the video's first pad, after <|vision_start|>
    seq.video("qwen2_5_vl", grid, seconds)
    end = len(seq.ids) - 1  # its <|vision_end|>
    answer = data.draw(st.integers(1, 8))
    seq.text(answer)
    got = seq.positions("qwen2_5_vl")
    args = (seq.images, seq.videos, seq.seconds)
    prefill = get_rope_index("qwen2_5_vl", [seq.ids], *args)[0]
    np.testing.assert_array_equal(got[:, :end], prefill[:, :end])  # up to the video's last pad
    block = got[:, start:end]
    after = block.max() + 1 + np.arange(1 + answer)
    np.testing.assert_array_equal(got[:, end:], np.broadcast_to(after, (3, 1 + answer)))
    _, h, w = grid
    assert (prefill[:, end] == got[0, start] + max(h, w) // MERGE).all()  # transformers' p + max
    generated = generation_positions("qwen2_5_vl", seq.ids[: end + 1], answer, *args)
    np.testing.assert_array_equal(generated[:, end + 1 :], got[:, end + 1 :] - 1)


def test_issue_examples() -> None:
    """Issue 22 item 16: a (4, 4, 4) video after 3 text tokens, and an image followed by a video,
    each in the processor's layout and followed by text: the vision tokens equal transformers'
    prefill and the frames step in time (old knitkit gave them one temporal index); the text
    continues at the largest position + 1."""
    video_only = Layout()
    video_only.text(3)
    video_only.video("qwen2_5_vl", (4, 4, 4), 1.0)
    both = Layout()
    both.text(2)
    both.image((1, 4, 4))
    both.text(2)
    both.video("qwen2_5_vl", (2, 4, 8), 0.5)
    for seq, tail in ((video_only, 5), (both, 8)):
        vision_end = len(seq.ids) - 1
        seq.text(tail)
        got = seq.positions("qwen2_5_vl")
        prefill = get_rope_index("qwen2_5_vl", [seq.ids], seq.images, seq.videos, seq.seconds)[0]
        np.testing.assert_array_equal(got[:, :vision_end], prefill[:, :vision_end])
        after = got[:, :vision_end].max() + 1 + np.arange(len(seq.ids) - vision_end)
        np.testing.assert_array_equal(got[:, vision_end:], np.broadcast_to(after, (3, len(after))))
    assert (
        video_only.positions("qwen2_5_vl")[0, 4:20].tolist()
        == [4] * 4 + [6] * 4 + [8] * 4 + [10] * 4
    )


def test_text_only_is_arange_like_the_reference() -> None:
    """A sequence without vision tokens: positions 0..T-1 on all three axes, for both schemes."""
    seq = Layout()
    seq.text(9)
    for scheme in ("qwen2_5_vl", "qwen3_vl"):
        np.testing.assert_array_equal(seq.positions(scheme), get_rope_index(scheme, [seq.ids])[0])


def _qwen25(ids: list[int], **kw: object) -> np.ndarray:
    args: dict[str, object] = {
        "image_token_id": IMAGE_TOKEN,
        "video_token_id": VIDEO_TOKEN,
        "tokens_per_second": 2,
        **kw,
    }
    return mrope_positions(ids, **args)  # type: ignore[arg-type]


def test_inconsistent_metadata_is_refused_naming_the_item() -> None:
    """Grids that do not match their placeholder runs, missing timing, or a scheme mix-up: each a
    ValueError that names the item and says what to pass."""
    video = [1, *[VIDEO_TOKEN] * 8, 2]
    with pytest.raises(ValueError, match=r"video 0: grid \(2, 4, 4\) needs 8 video tokens"):
        _qwen25([1, *[VIDEO_TOKEN] * 6, 2], video_grid_thw=[(2, 4, 4)], second_per_grid_ts=[1])
    with pytest.raises(ValueError, match="1 video_grid_thw but 0 second_per_grid_ts"):
        _qwen25(video, video_grid_thw=[(2, 4, 4)])
    with pytest.raises(ValueError, match="need tokens_per_second"):
        _qwen25(video, video_grid_thw=[(2, 4, 4)], second_per_grid_ts=[1], tokens_per_second=None)
    with pytest.raises(ValueError, match=r"2 video grids from video_grid_thw but 1 runs"):
        _qwen25(video, video_grid_thw=[(2, 4, 4), (2, 4, 4)], second_per_grid_ts=[1, 1])
    with pytest.raises(ValueError, match=r"0 image grids from image_grid_thw but 1 runs"):
        _qwen25([1, IMAGE_TOKEN, 2])
    with pytest.raises(ValueError, match="without video_token_id"):
        mrope_positions(video, image_token_id=IMAGE_TOKEN, video_grid_thw=[(2, 4, 4)])
    with pytest.raises(ValueError, match="scheme 'qwen3_vl'"):
        _qwen25(video, video_grid_thw=[(2, 4, 4)], second_per_grid_ts=[1], scheme="qwen3_vl")
    with pytest.raises(ValueError, match=r"2 video temporal patches .* but 1 runs"):
        _qwen25(video, video_grid_thw=[(2, 4, 4)], scheme="qwen3_vl")
    with pytest.raises(ValueError, match=r"image 0: grid \(1, 3, 4\) is not a processor grid"):
        _qwen25([1, IMAGE_TOKEN, IMAGE_TOKEN, IMAGE_TOKEN, 2], image_grid_thw=[(1, 3, 4)])
    with pytest.raises(ValueError, match="not one of"):
        _qwen25([1], scheme="qwen2_vl")
