"""GRPO on megatron-core with knitkit (``examples/grpo_megatron.py``): rollout stand-in, loss, both data paths."""
