"""Tensor parallelism (`sharding`) and the multi-host step broadcast (`multihost`)."""
