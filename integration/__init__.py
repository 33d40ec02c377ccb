"""Adapters to the engines knitkit sits among; import them as ``knitkit.integration.<engine>``."""
