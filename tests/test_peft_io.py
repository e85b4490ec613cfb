"""peft LoRA adapters: what write_adapter writes, peft loads onto the base checkpoint with no missing
or unexpected keys and our merged model's logits; adapters peft saved read back into our names; a
write -> read round trip is exact; every bad adapter is refused in one line.

The comparisons with peft need torch, transformers and peft (test extras); the rest run without them.
"""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from hf_configs import V4
from pstar_jax.config import ConfigError
from pstar_jax.io.hf import HFCheckpoint, read_hf_config
from pstar_jax.io.peft_io import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, PROJECTIONS, AdapterError, from_peft, lora_scale,
                               merge_adapter, merged_stream, merged_tensors, model_family, projection_of, read_adapter,
                               to_peft, write_adapter)
from pstar_models import build_from_hf, hf_tensors
from test_hf_models import CHECKPOINTS, SEQ_LEN, hf_logits, hf_reference, module_of, tokens_BxL
from test_moe import MIXTRAL, QWEN3_MOE

EPS32 = float(np.finfo(np.float32).eps)
# family, HF config, LoRA settings: all projections or some (GPT-2's attention c_proj alone, which
# a short name would confuse with the MLP's), rsLoRA, modules trained in full (a tied embedding too).
CASES = {
    "llama": ("llama", CHECKPOINTS["llama3"], dict(rank=4, alpha=8.0, rslora=False, targets=PROJECTIONS["llama"]), ()),
    "qwen2_tied_embed": ("qwen2", CHECKPOINTS["qwen2_tied"],
                         dict(rank=3, alpha=5.0, rslora=True, targets=("attn.q", "attn.v", "mlp.down")), ("embed",)),
    "mistral_head": ("mistral", CHECKPOINTS["mistral"], dict(rank=8, alpha=16.0, rslora=False, targets=("attn.*",)),
                     ("head", "norm")),
    # Qwen3: every projection, and its q/k norms trained in full in both blocks.
    "qwen3_norms": ("qwen3", CHECKPOINTS["qwen3_tied"], dict(rank=4, alpha=8.0, rslora=False,
                                                             targets=PROJECTIONS["qwen3"]),
                    tuple(f"blocks.{i}.attn.{x}_norm" for i in range(2) for x in "qk")),
    "qwen3_untied_head": ("qwen3", CHECKPOINTS["qwen3_untied"], dict(rank=2, alpha=3.0, rslora=True,
                                                                     targets=("mlp.*", "attn.o")), ("head",)),
    # Mixtures of experts: every projection, each expert's three matrices included (the router stays
    # frozen); Mixtral's experts' gate and up (w1, w3) beside attention's o.
    "qwen3_moe": ("qwen3_moe", QWEN3_MOE, dict(rank=4, alpha=8.0, rslora=False, targets=PROJECTIONS["qwen3_moe"]),
                  ()),
    "mixtral_experts": ("mixtral", MIXTRAL, dict(rank=2, alpha=4.0, rslora=False,
                                                 targets=("attn.o", "mlp.experts.*.gate", "mlp.experts.*.up")), ()),
    # Qwen3-MoE with a dense layer 0 (mlp_only_layers): attention adapted, the MLPs frozen (adapters
    # on its experts are refused at export: peft's names cannot leave the dense layer's out).
    "qwen3_moe_dense_layer": ("qwen3_moe", {**QWEN3_MOE, "mlp_only_layers": [0]},
                              dict(rank=2, alpha=4.0, rslora=False, targets=("attn.*",)), ()),
    "mixtral_head": ("mixtral", MIXTRAL, dict(rank=2, alpha=4.0, rslora=True, targets=("attn.q", "attn.v")),
                     ("head",)),
    "gpt2": ("gpt2", CHECKPOINTS["gpt2"], dict(rank=4, alpha=4.0, rslora=False,
                                               targets=("attn.qkv", "attn.proj", "mlp.fc")), ()),
    "gpt2_all": ("gpt2", CHECKPOINTS["gpt2_untied"], dict(rank=2, alpha=6.0, rslora=False,
                                                          targets=PROJECTIONS["gpt2"]), ("wte", "head")),
}


