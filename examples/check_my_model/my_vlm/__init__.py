"""A user's Megatron VLM, as ``knitkit check-equivalence`` and the ``megatron_equivalence`` fixture take it."""
