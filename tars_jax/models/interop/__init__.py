"""transformers interop: checkpoint I/O, the reference model wrapper, tiny offline test checkpoints."""
