"""Write, index and release: trajectories split into atomic units (README steps 1, 2, 6)."""