def random_adapters(param_shapes, family, rank, targets, seed=0):
    """Our adapter tensors for every block and every projection ``targets`` names, lora_b nonzero."""
    import fnmatch
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in param_shapes.items():
        module = name.removesuffix(".kernel")
        path = module.split(".", 2)[-1]
        if name.startswith("blocks.") and name.endswith(".kernel") and projection_of(path) in PROJECTIONS[family] and \
                any(fnmatch.fnmatchcase(path, t) for t in targets):
            d_in, d_out = shape
            out[module + ".lora.lora_a"] = (rng.uniform(-1, 1, (d_in, rank)) / np.sqrt(d_in)).astype(np.float32)
            out[module + ".lora.lora_b"] = 0.3 * rng.standard_normal((rank, d_out)).astype(np.float32)
    return out


def saved_in_full(params, modules, seed=1):
    """The base tensors under ``modules``, perturbed as full training would change them."""
    rng = np.random.default_rng(seed)
    return {n: v + 0.05 * rng.standard_normal(v.shape).astype(np.float32) for n, v in params.items()
            if any(n == m or n.startswith(m + ".") for m in modules)}


def shapes_of(family_config, seq_len=SEQ_LEN):
    return build_from_hf(family_config, seq_len=seq_len).param_shapes()


def one_line(err):
    message = str(err.value)
    assert "\n" not in message and isinstance(err.value, ConfigError), message
    return message


def assert_logits_close(ours, theirs):
    """Equal up to fp32 rounding at the logits' scale (different summation orders on both sides)."""
    scale = float(np.abs(theirs).max())
    assert scale > 0.5, "random weights should give logits well away from zero"
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=64 * EPS32 * scale)


def base_checkpoint(tmp_path, config):
    """A transformers model with random weights saved as fp32 safetensors, and our import of it."""
    hf_model = hf_reference(config)
    directory = str(tmp_path / "base")
    hf_model.save_pretrained(directory, safe_serialization=True)
    model = build_from_hf(read_hf_config(directory), seq_len=SEQ_LEN)
    with HFCheckpoint(directory, hf_tensors(model), model.param_shapes()) as ckpt:
        params = {n: np.array(ckpt[n]) for n in ckpt}
    return directory, model, params


def load_peft(base_dir, adapter_dir):
    """peft's model for the adapter, and the load result of loading it a second time: peft warns
    (an error here) about missing adapter keys in the first load; the second returns them all."""
    import torch
    import transformers
    from peft import PeftModel
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, attn_implementation="eager",
                                                             dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, adapter_dir)
    result = peft_model.load_adapter(adapter_dir, adapter_name="again")
    peft_model.set_adapter("default")
    return peft_model.eval(), result


@pytest.mark.hf_reference
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_peft_loads_our_adapter_with_our_merged_logits(tmp_path, case):
    pytest.importorskip("peft")
    family, config, lora, modules = case
    base_dir, model, params = base_checkpoint(tmp_path, config)
    adapters = random_adapters(model.param_shapes(), family, lora["rank"], lora["targets"])
    full = saved_in_full(params, modules)
    out = str(tmp_path / "adapter")
    import transformers
    if int(transformers.__version__.split(".")[0]) >= 5 and any(".experts." in n for n in adapters):
        pytest.skip("peft 0.21 over transformers 5.x fuses the experts and drops per-expert adapters with a warning "
                    "('rank_pattern keys did not match any targeted module'); transformers 4.x loads them")
    files = write_adapter(out, {**adapters, **full}, dropout=0.05, family=family, base_model_name_or_path=base_dir,
                          modules_to_save=modules, tie_embeddings=model.config.tie_embeddings, **lora)
    assert files == [ADAPTER_CONFIG, ADAPTER_WEIGHTS]

    peft_model, result = load_peft(base_dir, out)
    # transformers 5.x: peft 0.21 finds no tied modules in a from_pretrained model, so the head's
    # copy that peft itself writes beside a saved tied embedding (and loads cleanly on 4.x) is
    # reported unexpected there, for peft's own adapters as well; the logits below still check that
    # the saved embedding serves as the head.
    v5_tied = model.config.tie_embeddings and "embed" in modules and int(transformers.__version__.split(".")[0]) >= 5
    ignored = {"base_model.model.lm_head.weight"} if v5_tied else set()
    assert not result.missing_keys and set(result.unexpected_keys) == ignored, result
    written = load_file(os.path.join(out, ADAPTER_WEIGHTS))
    state = peft_model.state_dict()
    for key in set(written) - ignored:  # every tensor written landed in a module of the peft model
        module, tensor = key.rsplit(".", 1)
        loaded = f"{module}.default.{tensor}" if ".lora_" in key else f"{module}.modules_to_save.default.{tensor}"
        assert loaded in state, key
        np.testing.assert_array_equal(state[loaded].numpy(), written[key])
    peft_config = peft_model.peft_config["default"]
    assert (peft_config.r, peft_config.lora_alpha, peft_config.use_rslora) == (lora["rank"], lora["alpha"],
                                                                               lora["rslora"])

    scale = lora_scale(lora["alpha"], lora["rank"], lora["rslora"])
    merged = dict(merged_tensors({**params, **full}.items(), adapters, scale))
    assert set(merged) == set(params)
    tokens = tokens_BxL(model.config.vocab_size)
    ours = np.asarray(module_of(model, {n: jnp.asarray(v) for n, v in merged.items()})(jnp.asarray(tokens)))
    theirs = hf_logits(peft_model, tokens)
    assert_logits_close(ours, theirs)
    base = np.asarray(module_of(model, {n: jnp.asarray(v) for n, v in params.items()})(jnp.asarray(tokens)))
    assert np.abs(base - theirs).max() > 1e3 * 64 * EPS32 * np.abs(theirs).max()  # the adapter matters


