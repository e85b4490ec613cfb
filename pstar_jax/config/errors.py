"""The errors a user can act on, at the bottom of the package so that any layer raises them
without importing upward. Each is one sentence naming what is wrong and what to change; the
commands print it as one line and exit 2."""


class ConfigError(ValueError):
    """A user error: one sentence naming what is wrong and what to change."""


class DataError(ConfigError):
    """Training data is missing, malformed, or does not fit the requested shapes."""


class CheckpointError(ConfigError):
    """A missing, corrupt or incompatible checkpoint: one sentence, nothing overwritten."""


class HFCheckpointError(ConfigError):
    """A missing, malformed or mismatched Hugging Face checkpoint: one sentence."""


class AdapterError(HFCheckpointError):
    """A missing, malformed or mismatched peft adapter: one sentence."""

