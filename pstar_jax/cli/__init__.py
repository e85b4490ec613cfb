"""The commands, one module per console script, each only wiring flags to the library; ``flags``
derives the flags from the configuration dataclasses."""


def __getattr__(name: str) -> object:  # the names of the module this package replaced (pstar_jax._moved)
    from pstar_jax._moved import package_attr
    return package_attr(__name__, name)
