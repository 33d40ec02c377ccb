"""The trajectory store alone, on safetensors shards on disk: atomic units, sliced reads, field updates.

Run: python examples/store_with_disk_backend.py
"""

import tempfile

import numpy as np

from knitkit.storage import MultimodalInput, SafetensorsBackend, Trajectory, TrajectoryStore
from knitkit.types import UnitKey

rng = np.random.default_rng(0)
image = rng.standard_normal((16, 64)).astype(np.float32)  # one image: 16 patches x 64 dims

with tempfile.TemporaryDirectory() as shards:
    store = TrajectoryStore(SafetensorsBackend(shards, shard_bytes=1 << 20))

    # A GRPO group of 4 rollouts of one prompt: 4 trajectories, ONE stored image.
    for i in range(4):
        n = 512 + 64 * i
        store.write(
            Trajectory(
                trajectory_id=f"prompt0-{i}",
                sample_id="prompt0",
                source="chartqa",
                token_fields={
                    "tokens": rng.integers(0, 32000, n, dtype=np.int32),
                    "logprobs": -rng.random(n, dtype=np.float32),
                },
                multimodal=(MultimodalInput("image", image, token_start=8, num_tokens=16),),
            )
        )
    images = {ref.key for meta in store.metas() for ref in meta.multimodal}
    print(f"stored {len(store.index)} trajectories, {len(images)} image unit(s)")

    # A context-parallel rank reads only its two chunks of one trajectory's tokens.
    tokens = UnitKey("prompt0-0", "tokens")
    before = store.bytes_read
    piece = store.read(tokens, ranges=[(0, 128), (384, 512)])
    print(f"CP slice: {piece.shape[0]} tokens, read {store.bytes_read - before} of 2048 bytes")

    # A per-field update (e.g. advantages after the reward) writes exactly one new unit.
    entry = store.update("prompt0-0", "advantages", np.full(512, 0.5, dtype=np.float32))
    print(f"updated {entry.key}: {entry.spec.shape} {entry.spec.dtype}")
    store.close()
