"""The engines: chunks and their memory, compiled stage functions, the split optimizer and its
host AdamW, ZeRO helpers, the chunked executor that carries out a plan, the plain whole-model jit
engine it is checked against, and decoding.

The executor never decides a placement: it is handed a ``pstar_jax.plan.placement.Plan``."""


def __getattr__(name: str) -> object:  # the names of the module this package replaced (pstar_jax._moved)
    from pstar_jax._moved import package_attr
    return package_attr(__name__, name)
