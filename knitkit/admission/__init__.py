"""knitkit.admission."""
