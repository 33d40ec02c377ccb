"""Delivery: reorganizer processes, shared-memory publication, per-rank consumers (README steps 7-9)."""
