"""Building a storable Trajectory (payload arrays + metadata) from a request and its SGLang outputs."""

from __future__ import annotations

import base64
import dataclasses

import numpy as np
import pytest
from sglang_fixtures import load

from knitkit.integration.sglang import (
    EnvironmentTokens,
    PayloadConfig,
    RolloutRequest,
    build_trajectory,
    image_array,
    image_bytes,
    parse_generate_output,
    placeholder_runs,
)
from knitkit.storage import content_key

IMAGE_PAD = 151655


def _grpo_requests() -> tuple[list[RolloutRequest], list[dict]]:
    record = load("vlm_grpo_batch.json")
    body = record["request"]
    requests = [
        RolloutRequest(
            trajectory_id=f"s0-{i}",
            sample_id="s0",
            source="chartqa",
            rollout_step=3,
            input_ids=tuple(body["input_ids"][0]),
            images=tuple(body["image_data"][0]),
        )
        for i in range(body["sampling_params"]["n"])
    ]
    return requests, record["response"]


def test_grpo_group_shares_one_unit_per_image() -> None:
    """The n trajectories of a sample reference the same content keys at their placeholder runs."""
    requests, outputs = _grpo_requests()
    config = PayloadConfig(image_token_id=IMAGE_PAD)
    trajectories = [
        build_trajectory(r, [parse_generate_output(o)], config)
        for r, o in zip(requests, outputs, strict=True)
    ]
    metas = [t.meta() for t in trajectories]
    keys = {ref.key for m in metas for ref in m.multimodal}
    assert len(keys) == 2 and all(k.field == "image" for k in keys)
    first = metas[0].multimodal
    assert [(r.token_start, r.num_tokens, r.cost) for r in first] == [(15, 4, 4.0), (21, 8, 8.0)]
    tokens = trajectories[0].token_fields["tokens"]
    units = trajectories[0].inputs()
    for image, ref in zip(requests[0].images, first, strict=True):
        assert (tokens[ref.token_start : ref.token_start + ref.num_tokens] == IMAGE_PAD).all()
        data = base64.b64decode(image.split(",")[1])
        assert data.startswith(b"\x89PNG")
        assert units[ref.key].tobytes() == data
        assert ref.key == content_key("image", np.frombuffer(data, dtype=np.uint8))
    for meta in metas[1:]:
        assert meta.multimodal == first


def test_fields_align_with_the_sequence() -> None:
    """tokens = prompt + output; loss_mask marks generated tokens; logprobs sit at those positions."""
    requests, outputs = _grpo_requests()
    for request, raw in zip(requests, outputs, strict=True):
        out = parse_generate_output(raw)
        trajectory = build_trajectory(request, [out], PayloadConfig(image_token_id=IMAGE_PAD))
        fields, meta = trajectory.token_fields, trajectory.meta()
        prompt = len(request.input_ids)
        assert fields["tokens"].tolist() == list(request.input_ids) + raw["output_ids"]
        assert meta.num_tokens == len(fields["tokens"]) == out.num_tokens
        assert fields["loss_mask"].tolist() == [0] * prompt + [1] * len(raw["output_ids"])
        assert out.logprobs is not None
        np.testing.assert_array_equal(fields["logprobs"][prompt:], out.logprobs)
        assert not fields["logprobs"][:prompt].any()
        assert (meta.min_version, meta.max_version) == (7, 7)
        assert (meta.sample_id, meta.source, meta.rollout_step) == ("s0", "chartqa", 3)


def test_routing_rows_align_in_the_smallest_dtype_and_fill_the_last_token() -> None:
    """Row i of routing is the experts of token i, stored uint8 for 128 experts; the
    never-forwarded last token holds experts 0..topk-1 (NOTE [ Routing of unrouted positions ]);
    a prompt position SGLang did not report, or an id past num_experts, is refused."""
    record = load("moe_routed_experts.json")
    shape = (record["num_hidden_layers"], record["num_experts_per_tok"])
    out = parse_generate_output(record["response"], routing_shape=shape)
    request = RolloutRequest("t", "s", "math", 0, tuple(record["request"]["input_ids"]))
    config = PayloadConfig(routing_shape=shape, num_experts=128)
    trajectory = build_trajectory(request, [out], config)
    routing = trajectory.token_fields["routing"]
    assert routing.dtype == np.uint8 and routing.shape == (out.num_tokens, *shape)
    assert out.routed_experts is not None
    np.testing.assert_array_equal(routing[:-1], out.routed_experts)
    assert (routing[-1] == np.arange(shape[1])).all()
    assert (trajectory.min_version, trajectory.max_version) == (12, 12)
    wide = build_trajectory(request, [out], dataclasses.replace(config, num_experts=300))
    assert wide.token_fields["routing"].dtype == np.uint16
    with pytest.raises(ValueError, match="set PayloadConfig\\(num_experts"):
        build_trajectory(request, [out], PayloadConfig(routing_shape=shape))
    with pytest.raises(ValueError, match=r"trajectory 't'.*expert id 1\d\d is outside \[0, 100\)"):
        build_trajectory(request, [out], dataclasses.replace(config, num_experts=100))
    started = dataclasses.replace(
        out, routed_experts=out.routed_experts[5:], routed_experts_start=5
    )
    with pytest.raises(ValueError, match=r"positions \[0, 5\) have no routed experts"):
        build_trajectory(request, [started], config)


