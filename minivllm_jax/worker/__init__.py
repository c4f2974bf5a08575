"""The worker floor: device state and the step (`runner.ModelRunner`), the persistent batch, the jitted programs and their executables."""
