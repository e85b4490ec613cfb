"""Training data: token files, batches, packed SFT rows, chat templates and tokenizers.

Above the configuration, below everything that trains: nothing here knows of models or engines.
``batch`` is what a stage reads; ``token_files`` and ``stream`` are plain token training data;
``packing``, ``rows``, ``chat``, ``template`` and ``sft`` are supervised fine-tuning data; ``tokenizer`` turns
text into token files; ``training`` opens either kind for a run."""


def __getattr__(name: str) -> object:  # the names of the module this package replaced (pstar_jax._moved)
    from pstar_jax._moved import package_attr
    return package_attr(__name__, name)
