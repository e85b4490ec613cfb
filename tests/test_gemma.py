"""Gemma 3 (issue 32, part 3): gemma3_text checkpoints, and a multimodal gemma3 one's text tower, give
transformers' logits and loss for the same weights (fp32), packed rows keep to their examples
through the sliding window, both transformers versions' configs read alike, exports load in
transformers unchanged, ten fp32 training steps equal transformers + torch AdamW under chunk
eviction, LoRA matches peft on every projection, decoding through the KV cache equals the full
forward, and bad configs are one line."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pstar_models import build_from_hf, build_model, hf_config, hf_tensors
import test_hf_models as hf_models  # (a module: its test functions imported by name would be collected here too)
from test_hf_models import SEQ_LEN

# Odd sizes: head_dim 12 beside a width-32 model, GQA, a window of 5 under SEQ_LEN, an attention
# scale (query_pre_attn_scalar 10) that is not head_dim's, a local RoPE base of its own and linear
# scaling on the global layers, so that each of them changes the logits.
GEMMA = dict(model_type="gemma3_text", vocab_size=113, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, head_dim=12, query_pre_attn_scalar=10,
             rope_theta=1000000.0, rope_local_base_freq=100.0, rope_scaling=dict(rope_type="linear", factor=4.0),
             sliding_window=5, layer_types=["sliding_attention", "full_attention", "sliding_attention"],
             rms_norm_eps=1e-6, max_position_embeddings=64)
CHECKPOINTS = {
    "gemma3": GEMMA,
    # No layer_types: transformers' sliding_window_pattern (every 2nd layer global here).
    "gemma3_pattern": {**{k: v for k, v in GEMMA.items() if k != "layer_types"}, "sliding_window_pattern": 2},
    "gemma3_1b_like": {**GEMMA, "rope_scaling": None, "tie_word_embeddings": True},  # no scaling (as 1B)
    "gemma3_final_softcap": {**GEMMA, "final_logit_softcapping": 3.0},
}


@pytest.mark.hf_reference
@pytest.mark.parametrize("config", CHECKPOINTS.values(), ids=CHECKPOINTS.keys())
def test_gemma_checkpoints_give_transformers_logits_and_loss(config):
    hf_models.test_hf_weights_give_hf_logits(config)


@pytest.mark.hf_reference
def test_packed_rows_give_each_example_its_own_logits_through_the_sliding_window():
    """Two examples packed into one row (segment ids, positions restarting): each one's logits
    equal transformers' for that example alone, its window never reaching into the other."""
    from pstar_models.llama import llama_from_params
    hf_model = hf_models.hf_reference(GEMMA)
    model = build_from_hf(GEMMA, seq_len=SEQ_LEN)
    params = hf_models.to_pstar(model, hf_models.saved_state(hf_model))
    a, b = hf_models.tokens_BxL(113, 1, 13, seed=1), hf_models.tokens_BxL(113, 1, 11, seed=2)
    row = jnp.asarray(np.concatenate([a, b], axis=1))
    segments = jnp.asarray([[1] * 13 + [2] * 11])
    positions = jnp.asarray([list(range(13)) + list(range(11))])
    ours = np.asarray(llama_from_params(model.config, params)(row, segments, positions))
    hf_models.assert_logits_match(ours[:, :13], hf_models.hf_logits(hf_model, a))
    hf_models.assert_logits_match(ours[:, 13:], hf_models.hf_logits(hf_model, b))


@pytest.mark.hf_reference
@pytest.mark.parametrize("name", ["gemma3", "gemma3_final_softcap"])
def test_gemma_exports_load_in_transformers_with_the_same_logits(name, tmp_path):
    """Our config.json (following the source's) and weights load in transformers with our logits."""
    model = build_from_hf(CHECKPOINTS[name], seq_len=SEQ_LEN)
    hf_models.test_export_loads_in_transformers_with_the_same_logits(model.config, tmp_path, CHECKPOINTS[name])


