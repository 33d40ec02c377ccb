"""The unwrapped reference's batches for the Megatron equivalence tests: the check's own default,
each batch carrying the image pieces it consumes (NOTE [ Re-encoding reference ])."""

from __future__ import annotations

from knitkit.integration.megatron.testing import with_images

__all__ = ["with_images"]
