"""Helpers of `benchmarks/vs_baselines.py`: hand-written baselines (DDP, FSDP2, Megatron TP + DP), their
measurement (step time, peak live-tensor bytes per rank) and the cost model's prices for them."""