# config.json as transformers 4.57.6's save_pretrained wrote it for a Gemma3ForCausalLM of GEMMA's sizes
# (copied from that file), and in 5.x's layout: RoPE under rope_parameters, one dict per layer type
# (written after 5.x's Gemma3TextConfig, not by it: 5.x is not installed here).
V4 = json.loads('''{"_sliding_window_pattern": 6, "architectures": ["Gemma3ForCausalLM"], "attention_bias": false,
  "attention_dropout": 0.0, "attn_logit_softcapping": null, "bos_token_id": 2, "dtype": "float32", "eos_token_id": 1,
  "final_logit_softcapping": null, "head_dim": 12, "hidden_activation": "gelu_pytorch_tanh", "hidden_size": 32,
  "initializer_range": 0.02, "intermediate_size": 48,
  "layer_types": ["sliding_attention", "full_attention", "sliding_attention"], "max_position_embeddings": 64,
  "model_type": "gemma3_text", "num_attention_heads": 4, "num_hidden_layers": 3, "num_key_value_heads": 2,
  "pad_token_id": 0, "query_pre_attn_scalar": 10, "rms_norm_eps": 1e-06, "rope_local_base_freq": 100.0,
  "rope_scaling": {"factor": 4.0, "rope_type": "linear"}, "rope_theta": 1000000.0, "sliding_window": 5,
  "transformers_version": "4.57.6", "use_bidirectional_attention": false, "use_cache": true, "vocab_size": 113}''')
V5 = {**{k: v for k, v in V4.items() if k not in ("rope_scaling", "rope_theta", "rope_local_base_freq",
                                                    "_sliding_window_pattern")},
      "rope_parameters": {"full_attention": {"factor": 4.0, "rope_theta": 1000000.0, "rope_type": "linear"},
                          "sliding_attention": {"rope_theta": 100.0, "rope_type": "default"}},
      "transformers_version": "5.0.0"}


@pytest.mark.parametrize("layout", ["v4", "v5"])
def test_both_transformers_layouts_read_alike_and_exports_follow_the_source(layout):
    source = V4 if layout == "v4" else V5
    model = build_from_hf(source, seq_len=SEQ_LEN)
    assert model.config == build_from_hf(GEMMA, seq_len=SEQ_LEN).config
    exported = hf_config(model, torch_dtype="float32", source=source)
    assert ("rope_parameters" in exported) == (layout == "v5") and ("rope_theta" in exported) == (layout == "v4")
    assert exported == {**source, "tie_word_embeddings": True}  # the source's keys and values, and the tie said
    assert build_from_hf(exported, seq_len=SEQ_LEN).config == model.config


def test_presets_have_the_published_shapes_and_round_trip():
    """The presets' parameter counts (text decoders: 4B/12B/27B without their vision towers), pinned
    here from the shapes models/llama_config.py cites, and each preset survives config.json."""
    counts = {"gemma-3-1b": 999_885_952, "gemma-3-4b": 3_880_263_168, "gemma-3-12b": 11_766_034_176,
              "gemma-3-27b": 27_009_346_304}
    for name, count in counts.items():
        model = build_model(name)
        assert model.n_params() == count, name
        assert build_from_hf(hf_config(model)).config == model.config
    assert build_model("gemma-3-27b").config.attention_scale == 168 ** -0.5


def test_gemma_tensors_have_the_hub_names():
    names = {n: t.name for n, t in hf_tensors(build_model("gemma-tiny")).items()}
    assert names["blocks.0.attn_post_norm.scale"] == "model.layers.0.post_attention_layernorm.weight"
    assert names["blocks.0.mlp_norm.scale"] == "model.layers.0.pre_feedforward_layernorm.weight"
    assert names["blocks.5.mlp_post_norm.scale"] == "model.layers.5.post_feedforward_layernorm.weight"
    assert names["blocks.1.attn.q_norm.scale"] == "model.layers.1.self_attn.q_norm.weight"
    assert "head.kernel" not in names  # tied


@pytest.mark.parametrize("change,match", [
    ({"layer_types": ["sliding_attention", "chunked_attention", "full_attention"]},
     "layer_types holds 'chunked_attention', a kind of layer"),
    ({"layer_types": ["full_attention"]}, "layer_types must list one attention type for each of the 3 layers"),
    ({"attn_logit_softcapping": 50.0}, "attn_logit_softcapping is 50.0, which transformers' Gemma 3"),
    ({"hidden_activation": "gelu"}, "hidden_activation 'gelu'"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 8.0}}, "rope_scaling rope_type 'yarn'"),
    ({"quantization_config": {"quant_method": "bitsandbytes"}}, "quantization_config (quantized weights)"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"sliding_window": 0}, "sliding_window is 0"),
])
def test_gemma_configs_we_would_compute_differently_are_one_line(change, match):
    with pytest.raises(ValueError, match=match.replace("(", r"\(").replace(")", r"\)")) as e:
        build_from_hf({**GEMMA, **change})
    assert "\n" not in str(e.value)


