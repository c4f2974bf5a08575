"""Sampling on the device: the sampler, draft verification, the table of per-request sampling fields."""