@pytest.mark.hf_reference
@pytest.mark.parametrize("family", ["llama", "qwen3", "gpt2"])
def test_an_adapter_peft_saved_reads_into_our_names(tmp_path, family):
    """get_peft_model + save_pretrained: read_adapter gives peft's tensors under our names, and our
    merged model gives the peft model's logits."""
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    config = CHECKPOINTS[{"llama": "llama3", "qwen3": "qwen3_untied", "gpt2": "gpt2"}[family]]
    base_dir, model, params = base_checkpoint(tmp_path, config)
    import transformers
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, attn_implementation="eager",
                                                             dtype=torch.float32)
    targets = {"llama": ["q_proj", "v_proj", "down_proj"], "gpt2": ["c_attn", "mlp.c_proj"],
               "qwen3": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}[family]
    lora_config = peft.LoraConfig(r=4, lora_alpha=12, target_modules=targets, task_type="CAUSAL_LM",
                                  fan_in_fan_out=family == "gpt2", use_rslora=family != "gpt2")
    peft_model = peft.get_peft_model(base, lora_config)
    torch.manual_seed(2)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.3)  # peft starts B at zero: the adapter would change nothing
    out = str(tmp_path / "peft")
    peft_model.save_pretrained(out)

    spec, tensors = read_adapter(out, family, model.param_shapes())
    expected_targets = {"llama": ("attn.q", "attn.v", "mlp.down"), "gpt2": ("attn.qkv", "mlp.proj"),
                        "qwen3": PROJECTIONS["qwen3"]}[family]
    assert spec == dict(rank=4, alpha=12.0, dropout=0.0, rslora=family != "gpt2", targets=expected_targets)
    saved = load_file(os.path.join(out, ADAPTER_WEIGHTS))
    assert len(tensors) == len(saved) == 2 * model.config.n_layer * len(expected_targets)
    assert to_peft(tensors, family).keys() == saved.keys()
    for key, value in to_peft(tensors, family).items():
        np.testing.assert_array_equal(value, saved[key])

    scale = lora_scale(spec["alpha"], spec["rank"], spec["rslora"])
    merged = dict(merged_tensors(params.items(), tensors, scale))
    tokens = tokens_BxL(model.config.vocab_size)
    ours = np.asarray(module_of(model, {n: jnp.asarray(v) for n, v in merged.items()})(jnp.asarray(tokens)))
    assert_logits_close(ours, hf_logits(peft_model.eval(), tokens))


# -- without torch ----------------------------------------------------------------------------------------


