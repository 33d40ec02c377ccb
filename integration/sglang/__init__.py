"""knitkit.integration.sglang."""
