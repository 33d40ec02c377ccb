"""knitkit.integration.mooncake."""