def write_tiny(tmp_path, family="llama", name="adapter", **overrides):
    """A valid adapter for the tiny V4 model of ``family``: (directory, param shapes, our tensors)."""
    shapes = shapes_of(V4[family])
    lora = {**dict(rank=4, alpha=8.0, dropout=0.0, rslora=False, targets=("attn.q", "mlp.up")), **overrides}
    tensors = random_adapters(shapes, family, lora["rank"], lora["targets"])
    out = str(tmp_path / name)
    write_adapter(out, tensors, family=family, base_model_name_or_path="tiny", **lora)
    return out, shapes, tensors


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "qwen3", "gpt2"])
def test_write_then_read_is_exact(tmp_path, family):
    out, shapes, tensors = write_tiny(tmp_path, family, targets=PROJECTIONS[family], rslora=True)
    spec, back = read_adapter(out, family, shapes)
    assert spec == dict(rank=4, alpha=8.0, dropout=0.0, rslora=True, targets=PROJECTIONS[family])
    assert back.keys() == tensors.keys()
    for name, value in tensors.items():
        assert value.dtype == back[name].dtype == np.float32 and back[name].tobytes() == value.tobytes(), name
    config = json.load(open(os.path.join(out, ADAPTER_CONFIG)))
    assert config["peft_type"] == "LORA" and config["task_type"] == "CAUSAL_LM" and config["bias"] == "none"
    assert config["fan_in_fan_out"] == (family == "gpt2") and config["base_model_name_or_path"] == "tiny"
    assert config["target_modules"] == (["c_attn", "c_fc", "c_proj"] if family == "gpt2" else
                                        sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                "down_proj"]))


def test_bf16_adapter_and_modules_to_save_round_trip(tmp_path):
    shapes = shapes_of(V4["llama"])
    tensors = random_adapters(shapes, "llama", 4, ("attn.o",))
    full = {"head.kernel": np.random.default_rng(3).standard_normal(shapes["head.kernel"]).astype(np.float32)}
    out = str(tmp_path / "a")
    write_adapter(out, {**tensors, **full}, rank=4, alpha=8.0, dropout=0.0, rslora=False, targets=("attn.o",),
                  family="llama", base_model_name_or_path=None, modules_to_save=("head",), dtype="bf16")
    config = json.load(open(os.path.join(out, ADAPTER_CONFIG)))
    assert config["modules_to_save"] == ["lm_head"] and config["target_modules"] == ["o_proj"]
    assert load_file(os.path.join(out, ADAPTER_WEIGHTS))["base_model.model.lm_head.weight"].shape == (101, 48)
    _, back = read_adapter(out, "llama", shapes)
    import ml_dtypes
    for name, value in {**tensors, **full}.items():
        np.testing.assert_array_equal(back[name], value.astype(ml_dtypes.bfloat16).astype(np.float32))


def test_merge_adapter_and_merged_tensors():
    rng = np.random.default_rng(0)
    kernel = rng.standard_normal((6, 5)).astype(np.float32)
    a, b = rng.standard_normal((6, 2)).astype(np.float32), rng.standard_normal((2, 5)).astype(np.float32)
    merged = merge_adapter(kernel.astype(np.float16), a, b, 0.5)
    expected = kernel.astype(np.float16).astype(np.float64) + 0.5 * (a.astype(np.float64) @ b)
    assert merged.dtype == np.float32
    np.testing.assert_allclose(merged, expected, rtol=0, atol=16 * EPS32 * np.abs(expected).max())
    with pytest.raises(ConfigError) as err:
        merge_adapter(kernel, a, b.T, 1.0)
    assert "does not fit a kernel" in one_line(err)
    stream = [("blocks.0.attn.q.kernel", kernel), ("blocks.0.attn.q.lora.lora_a", a),
              ("blocks.0.attn.k.kernel", kernel)]
    adapters = {"blocks.0.attn.q.lora.lora_a": a, "blocks.0.attn.q.lora.lora_b": b}
    out = dict(merged_tensors(stream, adapters, 0.5))
    assert list(out) == ["blocks.0.attn.q.kernel", "blocks.0.attn.k.kernel"]
    np.testing.assert_array_equal(out["blocks.0.attn.q.kernel"], merge_adapter(kernel, a, b, 0.5))
    assert out["blocks.0.attn.k.kernel"] is kernel
    with pytest.raises(ConfigError) as err:
        list(merged_tensors(stream[1:], adapters, 0.5))
    assert "has no blocks.0.attn.q.kernel to merge into" in one_line(err)
    full = stream + [("blocks.0.attn.q.lora.lora_b", b)]
    again = dict(merged_stream(lambda: iter(full), 0.5))
    assert again.keys() == out.keys() and all(np.array_equal(again[n], out[n]) for n in out)


