"""A LoRA run and peft adapters: --export-lora writes the trained adapters (peft loads them onto the
base with the merged model's logits), --export-hf writes the merged model, --init-from-lora
continues from an adapter with its settings, pstar-export writes both from a checkpoint, and the
misuses are one line.
"""

import dataclasses
import json
import shutil
import os

import numpy as np
import pytest

import pstar_jax as ps
from pstar_jax.config import ConfigError
from pstar_jax.config.lora import LoraConfig
from pstar_jax.model.lora import is_adapter
from pstar_jax.io.peft_io import ADAPTER_WEIGHTS, PROJECTIONS, lora_scale, merge_adapter, read_adapter
from pstar_models.llama import LlamaConfig, StagedLlama
from test_hf import read_all, write_family_checkpoint

BASE = StagedLlama(LlamaConfig(vocab_size=300, d_model=48, n_layer=2, n_head=6, n_kv_head=2, d_ff=80, seq_len=32,
                               max_position_embeddings=32))
LORA = LoraConfig(rank=4, alpha=8.0, targets="attn.q,attn.v,mlp.*")
TARGETS = ("attn.q", "attn.v", "mlp.gate", "mlp.up", "mlp.down")


def run_config(src, lora=LORA, steps=2, **model):
    return ps.RunConfig(model=ps.ModelConfig(init_from_hf=src, **model), lora=lora,
                        train=ps.TrainConfig(batch_size=8, steps=steps), optim=ps.OptimConfig(lr=1e-2),
                        engine=ps.EngineConfig(precision="fp32", chunk_numel=16384),
                        output=ps.OutputConfig(quiet=True))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A base checkpoint, and a LoRA run of 2 steps on it exported both ways: (dirs, fp32 params)."""
    root = tmp_path_factory.mktemp("lora_io")
    dirs = {k: str(root / k) for k in ("src", "adapter", "merged")}
    write_family_checkpoint(dirs["src"], BASE)
    with ps.Run(run_config(dirs["src"])) as run:
        for _ in run.fit():
            pass
        params = run.engine.params()
        assert run.export_lora(dirs["adapter"]) == ["adapter_config.json", ADAPTER_WEIGHTS]
        run.export_hf(dirs["merged"], "fp32")
    return dirs, params


def test_export_lora_holds_the_trained_adapters_and_export_hf_the_merged_kernels(trained):
    dirs, params = trained
    spec, tensors = read_adapter(dirs["adapter"], "llama", BASE.param_shapes())
    assert spec == dict(rank=4, alpha=8.0, dropout=0.0, rslora=False, targets=TARGETS)
    adapters = {n: v for n, v in params.items() if is_adapter(n)}
    assert tensors.keys() == adapters.keys() and len(adapters) == 2 * 2 * len(TARGETS)
    for name, value in adapters.items():
        assert tensors[name].tobytes() == np.ascontiguousarray(value).tobytes(), name
    assert any(np.abs(v).max() > 0 for n, v in adapters.items() if n.endswith("lora_b"))  # it trained

    from pstar_models.hf import hf_tensors
    merged = read_all(dirs["merged"])
    scale = lora_scale(8.0, 4)
    for name, (hf_name, transpose, _) in hf_tensors(BASE).items():
        expected = params[name]
        module = name.removesuffix(".kernel")
        if module + ".lora.lora_a" in params:
            expected = merge_adapter(expected, params[module + ".lora.lora_a"], params[module + ".lora.lora_b"], scale)
        value = merged[hf_name].T if transpose else merged[hf_name]
        np.testing.assert_array_equal(value, expected, err_msg=name)


@pytest.mark.hf_reference
def test_peft_loads_the_exported_adapter_with_the_merged_export_logits(trained):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    dirs, _ = trained
    load = dict(attn_implementation="eager", dtype=torch.float32)
    base = transformers.AutoModelForCausalLM.from_pretrained(dirs["src"], **load)
    with_adapter = peft.PeftModel.from_pretrained(base, dirs["adapter"]).eval()  # a missing key warns: an error
    result = with_adapter.load_adapter(dirs["adapter"], adapter_name="again")
    assert not result.missing_keys and not result.unexpected_keys, result
    with_adapter.set_adapter("default")
    merged = transformers.AutoModelForCausalLM.from_pretrained(dirs["merged"], **load).eval()
    tokens = torch.from_numpy(np.random.default_rng(0).integers(0, 300, (2, 32))).long()
    with torch.no_grad():
        theirs, ours = with_adapter(tokens).logits.numpy(), merged(tokens).logits.numpy()
    scale = float(np.abs(theirs).max())
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=64 * float(np.finfo(np.float32).eps) * scale)


@pytest.mark.slow
def test_init_from_lora_continues_with_the_adapters_settings_and_tensors(trained):
    dirs, params = trained
    config = run_config(dirs["src"], lora=LoraConfig(), init_from_lora=dirs["adapter"])
    with ps.Run(config) as run:
        assert run.config.lora == LoraConfig(rank=4, alpha=8.0, targets=",".join(TARGETS))
        start = run.engine.params()
    assert start.keys() == params.keys()
    for name, value in start.items():
        expected = params[name] if is_adapter(name) else np.asarray(BASE.init_tensor(name, 7), np.float32)
        np.testing.assert_array_equal(value, expected, err_msg=name)

    with ps.Run(run_config(dirs["src"], init_from_lora=dirs["adapter"])):  # the same settings, given: accepted
        pass
    # the adapter's settings are the defaults: a dropout alone, or its rank alone with the default targets
    for lora, dropout in [(LoraConfig(dropout=0.1), 0.1), (LoraConfig(rank=4), 0.0), (LoraConfig(alpha=8.0), 0.0)]:
        with ps.Run(run_config(dirs["src"], lora=lora, init_from_lora=dirs["adapter"])) as run:
            assert run.config.lora == LoraConfig(rank=4, alpha=8.0, targets=",".join(TARGETS), dropout=dropout)
    for lora, words in [(dataclasses.replace(LORA, rank=8), "was trained with LoRA rank 4, LoraConfig.rank is 8"),
                        (dataclasses.replace(LORA, targets="attn.*"), "LoRA targets"),
                        (dataclasses.replace(LORA, rslora=True), "LoRA rslora")]:
        with pytest.raises(ConfigError) as err:
            ps.Run(run_config(dirs["src"], lora=lora, init_from_lora=dirs["adapter"]))
        assert words in str(err.value) and "\n" not in str(err.value)


def test_init_from_lora_trains_with_the_adapters_dropout_unless_told(tmp_path, trained):
    dirs, _ = trained
    adapter = tmp_path / "adapter"
    shutil.copytree(dirs["adapter"], adapter)
    config_file = adapter / "adapter_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "lora_dropout": 0.05}))
    with ps.Run(run_config(dirs["src"], lora=LoraConfig(), init_from_lora=str(adapter))) as run:
        assert run.config.lora.dropout == 0.05
    with ps.Run(run_config(dirs["src"], lora=LoraConfig(dropout=0.2), init_from_lora=str(adapter))) as run:
        assert run.config.lora.dropout == 0.2


def test_lora_exports_from_the_cli_and_pstar_export(tmp_path, trained, capsys):
    from pstar_jax.cli.export import main as export_main
    from pstar_jax.cli.train import main as train_main
    dirs, _ = trained
    ck, adapter, again, merged = (str(tmp_path / k) for k in ("ck", "adapter", "again", "merged"))
    flags = ["--quiet", "--init-from-hf", dirs["src"], "--precision", "fp32", "--batch-size", "8", "--steps", "2",
             "--lr", "1e-2", "--chunk-size", "16384", "--lora-rank", "4", "--lora-alpha", "8",
             "--lora-targets", "attn.q,attn.v,mlp.*"]
    assert train_main([*flags, "--checkpoint-dir", ck, "--export-lora", adapter]) == 0
    assert "exported the LoRA adapter to" in capsys.readouterr().out
    assert export_main(["--checkpoint-dir", ck, "--lora", again, "--hf", merged, "--export-dtype", "fp32"]) == 0
    for name in os.listdir(adapter):  # the run's export and the checkpoint's are the same files
        assert open(os.path.join(adapter, name), "rb").read() == open(os.path.join(again, name), "rb").read()
    assert read_all(merged).keys() == read_all(dirs["merged"]).keys()
    capsys.readouterr()

    for argv, words in [
        ([*flags[:-6], "--export-lora", str(tmp_path / "x")], "--export-lora needs a LoRA run"),
        ([*flags, "--export-lora", dirs["src"]], "not an earlier pstar_jax adapter export"),
        (["--quiet", "--init-from-lora", adapter, "--lora-rank", "4"], "--init-from-lora needs --init-from-hf"),
    ]:
        assert train_main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith("pstar-train: error:") and err.count("\n") == 1 and words in err, err
    assert export_main(["--checkpoint-dir", ck]) == 2
    assert "pass --hf OUT" in capsys.readouterr().err


def test_a_gpt2_position_table_cut_short_is_not_exported_as_an_adapter(tmp_path):
    import json

    from hf_configs import V4
    from pstar_jax.io.lora_io import export_lora
    from pstar_models.hf import build_from_hf
    from pstar_models.lora import LoraSpec
    (tmp_path / "config.json").write_text(json.dumps(V4["gpt2"]))  # 40 positions
    model = build_from_hf(V4["gpt2"], seq_len=24, lora=LoraSpec(rank=2, alpha=4.0))
    config = ps.RunConfig(model=ps.ModelConfig(init_from_hf=str(tmp_path)),
                          lora=LoraConfig(rank=2, alpha=4.0, modules_to_save="wpe"))
    params = {n: np.zeros(s, np.float32) for n, s in model.param_shapes().items()}
    with pytest.raises(ConfigError) as err:
        export_lora(str(tmp_path / "out"), config, model, lambda: iter(params.items()))
    assert "trained wpe in full with 24 positions, the base has 40" in str(err.value)
    assert not os.path.exists(tmp_path / "out")


def test_pstar_export_lora_of_a_full_run_names_its_own_flag_for_the_whole_model(tmp_path, capsys):
    from pathlib import Path
    from pstar_jax.cli.export import main as export_main
    full = Path(__file__).parent / "fixtures" / "pre_layout" / "full"  # a checkpoint of a run without LoRA
    assert export_main(["--checkpoint-dir", str(full), "--lora", str(tmp_path / "adapter")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("export the whole model with --hf") and "--export-hf" not in err and "\n" not in err, err
    assert not (tmp_path / "adapter").exists()
