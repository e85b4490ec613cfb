"""A training run: the loop (``loop``), its metrics writers, the multi-process runtime, and how a
process ends (``exits``, JAX-free)."""
