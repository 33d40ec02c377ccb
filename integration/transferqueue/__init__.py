"""knitkit.integration.transferqueue."""