def test_partial_rollout_continues_across_a_weight_update() -> None:
    """An aborted output plus its continuation is one trajectory spanning both versions."""
    exchanges = load("partial_rollout.json")["exchanges"]
    outs = [parse_generate_output(e["response"]) for e in exchanges]
    prompt = tuple(exchanges[0]["request"]["input_ids"])
    request = RolloutRequest("t", "s", "math", 4, prompt, issued_version=4)
    trajectory = build_trajectory(request, outs, PayloadConfig())
    generated = exchanges[0]["response"]["output_ids"] + exchanges[1]["response"]["output_ids"]
    assert trajectory.token_fields["tokens"].tolist() == list(prompt) + generated
    assert trajectory.token_fields["loss_mask"].sum() == len(generated)
    assert (trajectory.min_version, trajectory.max_version) == (4, 5)
    with pytest.raises(ValueError, match="aborted"):
        build_trajectory(request, outs[:1], PayloadConfig())
    with pytest.raises(ValueError, match="prompt_tokens=38"):
        build_trajectory(request, outs[1:], PayloadConfig())
    with pytest.raises(ValueError, match=r"was aborted; continue it .* before the environment"):
        build_trajectory(request, [outs[0], EnvironmentTokens((1, 2))], PayloadConfig())


def test_issued_version_lowers_min_version() -> None:
    """A request issued under an older policy than the one that finished it counts that version."""
    exchange = load("partial_rollout.json")["exchanges"][1]
    out = parse_generate_output(exchange["response"])
    request = RolloutRequest(
        "t", "s", "math", 0, tuple(exchange["request"]["input_ids"]), issued_version=2
    )
    meta = build_trajectory(request, [out], PayloadConfig()).meta()
    assert (meta.min_version, meta.max_version) == (2, 5)


def test_image_errors_say_what_to_set() -> None:
    """Images without a placeholder token, or a count mismatch, are errors naming the trajectory."""
    requests, outputs = _grpo_requests()
    out = parse_generate_output(outputs[0])
    with pytest.raises(ValueError, match="image_token_id"):
        build_trajectory(requests[0], [out], PayloadConfig())
    one_image = dataclasses.replace(requests[0], images=requests[0].images[:1])
    with pytest.raises(ValueError, match="'s0-0': 1 images but 2 runs"):
        build_trajectory(one_image, [out], PayloadConfig(image_token_id=IMAGE_PAD))


def test_image_identity_and_placeholder_runs(tmp_path) -> None:
    """A file path and its bytes are one image; a URL is identified by its text."""
    path = tmp_path / "a.png"
    path.write_bytes(b"\x89PNG fake")
    assert image_bytes(str(path)) == image_bytes(b"\x89PNG fake")
    assert image_bytes("https://x/a.png") == b"https://x/a.png"
    assert placeholder_runs([1, 9, 9, 2, 9, 3, 9, 9, 9], 9) == [(1, 2), (4, 1), (6, 3)]
    assert placeholder_runs([1, 2], 9) == []


def test_image_encoder_and_version_hooks() -> None:
    """encode_image shapes the stored unit (keys follow its content); version_of maps labels."""
    requests, outputs = _grpo_requests()
    out = parse_generate_output(outputs[0])
    config = PayloadConfig(
        image_token_id=IMAGE_PAD,
        encode_image=lambda data: np.frombuffer(data, dtype=np.uint8)[:64].reshape(16, 4),
        version_of=lambda label: {"7": 70}[label],
    )
    trajectory = build_trajectory(requests[0], [out], config)
    units = trajectory.inputs()
    assert all(unit.shape == (16, 4) for unit in units.values())
    assert [ref.key for ref in trajectory.meta().multimodal] == list(units)
    assert (trajectory.min_version, trajectory.max_version) == (70, 70)