def multimodal_checkpoint(directory, layout):
    """A tiny Gemma3ForConditionalGeneration saved by transformers (its text tower GEMMA's sizes, the
    rest of text_config left to the defaults as the published files leave it) in 4.x's layout
    (language_model.model.*, the published files' too), or renamed to 5.x's (model.language_model.*):
    (the HF model, the directory)."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    from safetensors.numpy import load_file, save_file
    text = {k: v for k, v in GEMMA.items() if k not in ("model_type", "max_position_embeddings", "rms_norm_eps")}
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=1,
                                       boi_token_index=110, eoi_token_index=111, image_token_index=112)
    torch.manual_seed(0)
    hf_model = transformers.Gemma3ForConditionalGeneration(config)
    with torch.no_grad():
        for p in hf_model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    hf_model.save_pretrained(directory)
    stored = json.loads((directory / "config.json").read_text())
    defaulted = ("max_position_embeddings", "rms_norm_eps", "hidden_activation", "attn_logit_softcapping",
                 "final_logit_softcapping", "use_bidirectional_attention", "_sliding_window_pattern")
    stored["text_config"] = {k: v for k, v in stored["text_config"].items() if k not in defaulted}
    (directory / "config.json").write_text(json.dumps(stored))
    towers = ("language_model.model.", "vision_tower.", "multi_modal_projector.")
    v5 = ("model.language_model.", "model.vision_tower.", "model.multi_modal_projector.")
    source, target = (v5, towers) if layout == "v4" else (towers, v5)  # whichever layout this transformers saved

    def spelled(name):
        return next((t + name[len(s):] for s, t in zip(source, target) if name.startswith(s)), name)
    tensors = load_file(directory / "model.safetensors")
    save_file({spelled(n): v for n, v in tensors.items()}, str(directory / "model.safetensors"))
    return hf_model.eval(), directory


@pytest.mark.hf_reference
@pytest.mark.parametrize("layout", ["v4", "v5"])
def test_a_multimodal_checkpoints_text_tower_gives_its_text_logits(layout, tmp_path):
    """--init-from-hf of a multimodal gemma3 checkpoint reads its text tower (the vision tower left
    unread), whose logits on text equal the multimodal model's; text_config's missing keys take
    Gemma3TextConfig's defaults, as transformers fills them."""
    from pstar_jax.io.hf import HFCheckpoint, header_shapes
    from pstar_models.hf import check_hf_shapes
    from pstar_models.llama import llama_from_params
    hf_model, directory = multimodal_checkpoint(tmp_path / "mm", layout)
    config = json.loads((directory / "config.json").read_text())
    check_hf_shapes(config, header_shapes(str(directory)))
    model = build_from_hf(config, seq_len=SEQ_LEN)
    assert model.config == dataclasses.replace(build_from_hf(GEMMA, seq_len=SEQ_LEN).config,
                                               max_position_embeddings=131072)
    with HFCheckpoint(str(directory), hf_tensors(model), model.param_shapes()) as weights:
        params = {n: jnp.asarray(weights[n]) for n in model.param_shapes()}
    tokens = hf_models.tokens_BxL(110)  # no image tokens
    ours = np.asarray(llama_from_params(model.config, params)(jnp.asarray(tokens)))
    hf_models.assert_logits_match(ours, hf_models.hf_logits(hf_model, tokens))
    bad = {**config, "text_config": {**config["text_config"], "hidden_size": 48}}
    with pytest.raises(ValueError, match="hidden_size=48 disagrees with the weights"):
        check_hf_shapes(bad, header_shapes(str(directory)))


@pytest.mark.parametrize("text_config", [None, "gemma", {"model_type": "siglip_vision_model"}])
def test_a_multimodal_checkpoint_without_a_text_tower_is_one_line(text_config):
    with pytest.raises(ValueError, match="has no gemma3_text text_config .* so its text tower cannot be found") as e:
        build_from_hf({"model_type": "gemma3", "text_config": text_config, "vision_config": {}})
    assert "\n" not in str(e.value)


def test_decoding_through_the_kv_cache_equals_the_full_forward():
    """Prefill then one token at a time, sliding and global layers each with their own window and
    RoPE: every step's logits equal the full forward's at that position."""
    model = build_from_hf({**GEMMA, "final_logit_softcapping": 3.0}, seq_len=SEQ_LEN)
    rng = np.random.default_rng(3)
    params = {n: v + 0.05 * jnp.asarray(rng.standard_normal(v.shape), jnp.float32)
              for n, v in model.init_params(0).items()}
    module = model.module(params)
    tokens = jnp.asarray(hf_models.tokens_BxL(113, 2, 16, seed=4))
    full = np.asarray(module(tokens))
    cache = module.init_cache(2, 16, jnp.float32)
    logits, cache = module.decode(tokens[:, :9], cache, 0)
    np.testing.assert_allclose(np.asarray(logits), full[:, :9], rtol=0, atol=2e-5)
    for pos in range(9, 16):
        logits, cache = module.decode(tokens[:, pos:pos + 1], cache, jnp.int32(pos))
        np.testing.assert_allclose(np.asarray(logits)[:, 0], full[:, pos], rtol=0, atol=2e-5)


