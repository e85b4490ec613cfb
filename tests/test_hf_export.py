"""A run's Hugging Face export: the end of the run (--export-hf) and pstar-export --hf of its
checkpoint write the same bytes, computed from the source's own precision (a fp32 base is merged
and exported from fp32, never from the engine's bf16 copy); a GPT-2 trained on fewer positions than
its source keeps the source's n_positions and the rows it did not use; pstar-export --help loads no jax.
"""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

import pstar_jax as ps
from pstar_jax.config.lora import LoraConfig
from pstar_jax.io.peft_io import lora_scale, merge_adapter
from pstar_models.gpt import GPTConfig, StagedGPT
from pstar_models.llama import LlamaConfig, StagedLlama
from test_hf import read_all, write_family_checkpoint

LLAMA = StagedLlama(LlamaConfig(vocab_size=300, d_model=48, n_layer=2, n_head=6, n_kv_head=2, d_ff=80, seq_len=32,
                                max_position_embeddings=32))
GPT2 = StagedGPT(GPTConfig(vocab_size=300, d_model=36, n_layer=2, n_head=3, seq_len=40))  # 40 positions
LORA = LoraConfig(rank=4, alpha=8.0, targets="attn.q,attn.v,mlp.*")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def config(src, ck, lora=LoraConfig(), **model):
    return ps.RunConfig(model=ps.ModelConfig(init_from_hf=src, **model), lora=lora,
                        train=ps.TrainConfig(batch_size=8, steps=2), optim=ps.OptimConfig(lr=1e-2),
                        engine=ps.EngineConfig(chunk_numel=16384),  # bf16: the frozen base is a bf16 copy
                        checkpoint=ps.CheckpointConfig(directory=ck), output=ps.OutputConfig(quiet=True))


def train_and_export(tmp_path, cfg, dtypes=("bf16", "fp32")):
    """Train, export at the end of the run in each dtype, then pstar-export the checkpoint the same
    way: ({dtype: run's export dir}, {dtype: pstar-export's dir}, the run's fp32 params); the
    checkpoint streams its tensors in the engine's order (so larger exports shard alike)."""
    from pstar_jax.io.base_record import checkpoint_tensors
    from pstar_jax.io.checkpoint import Checkpointer
    from pstar_jax.cli.export import main as export_main
    ours = {d: str(tmp_path / f"run_{d}") for d in dtypes}
    theirs = {d: str(tmp_path / f"ckpt_{d}") for d in dtypes}
    with ps.Run(cfg) as run:
        for _ in run.fit():
            pass
        params = run.engine.params()
        order = [name for name, _ in run.engine.iter_params()]
        for dtype, out in ours.items():
            run.export_hf(out, dtype)
        model = run.model
    ckpt = Checkpointer(cfg.checkpoint.directory)
    try:
        assert [name for name, _ in checkpoint_tensors(ckpt, ckpt.meta(), model, cfg)] == order
    finally:
        ckpt.close()
    for dtype, out in theirs.items():
        assert export_main(["--checkpoint-dir", cfg.checkpoint.directory, "--hf", out, "--export-dtype", dtype]) == 0
    return ours, theirs, params


def same_files(a, b):
    assert sorted(os.listdir(a)) == sorted(os.listdir(b))
    for name in os.listdir(a):
        with open(os.path.join(a, name), "rb") as fa, open(os.path.join(b, name), "rb") as fb:
            assert fa.read() == fb.read(), name


@pytest.mark.slow
def test_a_lora_run_on_a_fp32_base_exports_the_same_bytes_both_ways_from_fp32(tmp_path):
    from pstar_models.hf import hf_tensors
    src = str(tmp_path / "src")
    stored = write_family_checkpoint(src, LLAMA)  # fp32
    ours, theirs, params = train_and_export(tmp_path, config(src, str(tmp_path / "ck"), LORA))
    for dtype in ours:
        same_files(ours[dtype], theirs[dtype])
    written = read_all(ours["fp32"])
    scale = lora_scale(8.0, 4)
    merged = 0
    for name, (hf_name, transpose, _) in hf_tensors(LLAMA).items():
        module = name.removesuffix(".kernel")
        if module + ".lora.lora_a" not in params:  # untrained: the source's fp32, not rounded to bf16
            assert written[hf_name].tobytes() == stored[hf_name].tobytes(), name
            continue
        base = stored[hf_name].T if transpose else stored[hf_name]
        expected = merge_adapter(base, params[module + ".lora.lora_a"], params[module + ".lora.lora_b"], scale)
        value = written[hf_name].T if transpose else written[hf_name]
        np.testing.assert_array_equal(value, expected, err_msg=name)
        merged += 1
    assert merged == 2 * 5
    assert np.abs(params["blocks.0.attn.q.lora.lora_b"]).max() > 0  # it trained


