"""Engines over a partly frozen model, for tests/test_frozen.py and tests/test_lora.py: a chunked
engine whose chunks move every step and the plain engine it must equal; and the tiny Llama LoRA
base in a Hugging Face directory that the disk and quantized-base tests start from."""

import jax
import numpy as np
from jax.sharding import Mesh

from pstar_jax.config import EngineConfig, OptimConfig
from pstar_jax.model.freeze import trainable
from pstar_jax.plan.machine import H200
from pstar_jax.engine.optim import default_tx
from pstar_jax.engine.plain import PlainEngine
from pstar_jax.planner.build import chunked_engine

OPTIM = OptimConfig(lr=3e-3, warmup_steps=2, total_steps=10, weight_decay=0.1, clip_norm=1.0)
CHUNK = 8192


def mesh(W=1):
    return Mesh(np.array(jax.devices()[:W]), ("data",))


def chunked(m, frozen, budget="tight", precision="fp32", micro_batches=1, W=1, batch=4, seq=64, optim=OPTIM,
            chunk=CHUNK, init_params=None):
    """budget "tight": room beside the busiest moment's working memory for one chunk more than a
    stage reads, so chunks move every step (the tiny model's working memory dwarfs its chunks)."""
    cfg = EngineConfig(chunk_numel=chunk, device_memory=None if budget == "tight" else budget, precision=precision,
                       micro_batches=micro_batches)
    engine = chunked_engine(m, cfg, default_tx(optim), mesh(W), (batch, seq), H200, clip_norm=optim.clip_norm,
                            trainable=trainable(frozen), init_params=init_params)
    if budget != "tight":
        return engine
    shape = engine.plan_for((batch, seq)).shape
    reads = max(sum(shape.chunk_bytes[c] for c in cs) for cs in shape.stage_chunks)
    budget = shape.busiest_non_model_bytes + 2 * reads + max(shape.chunk_bytes)
    return chunked(m, frozen, budget, precision, micro_batches, W, batch, seq, optim, chunk, init_params)


def hf_lora_llama(tmp_path, d_ff, seq=64, rank=4):
    """A tiny Llama's HF directory (fp32) under tmp_path/base, its LoRA model, the checkpoint's
    reader and the frozen set."""
    from pstar_jax.config.lora import LoraConfig
    from pstar_jax.io.hf import HFCheckpoint, read_hf_config
    from pstar_jax.model.lora import base_shapes, frozen_for_lora
    from pstar_models import hf as mhf
    from pstar_models.llama import LlamaConfig, StagedLlama
    from pstar_models.lora import LoraSpec
    from test_hf import write_family_checkpoint
    src = str(tmp_path / "base")
    write_family_checkpoint(src, StagedLlama(LlamaConfig(vocab_size=256, d_model=64, n_layer=3, n_head=4, n_kv_head=2,
                                                          d_ff=d_ff, seq_len=seq, max_position_embeddings=seq)))
    m = mhf.build_from_hf(read_hf_config(src), lora=LoraSpec(rank=rank, alpha=16.0), seq_len=seq)
    return src, m, HFCheckpoint(src, mhf.hf_tensors(m), base_shapes(m)), frozen_for_lora(m, LoraConfig(rank=rank))


def plain(m, frozen, micro_batches=1, W=1):
    return PlainEngine(m, "fp32", default_tx(OPTIM), micro_batches, clip_norm=OPTIM.clip_norm, mesh=mesh(W),
                       frozen=frozen)