def _decoded_requests(kind: str) -> tuple[list[RolloutRequest], list[dict]]:
    """The recorded GRPO batch with its PNGs passed decoded, as verl's in-process loop does (PIL)."""
    import io

    from PIL import Image

    requests, outputs = _grpo_requests()
    pngs = [base64.b64decode(image.split(",")[1]) for image in requests[0].images]
    decoded = []
    for png in pngs:
        image = Image.open(io.BytesIO(png))
        image.load()
        decoded.append(image if kind == "pil" else np.asarray(image.convert("RGB")))
    return [dataclasses.replace(r, images=tuple(decoded)) for r in requests], outputs


@pytest.mark.parametrize("kind", ["pil", "numpy"])
def test_decoded_images_are_stored_as_pixels(kind: str) -> None:
    """PIL images and numpy arrays (not only bytes/strings) become pixel units: equal pixels, equal
    keys across the group; the stored unit is the ``[H, W, C]`` uint8 array."""
    requests, outputs = _decoded_requests(kind)
    config = PayloadConfig(image_token_id=IMAGE_PAD)
    trajectories = [
        build_trajectory(r, [parse_generate_output(o)], config)
        for r, o in zip(requests, outputs, strict=True)
    ]
    metas = [t.meta() for t in trajectories]
    assert len({ref.key for m in metas for ref in m.multimodal}) == 2
    units = trajectories[0].inputs()
    for image, ref in zip(requests[0].images, metas[0].multimodal, strict=True):
        pixels = np.asarray(image)
        assert units[ref.key].dtype == np.uint8 and units[ref.key].shape == pixels.shape
        assert np.array_equal(units[ref.key], pixels)
        assert ref.key == content_key("image", pixels)
    # The same pixels passed as PIL or as an array are the same image.
    pil, _ = _decoded_requests("pil")
    arrays, _ = _decoded_requests("numpy")
    assert [image_array(i).shape for i in pil[0].images] == [
        image_array(i).shape for i in arrays[0].images
    ]


def test_decoded_images_reach_encode_image_as_pixels() -> None:
    """``encode_image`` gets the pixel array of a decoded image (e.g. a processor making patches)."""
    requests, outputs = _decoded_requests("pil")
    seen: list[tuple[int, ...]] = []

    def encode(data: bytes | np.ndarray) -> np.ndarray:
        assert isinstance(data, np.ndarray)
        seen.append(data.shape)
        return data.reshape(-1, data.shape[-1])[:4].astype(np.float32)

    config = PayloadConfig(image_token_id=IMAGE_PAD, encode_image=encode)
    trajectory = build_trajectory(requests[0], [parse_generate_output(outputs[0])], config)
    assert seen == [np.asarray(i).shape for i in requests[0].images]
    assert all(u.dtype == np.float32 for u in trajectory.inputs().values())


PATCH, MERGE = 14, 2
"""Qwen2.5-VL's vision patch size and spatial merge: ``h/14 * w/14 / 4`` image tokens per image."""