def test_frozen_tensors_are_read_from_the_source_not_the_engines_bf16_copy(tmp_path):
    """export_run_hf over an engine-like stream whose frozen tensors are bf16 copies: the export
    holds the source's fp32 (merged in fp32 where an adapter is), and a base that changed since the
    run's record is refused in one line."""
    import ml_dtypes
    from pstar_jax.config import CheckpointError
    from pstar_jax.io.base_record import base_record
    from pstar_jax.io.hf_export import export_run_hf
    from pstar_jax.io.models import load_model
    from pstar_models.hf import hf_tensors
    src = str(tmp_path / "src")
    stored = write_family_checkpoint(src, LLAMA)
    cfg = config(src, None, LORA)
    model = load_model(cfg)
    mapping = hf_tensors(model)
    rng = np.random.default_rng(0)
    adapters = {n: rng.standard_normal(s).astype(np.float32) for n, s in model.param_shapes().items() if ".lora." in n}

    def source(name):
        hf_name, transpose, _ = mapping[name]
        return stored[hf_name].T if transpose else stored[hf_name]

    def engine_params():  # what a bf16 engine holds: the frozen base rounded
        for name in model.param_shapes():
            yield name, adapters[name] if name in adapters else \
                source(name).astype(ml_dtypes.bfloat16).astype(np.float32)
    frozen = set(model.param_shapes()) - set(adapters)
    export_run_hf(str(tmp_path / "out"), cfg, model, engine_params, "fp32", frozen=frozen,
                  base=base_record(cfg, model))
    written = read_all(tmp_path / "out")
    scale = lora_scale(8.0, 4)
    for name, (hf_name, transpose, _) in mapping.items():
        expected = source(name)
        module = name.removesuffix(".kernel")
        if module + ".lora.lora_a" in adapters:
            expected = merge_adapter(expected, adapters[module + ".lora.lora_a"], adapters[module + ".lora.lora_b"],
                                     scale)
        np.testing.assert_array_equal(written[hf_name].T if transpose else written[hf_name], expected, err_msg=name)

    record = {**base_record(cfg, model), "fingerprint": "0" * 64}
    with pytest.raises(CheckpointError) as err:
        export_run_hf(str(tmp_path / "again"), cfg, model, engine_params, "fp32", frozen=frozen, base=record)
    assert "changed while it trained" in str(err.value) and "\n" not in str(err.value)
    assert not os.path.exists(tmp_path / "again")


@pytest.mark.parametrize("lora", [LoraConfig(), LoraConfig(rank=2, alpha=4.0, targets="attn.qkv")],
                         ids=["full", "lora"])
def test_gpt2_trained_on_fewer_positions_keeps_the_sources_position_table(tmp_path, lora):
    src = str(tmp_path / "src")
    stored = write_family_checkpoint(src, GPT2)
    ours, theirs, params = train_and_export(tmp_path, config(src, str(tmp_path / "ck"), lora, seq_len=24),
                                            dtypes=("fp32",))
    same_files(ours["fp32"], theirs["fp32"])
    from pstar_jax.io.hf import read_hf_config
    assert read_hf_config(ours["fp32"])["n_positions"] == 40
    wpe, source = read_all(ours["fp32"])["transformer.wpe.weight"], stored["transformer.wpe.weight"]
    assert wpe.shape == (40, 36)
    assert wpe[24:].tobytes() == source[24:].tobytes()  # the rows the run never used, as they were
    trained = params["wpe"] if not lora.enabled else source[:24]  # frozen under LoRA
    assert wpe[:24].tobytes() == np.ascontiguousarray(trained).tobytes()
    if not lora.enabled:
        assert not np.array_equal(wpe[:24], source[:24])


def test_pstar_export_help_loads_no_jax():
    code = ("import sys\nfrom pstar_jax.cli.export import main\n"
            "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
            "print(sorted(m for m in ('jax', 'flax', 'orbax', 'safetensors') if m in sys.modules))\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "--checkpoint-dir" in proc.stdout and proc.stdout.strip().endswith("[]"), proc.stdout[-500:]
