"""knitkit.microbatch_iter."""
