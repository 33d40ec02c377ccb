"""knitkit.storage."""
