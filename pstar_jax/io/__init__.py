"""Files in and out: orbax checkpoints, Flax, Hugging Face and peft formats, where a frozen base
came from, and the model a configuration names (``models``)."""
