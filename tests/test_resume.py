"""A resume that lacks its checkpoint's base, reads other data, or meets a damaged data position is
one line naming the checkpoint and what to pass (pstar_jax/run/resume.py)."""

import json

import pytest

from pstar_jax.config import (CheckpointConfig, CheckpointError, ConfigError, DataConfig, LoraConfig, ModelConfig,
                              RunConfig)
from pstar_jax.run.resume import check_same_data, check_sources, data_position

LORA_RUN = RunConfig(model=ModelConfig(init_from_hf="base"), lora=LoraConfig(rank=4))
RESUME = CheckpointConfig(directory="ck", resume=True)


def test_a_resume_without_the_base_names_the_recorded_base_and_the_rank():
    """The base record's absolute path wins over the path as the first run was given it."""
    with pytest.raises(CheckpointError) as err:
        check_sources(LORA_RUN, RunConfig(checkpoint=RESUME), {"base": {"source": "hf", "path": "/abs/base"}}, "/ck")
    assert str(err.value) == ("the checkpoint in /ck was trained from ModelConfig.init_from_hf /abs/base, which this "
                              "run does not give; resume with ModelConfig.init_from_hf /abs/base LoraConfig.rank 4 "
                              "(and the first run's other settings)")
    with pytest.raises(CheckpointError, match="resume with ModelConfig.init_from_hf base \\("):
        check_sources(RunConfig(model=ModelConfig(init_from_hf="base")), RunConfig(checkpoint=RESUME), {}, "/ck")
    check_sources(LORA_RUN, LORA_RUN, {}, "/ck")  # given: the base and adapters are compared later


def test_a_resume_on_other_data_is_refused_unless_allowed(tmp_path):
    a, b = tmp_path / "a.u16.bin", tmp_path / "b.u16.bin"
    a.write_bytes(b"\0\0")
    b.write_bytes(b"\0\0")
    saved = RunConfig(data=DataConfig(path=str(a)))
    with pytest.raises(ConfigError) as err:
        check_same_data(saved, RunConfig(data=DataConfig(path=str(b)), checkpoint=RESUME), "/ck")
    assert f"trained on DataConfig.path {a}, this run reads DataConfig.path {b};" in str(err.value)
    with pytest.raises(ConfigError, match="this run reads the built-in corpus"):
        check_same_data(saved, RunConfig(checkpoint=RESUME), "/ck")
    check_same_data(saved, RunConfig(data=DataConfig(path=str(tmp_path / "." / "a.u16.bin"))), "/ck")  # the same file
    allowed = CheckpointConfig(directory="ck", resume=True, allow_changes=True)
    check_same_data(saved, RunConfig(data=DataConfig(path=str(b)), checkpoint=allowed), "/ck")


@pytest.mark.parametrize("position", [-1, 2.5, None, True])
def test_a_data_position_no_run_writes_names_the_checkpoint_step(position):
    with pytest.raises(CheckpointError, match=r"^checkpoint step 3 in /ck records the data position .*; remove "
                                              r"/ck/3 to fall back to an earlier one$"):
        data_position({"step": 3, "data_position": position}, "/ck")
    assert data_position({"step": 3, "data_position": 7}, "/ck") == 7


@pytest.mark.slow  # a LoRA run on an HF base, and an engine built for the damaged resume: 15-40 s on 2 cores
def test_pstar_train_resumes_refuse_in_one_line(tmp_path, capsys):
    """A LoRA run on a Hugging Face base, checkpointed, then resumed: without --init-from-hf (and
    --lora-rank), on another --data, and from a step whose data position is damaged."""
    from pstar_models.llama import LlamaConfig, StagedLlama
    from pstar_jax.cli.train import main
    from test_hf import write_family_checkpoint
    src, ck = str(tmp_path / "src"), tmp_path / "ck"
    write_family_checkpoint(src, StagedLlama(LlamaConfig(vocab_size=300, d_model=48, n_layer=2, n_head=6, n_kv_head=2,
                                                         d_ff=80, seq_len=32, max_position_embeddings=32)))
    flags = ["--init-from-hf", src, "--lora-rank", "4", "--batch-size", "8", "--quiet", "--checkpoint-dir", str(ck)]
    assert main([*flags, "--steps", "4", "--stop-after", "2"]) == 0
    capsys.readouterr()

    def refused(argv):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("pstar-train: error:") and err.count("\n") == 1, err
        return err
    err = refused(["--steps", "4", "--quiet", "--resume", "--checkpoint-dir", str(ck)])
    assert f"was trained from --init-from-hf {src}, which this run does not give; resume with --init-from-hf {src} " \
           "--lora-rank 4" in err
    other = tmp_path / "other.u16.bin"
    other.write_bytes(bytes(range(200)) * 4)
    err = refused([*flags, "--steps", "4", "--resume", "--data", str(other)])
    assert f"trained on the built-in corpus (no --data), this run reads --data {other}; " in err
    assert "--allow-config-change" in err
    meta = ck / "2" / "meta" / "metadata"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "data_position": -4}))
    err = refused([*flags, "--steps", "4", "--resume"])
    assert f"checkpoint step 2 in {ck} records the data position -4" in err