def _qwen_pixel_values(pixels: bytes | np.ndarray) -> np.ndarray:
    """A stand-in for the Qwen-VL processor's ``pixel_values`` of one image: ``[t*h*w, 3*14*14]``."""
    assert isinstance(pixels, np.ndarray)
    height, width, channels = pixels.shape
    grid = pixels.reshape(height // PATCH, PATCH, width // PATCH, PATCH, channels)
    return grid.transpose(0, 2, 4, 1, 3).reshape(-1, channels * PATCH * PATCH).astype(np.float32)


def test_qwen_vl_request_stores_pixel_values_and_mrope_positions() -> None:
    """A Qwen-VL request with ``image_grid_thw``: the processor-expanded ids, the images' pixel
    values and the whole sequence's ``mrope_position_ids`` ``[T, 3]`` (prompt and generated
    tokens) equal to Qwen2.5-VL's ``get_rope_index`` land in the store."""
    from qwen_vl_reference import get_rope_index

    from knitkit.integration.megatron import MROPE_FIELD
    from knitkit.storage import MemoryBackend, TrajectoryStore
    from knitkit.types import UnitKey

    requests, outputs = _decoded_requests("numpy")
    grids = tuple((1, im.shape[0] // PATCH, im.shape[1] // PATCH) for im in requests[0].images)
    config = PayloadConfig(image_token_id=IMAGE_PAD, encode_image=_qwen_pixel_values)
    store = TrajectoryStore(MemoryBackend())
    for request, output in zip(requests, outputs, strict=True):
        request = dataclasses.replace(request, image_grid_thw=grids)
        trajectory = build_trajectory(request, [parse_generate_output(output)], config)
        store.write(trajectory)
        tokens = store.read(UnitKey(request.trajectory_id, "tokens"))
        assert tokens.tolist() == [*request.input_ids, *output["output_ids"]]
        positions = store.read(UnitKey(request.trajectory_id, MROPE_FIELD))
        reference = get_rope_index("qwen2_5_vl", [tokens.tolist()], grids)[0]
        assert positions.shape == (len(tokens), 3)
        assert np.array_equal(positions, reference.T)
        for ref, (t, h, w) in zip(trajectory.meta().multimodal, grids, strict=True):
            assert store.read(ref.key).shape == (t * h * w, 3 * PATCH * PATCH)
            assert ref.num_tokens == t * h * w // MERGE**2


def test_qwen_vl_grid_must_match_the_placeholder_runs() -> None:
    """A grid whose merged size differs from its placeholder run is an error naming the image."""
    requests, outputs = _decoded_requests("numpy")
    bad = dataclasses.replace(requests[0], image_grid_thw=((1, 4, 4), (1, 4, 4)))
    with pytest.raises(ValueError, match=r"'s0-0': image 1: grid \(1, 4, 4\) needs 4 image"):
        build_trajectory(
            bad, [parse_generate_output(outputs[0])], PayloadConfig(image_token_id=IMAGE_PAD)
        )
    short = dataclasses.replace(requests[0], image_grid_thw=((1, 4, 4),))
    with pytest.raises(ValueError, match="1 image_grid_thw for 2 images"):
        build_trajectory(
            short, [parse_generate_output(outputs[0])], PayloadConfig(image_token_id=IMAGE_PAD)
        )


VIDEO_PAD, VISION_START, VISION_END = 151656, 151652, 151653
CHAT_USER, CHAT_ASSISTANT = [151644, 872, 198], [151645, 198, 151644, 77091, 198]


def _answer(prompt_tokens: int, output_ids: list[int], version: str = "2") -> dict:
    """A finished /generate output for ``prompt_tokens`` expanded ids, in SGLang's wire format."""
    return {
        "output_ids": output_ids,
        "meta_info": {
            "id": f"video-{prompt_tokens}",
            "finish_reason": {"type": "stop", "matched": 151645},
            "prompt_tokens": prompt_tokens,
            "weight_version": version,
            "completion_tokens": len(output_ids),
            "output_token_logprobs": [[-0.25, t, None] for t in output_ids],
        },
    }


def _qwen25_video_request() -> tuple[RolloutRequest, dict, int]:
    """Qwen2.5-VL chat: an image (1, 4, 4) and a video (4, 4, 8) at fps 2, then the question.
    Returns the request, its output and the length of the prompt through the video run."""
    ids = [*CHAT_USER, VISION_START, *[IMAGE_PAD] * 4, VISION_END, VISION_START]
    ids += [VIDEO_PAD] * (4 * 2 * 4)
    through_video = len(ids)
    ids += [VISION_END, 3838, 374, 6247, 30, *CHAT_ASSISTANT]
    request = RolloutRequest(
        "v0",
        "s-video",
        "video-qa",
        1,
        tuple(ids),
        images=(b"png",),
        image_grid_thw=((1, 4, 4),),
        videos=(b"mp4 bytes",),
        video_grid_thw=((4, 4, 8),),
        second_per_grid_ts=(1.0,),
    )
    return request, _answer(len(ids), [785, 2781, 4933, 151645]), through_video


QWEN25 = PayloadConfig(
    image_token_id=IMAGE_PAD,
    video_token_id=VIDEO_PAD,
    tokens_per_second=2,
    spatial_merge_size=MERGE,
)


def test_qwen2_5_vl_video_request_stores_its_unit_and_positions() -> None:
    """Through the writer, a Qwen2.5-VL request with an image and a video stores the video as one
    unit at its run and ``mrope_position_ids`` equal to transformers' positions: its prefill
    through the video, then every later token (question and answer) as generation continues."""
    from qwen_vl_reference import generation_positions

    from knitkit.integration.megatron import MROPE_FIELD
    from knitkit.integration.sglang import RolloutWriter
    from knitkit.storage import MemoryBackend, TrajectoryStore
    from knitkit.types import UnitKey

    request, output, through_video = _qwen25_video_request()
    store = TrajectoryStore(MemoryBackend())
    meta = RolloutWriter(store, QWEN25).add(request, output)
    assert meta is not None
    tokens = [*request.input_ids, *output["output_ids"]]
    expected = generation_positions(
        "qwen2_5_vl",
        tokens[:through_video],
        len(tokens) - through_video,
        request.image_grid_thw,
        request.video_grid_thw,
        request.second_per_grid_ts,
    )
    np.testing.assert_array_equal(store.read(UnitKey("v0", MROPE_FIELD)), expected.T)
    video = [ref for ref in meta.multimodal if ref.key.field == "video"]
    assert [(r.token_start, r.num_tokens) for r in video] == [(through_video - 32, 32)]
    assert store.read(video[0].key).tobytes() == b"mp4 bytes"


def test_qwen3_vl_video_is_one_unit_per_temporal_patch() -> None:
    """A Qwen3-VL video (timestamp text, then one run per temporal patch): one unit per run from
    ``encode_video``'s first axis, positions equal transformers' Qwen3-VL ``get_rope_index``."""
    from qwen_vl_reference import get_rope_index

    from knitkit.integration.megatron import MROPE_FIELD

    ids = [*CHAT_USER, VISION_START]
    for second in range(3):  # "<1.0 seconds>" etc., then the patch's run
        ids += [27, 16 + second, 6486, VISION_START, *[VIDEO_PAD] * 4, VISION_END]
    ids += [VISION_END, 3838, 30, *CHAT_ASSISTANT]
    request = RolloutRequest(
        "q3",
        "s",
        "video-qa",
        1,
        tuple(ids),
        videos=(np.zeros((6, 56, 56, 3), np.uint8),),
        video_grid_thw=((3, 4, 4),),
    )
    patches = np.arange(3 * 4 * 8, dtype=np.float32).reshape(3, 4, 8)
    config = PayloadConfig(
        image_token_id=IMAGE_PAD,
        video_token_id=VIDEO_PAD,
        mrope_scheme="qwen3_vl",
        encode_video=lambda frames: patches,
    )
    output = parse_generate_output(_answer(len(ids), [40, 1490, 151645]))
    trajectory = build_trajectory(request, [output], config)
    tokens = [*ids, 40, 1490, 151645]
    reference = get_rope_index("qwen3_vl", [tokens], video_grid_thw=[(3, 4, 4)])[0]
    np.testing.assert_array_equal(trajectory.token_fields[MROPE_FIELD], reference.T)
    units = trajectory.multimodal
    assert [(u.token_start, u.num_tokens) for u in units] == [(8, 4), (17, 4), (26, 4)]
    for k, unit in enumerate(units):
        np.testing.assert_array_equal(unit.data, patches[k : k + 1])
    with pytest.raises(ValueError, match=r"'q3', video 0: it spans 3 placeholder runs"):
        build_trajectory(request, [output], dataclasses.replace(config, encode_video=None))


def test_inconsistent_video_metadata_is_refused_and_nothing_stored() -> None:
    """A video grid that does not match its run, missing timing or config: a ValueError naming the
    trajectory and what to pass; the store stays empty."""
    from knitkit.integration.sglang import RolloutWriter
    from knitkit.storage import MemoryBackend, TrajectoryStore

    request, output, _ = _qwen25_video_request()
    store = TrajectoryStore(MemoryBackend())
    writer = RolloutWriter(store, QWEN25)
    cases = [
        (
            dataclasses.replace(request, video_grid_thw=((4, 4, 4),)),
            QWEN25,
            r"'v0': video 0: grid \(4, 4, 4\) needs 16 video tokens .* has 32",
        ),
        (
            dataclasses.replace(request, second_per_grid_ts=()),
            QWEN25,
            "1 video_grid_thw but 0 second_per_grid_ts",
        ),
        (request, dataclasses.replace(QWEN25, tokens_per_second=None), "need tokens_per_second"),
        (request, dataclasses.replace(QWEN25, video_token_id=None), "video_token_id"),
        (dataclasses.replace(request, videos=()), QWEN25, "1 video_grid_thw for 0 videos"),
        (
            dataclasses.replace(request, videos=(b"a", b"b")),
            QWEN25,
            "1 video_grid_thw for 2 videos",
        ),
    ]
    for bad, config, message in cases:
        writer.config = config
        with pytest.raises(ValueError, match=message):
            writer.add(bad, output)
    assert list(store.backend.keys()) == [] and writer.partial == ()