def test_model_family():
    for family in ("llama", "qwen2", "mistral", "qwen3", "gpt2"):
        assert model_family(build_from_hf(V4[family], seq_len=SEQ_LEN)) == family
    with pytest.raises(ConfigError) as err:
        model_family(object())
    assert "configured by NoneType" in one_line(err)


def test_an_export_replaces_only_an_earlier_export(tmp_path):
    out, shapes, tensors = write_tiny(tmp_path)
    write_tiny(tmp_path, rank=2)  # an earlier export is replaced
    assert read_adapter(out, "llama", shapes)[0]["rank"] == 2
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # no staging or old directory left
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError) as err:
        write_tiny(tmp_path, name="other")
    assert "not an earlier pstar_jax adapter export" in one_line(err)
    assert os.listdir(other) == ["notes.txt"]


def test_a_failed_write_leaves_the_target_as_it_was(tmp_path, monkeypatch):
    out, shapes, tensors = write_tiny(tmp_path)
    before = {n: open(os.path.join(out, n), "rb").read() for n in os.listdir(out)}

    def disk_full(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr("pstar_jax.io.peft_io.save_file", disk_full)
    with pytest.raises(ConfigError) as err:
        write_tiny(tmp_path, rank=2)
    assert "the disk is full" in one_line(err)
    assert {n: open(os.path.join(out, n), "rb").read() for n in os.listdir(out)} == before
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]


def test_bad_exports_are_one_line(tmp_path):
    shapes = shapes_of(V4["llama"])
    good = random_adapters(shapes, "llama", 4, ("attn.q",))
    kwargs = dict(rank=4, alpha=8.0, dropout=0.0, rslora=False, targets=("attn.q",), family="llama",
                  base_model_name_or_path=None)
    a, b = "blocks.0.attn.q.lora.lora_a", "blocks.0.attn.q.lora.lora_b"
    nan = {**good, a: np.full_like(good[a], np.nan)}
    for tensors, changes, words in [
        ({k: v for k, v in good.items() if k != b}, {}, "needs both halves"),
        (good, dict(rank=3), "not rank 3"),
        (good, dict(targets=("attn.*",)), "pass the targets the adapters were trained with"),
        ({k: v for k, v in good.items() if not k.startswith("blocks.0.")}, {}, "the same blocks 0..N-1"),
        ({**good, "norm.scale": np.ones(48, np.float32)}, {}, "neither an adapter nor under modules_to_save"),
        ({**good, "blocks.0.attn_norm.lora.lora_a": good[a], "blocks.0.attn_norm.lora.lora_b": good[b]}, {},
         "not a projection LoRA can wrap"),
        (nan, {}, "NaN"),
        ({k: v * 1e6 for k, v in good.items()}, dict(dtype="fp16"), "overflows fp16"),
        (good, dict(family="bert"), "no peft adapters for model family"),
    ]:
        with pytest.raises(ConfigError) as err:
            write_adapter(str(tmp_path / "out"), tensors, **{**kwargs, **changes})
        assert words in one_line(err), (words, str(err.value))
    assert not os.path.exists(tmp_path / "out")


def edit_config(directory, **changes):
    path = os.path.join(directory, ADAPTER_CONFIG)
    config = json.load(open(path))
    config.update(changes)
    json.dump(config, open(path, "w"))


def edit_weights(directory, change):
    path = os.path.join(directory, ADAPTER_WEIGHTS)
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path)


