"""From a model and a configuration to a planned engine: the warm-up trace of compiled stages
(``trace``), the machine's measured rates (``measure``), building the engine (``build``), and
pstar-plan's answers as data (``report``, ``search``, ``plot``)."""


def __getattr__(name: str) -> object:  # the names of the module this package replaced (pstar_jax._moved)
    from pstar_jax._moved import package_attr
    return package_attr(__name__, name)