def test_sliding_and_global_blocks_compile_apart_and_share_their_tensor_names():
    model = build_model("gemma-tiny")
    stages = model.stages(jnp.float32)[1:-1]
    kinds = [s.apply for s in stages]
    assert len(set(kinds)) == 2 and kinds[0] is kinds[4] and kinds[0] is not kinds[5]
    assert [n.split(".", 2)[2] for n in stages[0].param_names] == [n.split(".", 2)[2] for n in stages[5].param_names]
    assert all(s.param_names[0].endswith("attn_norm.scale") for s in stages)
    assert float(jnp.abs(model.init_tensor("blocks.0.attn_post_norm.scale", 0)).max()) == 0.0  # 1 + 0: identity
    assert dataclasses.replace(model.config, lora=None) == model.config


@pytest.mark.hf_reference
@pytest.mark.slow
def test_ten_fp32_steps_under_chunk_eviction_equal_transformers_and_torch_adamw():
    """The chunked engine, its chunks moving every step, against transformers' Gemma3ForCausalLM
    trained by torch.optim.AdamW on the same batches (fp32, no clipping, warmup-cosine, decay on
    matrices only), the window shorter than the batch's rows: equal losses at every step and
    equal params after ten."""
    pytest.importorskip("torch")
    from torch_adamw import assert_trained_alike, chunked_and_reference, train_both
    B, T = 2, 12
    hf_model, model, engine, opt, lr_at = chunked_and_reference(GEMMA, B, T)
    # Token 0 is Gemma's pad_token_id, whose embedding row torch's nn.Embedding(padding_idx=0)
    # never updates through the lookup (only through the tied head): left out of the inputs.
    ours, theirs = train_both(engine, hf_model, opt, lr_at, GEMMA["vocab_size"], B, T, low=1)
    assert_trained_alike(engine, model, hf_model, ours, theirs)


@pytest.mark.hf_reference
def test_a_lora_step_gives_pefts_loss_and_gradients_on_every_projection():
    """Adapters on q, k, v, o, gate, up, down (peft's q_proj ... down_proj) and the q/k norms
    trained in full: peft's loss and gradients on transformers' Gemma 3."""
    import test_lora_peft
    test_lora_peft.test_a_lora_step_gives_pefts_loss_and_gradients(
        (GEMMA, dict(rank=4, alpha=8.0), {"blocks.*.attn.q_norm": "q_norm", "blocks.*.attn.k_norm": "k_norm"}))


def test_lora_step_zero_is_the_base_model():
    """peft's initialisation (lora_b zero): the adapted model's loss is the base's, to the bit."""
    from pstar_jax.model.staged import compose_loss
    from pstar_models.lora import LoraSpec
    base = build_from_hf(GEMMA, seq_len=SEQ_LEN)
    adapted = build_from_hf(GEMMA, seq_len=SEQ_LEN, lora=LoraSpec(rank=4, alpha=8.0))
    params = adapted.init_params(3)
    assert {n.rsplit(".", 1)[0].split(".", 2)[2] for n in params if ".lora." in n} == {
        f"{p}.lora" for p in ("attn.q", "attn.k", "attn.v", "attn.o", "mlp.gate", "mlp.up", "mlp.down")}
    tokens = jnp.asarray(hf_models.tokens_BxL(113, L=SEQ_LEN + 1))
    loss = [compose_loss(m.stages(jnp.float32))({n: params[n] for n in m.param_shapes()}, tokens[:, :-1], tokens[:, 1:])
            for m in (base, adapted)]
    assert float(loss[0]) == float(loss[1])


