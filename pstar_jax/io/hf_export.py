"""A run's Hugging Face export: the same bytes at the end of the run (``--export-hf``) and from its
checkpoint (``pstar-export --hf``).

Both stream the same tensors in the same order. Trained ones are their fp32 masters. Frozen ones
(the base of a LoRA or --freeze run) are read again from the base's source, fp32 from what it
stores: the engine holds them in the compute dtype, and merging into or exporting that copy would
round a fp32 base to bf16 first. A LoRA run's adapters are merged into their kernels in fp32, and
each tensor is cast to the export dtype once, when written. An export that follows the run's
--init-from-hf source (``hf_export_source``) keeps its config.json's fields, and the rows of a
tensor cut short on import (GPT-2's position table, cut to seq_len) come back from it as stored,
so the export has the source's n_positions and the rows the run never used.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Collection, Iterable, Iterator, Mapping

import numpy as np

from pstar_jax.config import RunConfig
from pstar_jax.io.base_record import close_tensors, run_base
from pstar_jax.io.hf import HFCheckpoint, TensorMap, export_hf
from pstar_jax.io.lora_io import hf_stream
from pstar_jax.io.models import hf_export_config, hf_export_source

Tensors = Callable[[], Iterable[tuple[str, np.ndarray]]]


def export_run_hf(directory: str, config: RunConfig, model: Any, iter_params: Tensors, dtype: str,
                  tokenizer_from: str | None = None, frozen: Collection[str] = (), base: Mapping | None = None,
                  iter_adapters: Tensors | None = None, what: str = "CheckpointConfig.export_hf") -> list[str]:
    """Write the HF checkpoint of a run whose tensors ``iter_params`` streams (fp32, every name
    once). ``frozen``: the names among them to read from the run's base instead (an engine's
    compute-dtype copies), ``base`` the base record the run took at its start (checked to be
    unchanged; None: the base the config names, as it is now). ``iter_adapters``: a stream holding
    the adapters without reading a base (peft_io.merged_stream). Returns the file names written."""
    if frozen:
        engine_params = iter_params
        iter_params = functools.partial(_with_base, engine_params, set(frozen), config, model, base)
        iter_adapters = iter_adapters or engine_params
    tensor_map, hf_json = hf_export_config(config, model)
    tensors = hf_stream(config, iter_params, iter_adapters)
    source = hf_export_source(config)
    if source and any(truncate for _, _, truncate in tensor_map.values()):
        tensors = _with_source_rows(tensors, source, tensor_map, model)
    return export_hf(directory, tensors, tensor_map, hf_json, dtype, tokenizer_from, what=what)


def quant_note(config: RunConfig) -> str:
    """What an export's message says of a base trained quantized (EngineConfig.base_quant), else ""."""
    kind = config.engine.base_quant
    return (f" (the {kind} base's kernels dequantized, as the run computed with them, and the adapters merged "
            "into them in fp32, as peft merges into a bitsandbytes base)" if kind else "")


def _with_base(iter_params: Tensors, frozen: set[str], config: RunConfig, model: Any, record: Mapping | None
               ) -> Iterator[tuple[str, np.ndarray]]:
    tensors = run_base(config, model, record)
    try:
        for name, value in iter_params():
            yield name, np.asarray(tensors[name], np.float32) if name in frozen else value
    finally:
        close_tensors(tensors)


def _with_source_rows(tensors: Iterable[tuple[str, np.ndarray]], directory: str, tensor_map: TensorMap, model: Any
                      ) -> Iterator[tuple[str, np.ndarray]]:
    """``tensors`` with each one cut short on import followed by the source's rows it left out."""
    from pstar_jax.model.lora import base_shapes
    source = HFCheckpoint(directory, tensor_map, base_shapes(model))
    try:
        for name, value in tensors:
            if name in source.truncated:
                value = np.concatenate([np.asarray(value, np.float32), source.rows_beyond(name)])
            yield name, value
    finally:
        source.close()


__all__ = ["export_run_hf"]
