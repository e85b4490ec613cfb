"""From a model and a configuration to a planned engine: the warm-up trace of compiled stages
(``trace``), the machine's measured rates (``measure``), building the engine (``build``), and
pstar-plan's answers as data (``report``, ``search``, ``plot``)."""
