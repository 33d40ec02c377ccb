"""Planning and packing from metadata only: DP balance, CP split, encoder plans, THD layout (README steps 4, 5)."""
