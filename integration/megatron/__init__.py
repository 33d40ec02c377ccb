"""knitkit.integration.megatron."""
