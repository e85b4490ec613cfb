"""The commands, one module per console script, each only wiring flags to the library; ``flags``
derives the flags from the configuration dataclasses."""