@pytest.mark.hf_reference
def test_a_lora_run_exports_an_adapter_peft_loads_onto_the_source(tmp_path, capsys):
    """pstar-train --lora-rank on a Gemma 3 checkpoint: peft.PeftModel over the source checkpoint
    with our --export-lora gives the logits of our --export-hf (the merged model) in transformers."""
    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    import transformers
    from test_hf import lora_run_exports
    _, config = lora_run_exports(tmp_path, GEMMA, capsys, steps=3)
    src = tmp_path / "src"
    assert config["target_modules"] == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    load = dict(attn_implementation="eager", dtype=torch.float32)
    adapted = peft.PeftModel.from_pretrained(transformers.AutoModelForCausalLM.from_pretrained(src, **load),
                                             tmp_path / "adapter").eval()
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", **load).eval()
    tokens = hf_models.tokens_BxL(113)
    theirs = hf_models.hf_logits(merged, tokens)
    with torch.no_grad():
        ours = adapted(torch.from_numpy(tokens).long()).logits.numpy()
    assert not np.allclose(theirs, hf_models.hf_logits(transformers.AutoModelForCausalLM.from_pretrained(src, **load),
                                                       tokens))  # the run changed the model
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=2e-5 * float(np.abs(theirs).max()))


@pytest.mark.hf_reference
def test_a_run_from_a_multimodal_checkpoint_exports_its_text_tower(tmp_path, capsys):
    """pstar-train --init-from-hf on a multimodal gemma3 checkpoint, then --export-hf: a gemma3_text
    checkpoint (Gemma3ForCausalLM) that transformers loads with no tensor missing or left over."""
    transformers = pytest.importorskip("transformers")
    from pstar_jax.cli.train import main as train_main
    _, directory = multimodal_checkpoint(tmp_path / "mm", "v4")
    np.random.default_rng(0).integers(1, 110, 4000).astype(np.uint16).tofile(tmp_path / "d.u16.bin")
    code = train_main(["--init-from-hf", str(directory), "--data", str(tmp_path / "d.u16.bin"), "--steps", "1",
                       "--batch-size", "8", "--seq-len", "16", "--quiet", "--export-hf", str(tmp_path / "text"),
                       "--export-dtype", "fp32"])
    assert code == 0, capsys.readouterr().err
    exported = json.loads((tmp_path / "text" / "config.json").read_text())
    assert exported["model_type"] == "gemma3_text" and exported["architectures"] == ["Gemma3ForCausalLM"]
    _, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "text", output_loading_info=True)
    assert not any(info.values()), info


def test_config_fields_as_a_flax_export_writes_them_give_the_config_back():
    from pstar_models.llama_config import config_from_fields
    for name in ("gemma-3-4b", "gemma-3-1b", "llama-3.1-8b"):
        config = build_model(name).config
        assert config_from_fields(json.loads(json.dumps(dataclasses.asdict(config)))) == config


@pytest.mark.parametrize("tool", ["pstar-train", "pstar-plan"])
@pytest.mark.parametrize("change,field", [
    ({"layer_types": ["sliding_attention", "local_attention", "full_attention"]}, "layer_types"),
    ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
    ({"model_type": "gemma3", "text_config": None}, "text_config"),
])
def test_bad_gemma_configs_are_one_line_from_the_tools_before_anything_is_built(tool, change, field, tmp_path,
                                                                               capsys):
    from pstar_jax.cli.plan import main as plan_main
    from pstar_jax.cli.train import main as train_main
    from test_hf import write_family_checkpoint
    src = tmp_path / "gemma"
    write_family_checkpoint(str(src), build_from_hf(GEMMA, seq_len=SEQ_LEN))
    (src / "config.json").write_text(json.dumps({**json.loads((src / "config.json").read_text()), **change}))
    if tool == "pstar-train":
        np.random.default_rng(0).integers(0, 113, 4000).astype(np.uint16).tofile(tmp_path / "d.u16.bin")
        code = train_main(["--init-from-hf", str(src), "--data", str(tmp_path / "d.u16.bin"), "--steps", "1",
                           "--batch-size", "8", "--seq-len", "16", "--quiet", "--checkpoint-dir", str(tmp_path / "run")])
    else:
        code = plan_main(["--init-from-hf", str(src), "--seq-len", "16", "--batch-size", "8", "--no-search"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code != 0 and len(err) == 1 and "Traceback" not in err[0] and field in err[0], err
    run = tmp_path / "run"
    assert not run.exists() or [p.name for p in run.iterdir()] == [".pstar-run.lock"]  # no checkpoint begun


def test_sliding_layers_count_the_keys_their_window_reaches():
    """flops_per_token: a global layer's query attends to L/2 keys on average, a sliding one's to
    w - w^2/(2L) (window 16 at L = 64: 14); everything else is the same model's."""
    from pstar_models.llama import StagedLlama
    model = build_model("gemma-tiny")  # 6 layers, 5 of them sliding
    c = model.config
    full = StagedLlama(dataclasses.replace(c, layer_types=None))
    assert full.flops_per_token() - model.flops_per_token() == 12 * c.n_head * c.d_head * 5 * (32 - 14)
