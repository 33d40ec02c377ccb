"""knitkit.encoder_dedup."""