Q0 = "base_model.model.model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize("damage, words", [
    (lambda d: os.remove(os.path.join(d, ADAPTER_CONFIG)), "holds no adapter_config.json"),
    (lambda d: os.remove(os.path.join(d, ADAPTER_WEIGHTS)), "holds no adapter_model.safetensors"),
    (lambda d: open(os.path.join(d, ADAPTER_CONFIG), "w").write("{r: 4"), "is not readable JSON"),
    (lambda d: open(os.path.join(d, ADAPTER_WEIGHTS), "wb").write(b"\0" * 4), "not a readable safetensors file"),
    (lambda d: edit_config(d, peft_type="PREFIX_TUNING"), "only peft LoRA adapters"),
    (lambda d: edit_config(d, task_type="SEQ_CLS"), "only CAUSAL_LM adapters"),
    (lambda d: edit_config(d, use_dora=True), "asks for DoRA (use_dora)"),
    (lambda d: edit_config(d, bias="lora_only"), "asks for trained biases"),
    (lambda d: edit_config(d, rank_pattern={"q_proj": 8}), "a rank per module (rank_pattern)"),
    (lambda d: edit_config(d, alpha_pattern={"q_proj": 8}), "an alpha per module (alpha_pattern)"),
    (lambda d: edit_config(d, layers_to_transform=[0]), "LoRA on some layers only"),
    (lambda d: edit_config(d, r=0), "r is 0"),
    (lambda d: edit_config(d, lora_dropout=1.5), "lora_dropout is 1.5"),
    (lambda d: edit_config(d, lora_alpha=-8), "lora_alpha is -8; it must be a positive number"),
    (lambda d: edit_config(d, target_modules=["q_proj", "wq"]), "targets 'wq', which is not a projection"),
    (lambda d: edit_config(d, target_modules=["q_proj"]), "which adapter_config.json's target_modules does not name"),
    (lambda d: edit_config(d, target_modules=["q_proj", "up_proj", "k_proj"]), "lacks the adapter of"),
    (lambda d: edit_config(d, r=8), "rank 8 need (8, 48)"),
    (lambda d: edit_weights(d, lambda t: t.update({Q0 + ".lora_C.weight": t[Q0 + ".lora_A.weight"]})),
     "names no projection or parameter"),
    (lambda d: edit_weights(d, lambda t: t.pop(Q0 + ".lora_B.weight")), "lacks the adapter of"),
    (lambda d: edit_weights(d, lambda t: t[Q0 + ".lora_A.weight"].__setitem__((0, 0), np.inf)),
     "NaN or infinite values"),
    (lambda d: edit_weights(d, lambda t: t.update({Q0 + ".lora_A.weight": t[Q0 + ".lora_A.weight"].astype(np.int32)})),
     "only BF16, F16 and F32"),
])
def test_bad_adapters_are_one_line(tmp_path, damage, words):
    out, shapes, _ = write_tiny(tmp_path)
    damage(out)
    with pytest.raises(AdapterError) as err:
        read_adapter(out, "llama", shapes)
    assert words in one_line(err)


def test_an_adapter_of_another_model_is_one_line(tmp_path):
    out, _, _ = write_tiny(tmp_path)
    wider = shapes_of({**V4["llama"], "hidden_size": 96, "head_dim": 16})
    with pytest.raises(AdapterError) as err:
        read_adapter(out, "llama", wider)
    assert "has shape (4, 48), this model and rank 4 need (4, 96)" in one_line(err)
    with pytest.raises(AdapterError) as err:
        read_adapter(out, "gpt2", shapes_of(V4["gpt2"]))
    assert "is not a projection of this gpt2 model" in one_line(err)
    with pytest.raises(AdapterError) as err:
        read_adapter(str(tmp_path / "none"), "llama", wider)
    assert "is not a directory" in one_line(err)


def test_from_peft_refuses_a_base_tensor_of_another_shape():
    shapes = shapes_of(V4["llama"])
    with pytest.raises(AdapterError) as err:
        from_peft({"base_model.model.lm_head.weight": np.zeros((3, 48), np.float32)}, "llama", shapes, 4)
    assert "need (101, 48)" in one_line(err)


def test_expert_adapters_of_a_moe_with_dense_layers_are_refused_at_export(tmp_path):
    """Qwen3-MoE with a dense layer 0: the experts' adapters cover layer 1 only, which peft's short
    module names (gate_proj: the dense MLP's too) cannot say; one line, nothing written."""
    shapes = shapes_of({**QWEN3_MOE, "mlp_only_layers": [0]})
    targets = ("attn.*", "mlp.experts.*")
    tensors = random_adapters(shapes, "qwen3_moe", 2, targets)
    with pytest.raises(ConfigError) as err:
        write_adapter(str(tmp_path / "out"), tensors, rank=2, alpha=4.0, dropout=0.0, rslora=False,
                      targets=targets, family="qwen3_moe", base_model_name_or_path=None)
    assert "dense layers" in one_line(err) and not (tmp_path / "out").exists()
