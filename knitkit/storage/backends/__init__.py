"""Unit backends: put / replace / ranged read / delete over memory, /dev/shm and safetensors (README step 3)."""
