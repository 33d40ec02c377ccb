"""knitkit.integration.ray."""
