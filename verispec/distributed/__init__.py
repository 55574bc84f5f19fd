"""Tensor parallelism over torch.distributed: sharding, the collectives, the rank processes."""
