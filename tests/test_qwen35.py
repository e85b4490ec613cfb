"""Qwen3.5's text decoder (models/qwen35.py, models/hf_qwen35.py): a qwen3_5_text checkpoint and a
multimodal qwen3_5 one's text tower give transformers' logits for the same weights in fp32 (5.x
only: 4.57 has no qwen3_5), packed rows keep to their examples, decoding through the cache (KV for
the full layers, conv window and delta-rule state for the linear ones) equals the full forward,
both layouts of the RoPE keys read alike, and bad configs are one line before anything is built."""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from pstar_models.hf_qwen35 import qwen35_config, qwen35_from_hf

# Odd sizes: head_dim 16 with partial_rotary 0.25 (4 rotated), GQA in both kinds of layer, a linear
# layer after the full one, so that each changes the logits.
TEXT = dict(model_type="qwen3_5_text", vocab_size=113, hidden_size=32, intermediate_size=48, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=6, linear_conv_kernel_dim=4,
            layer_types=["linear_attention", "full_attention", "linear_attention"], rms_norm_eps=1e-6,
            max_position_embeddings=64, tie_word_embeddings=False,
            rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25,
                                 mrope_section=[1, 1, 0], mrope_interleaved=True))
NO_QWEN3_5 = "transformers.models.qwen3_5 is not in this transformers (5.x has it)"
VISION = dict(depth=1, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=32, patch_size=2,
              temporal_patch_size=1, spatial_merge_size=1, num_position_embeddings=16)


def hf_model(config: dict, seed: int = 0):
    """transformers' model of ``config`` with every tensor random (its norms start at 0, its
    dt_bias at 1: randomised so that each one changes the logits), in fp32."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers.models.qwen3_5", reason=NO_QWEN3_5)
    import transformers
    hf_config = transformers.AutoConfig.for_model(**config)
    cls = (transformers.Qwen3_5ForConditionalGeneration if config["model_type"] == "qwen3_5"
           else transformers.Qwen3_5ForCausalLM)
    torch.manual_seed(seed)
    model = cls(hf_config).float().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.2 * torch.randn_like(p))
    return model


def state(model) -> dict:
    return {n: t.detach().numpy() for n, t in model.state_dict().items()}


def hf_logits(model, tokens: np.ndarray, double: bool = False) -> np.ndarray:
    import torch
    with torch.no_grad():
        m = model.double() if double else model
        out = m(input_ids=torch.tensor(tokens)).logits.numpy()
        model.float()
    return out


def tokens(L: int, seed: int = 1, batch: int = 2) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 113, size=(batch, L))


def assert_rounding(ours: np.ndarray, expected: np.ndarray, exact: np.ndarray) -> None:
    """Within fp32 rounding: off transformers' float64 logits by at most twice its own fp32 error."""
    rounding = np.abs(expected - exact).max()
    assert 0 < rounding < 1e-4 * np.abs(exact).max(), rounding
    assert np.abs(ours - exact).max() <= 2 * rounding, (np.abs(ours - exact).max(), rounding)


@pytest.mark.hf_reference
@pytest.mark.parametrize("multimodal", [False, True], ids=["qwen3_5_text", "qwen3_5"])
def test_checkpoints_give_transformers_logits(multimodal):
    config = dict(model_type="qwen3_5", text_config=TEXT, vision_config=VISION) if multimodal else TEXT
    model = hf_model(config)
    ours = qwen35_from_hf(config, state(model))
    x = tokens(70)
    assert_rounding(np.asarray(ours(jnp.asarray(x))), hf_logits(model, x), hf_logits(model, x, double=True))


@pytest.mark.hf_reference
def test_packed_rows_give_each_example_transformers_logits():
    model = hf_model(TEXT)
    ours = qwen35_from_hf(TEXT, state(model))
    a, b = tokens(13, seed=2, batch=1), tokens(11, seed=3, batch=1)
    row = jnp.asarray(np.concatenate([a, b], axis=1))
    segments = jnp.asarray([[1] * 13 + [2] * 11])
    positions = jnp.asarray([list(range(13)) + list(range(11))])
    logits = np.asarray(ours(row, segments, positions))
    for part, x in ((logits[:, :13], a), (logits[:, 13:], b)):
        assert_rounding(part, hf_logits(model, x), hf_logits(model, x, double=True))


@pytest.mark.slow  # (10-16 s on 2 cores)
def test_decoding_through_the_cache_equals_the_full_forward():
    """A prompt of 9 in one call, then 1, 1 and 4 tokens: the logits of the whole row at once."""
    from flax import nnx
    from pstar_models.qwen35 import Qwen35
    ours = Qwen35(qwen35_config(TEXT), rngs=nnx.Rngs(0))
    x = jnp.asarray(tokens(15, seed=4))
    whole = np.asarray(ours(x))
    cache = ours.init_cache(2, 15, jnp.float32)
    outs = []
    for a, b in ((0, 9), (9, 10), (10, 11), (11, 15)):
        out, cache = ours.decode(x[:, a:b], cache, a)
        outs.append(np.asarray(out))
    np.testing.assert_allclose(np.concatenate(outs, axis=1), whole, rtol=0, atol=1e-5 * np.abs(whole).max())


def test_both_layouts_of_the_rope_keys_read_alike():
    """transformers 5.x's rope_parameters and a 4.x-style file's top-level keys give one config;
    a file without layer_types gets transformers' default (every 4th layer full)."""
    flat = {k: v for k, v in TEXT.items() if k != "rope_parameters"}
    old = {**flat, "rope_theta": 10000.0, "partial_rotary_factor": 0.25}
    assert qwen35_config(old) == qwen35_config(TEXT)
    assert qwen35_config(json.loads(json.dumps(TEXT))) == qwen35_config(TEXT)
    default = qwen35_config({**TEXT, "num_hidden_layers": 8, "layer_types": None})
    assert default.layer_types == ("linear_attention",) * 3 + ("full_attention",) + ("linear_attention",) * 3 + (
        "full_attention",)


@pytest.mark.parametrize("config,message", [
    ({**TEXT, "layer_types": ["linear_attention", "sliding_attention", "full_attention"]},
     "config.json's layer_types has 'sliding_attention', which pstar_jax does not implement for qwen3_5_text "
     "(known: linear_attention, full_attention)"),
    ({**TEXT, "quantization_config": {"quant_method": "fp8"}},
     "config.json asks for quantization_config (quantized weights), which pstar_jax's models do not implement"),
    ({"model_type": "qwen3_5", "vision_config": VISION},
     "config.json model_type 'qwen3_5' has no qwen3_5_text text_config (got None), so its text tower cannot be "
     "found; pass a checkpoint whose config.json has one, or a text-only qwen3_5_text checkpoint"),
    ({**TEXT, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}},
     "config.json's rope_parameters.rope_type='yarn' is not supported (only 'default')"),
], ids=["layer_type", "quantized", "no_text_tower", "rope_type"])
def test_bad_configs_are_one_line_naming_the_field(config, message):
    with pytest.raises(ValueError) as err:
        qwen35_config(config)
    assert str(err.value) == message


@pytest.mark.hf_reference
@pytest.mark.slow
def test_ten_fp32_steps_under_chunk_eviction_equal_transformers_and_torch_adamw():
    """The chunked engine, its chunks moving every step, against transformers' Qwen3_5ForCausalLM
    trained by torch.optim.AdamW on the same batches (fp32, no clipping, warmup-cosine, decay on
    matrices only, the conv taps included): equal losses at every step and equal params after ten,
    to twice torch's own fp32 error on each tensor (against the same run in float64; Adam
    magnifies a gradient's rounding where the gradient is small, and the delta rule's solve
    rounds otherwise than torch's)."""
    import copy
    torch = pytest.importorskip("torch")
    from frozen_engines import chunked
    from torch_adamw import OPTIM, torch_adamw, torch_steps, train_both
    from pstar_jax.config import OptimConfig
    from pstar_models.hf_qwen35 import params_from_hf
    from pstar_models.qwen35 import StagedQwen35
    B, T = 2, 12
    optim = OptimConfig(**OPTIM)
    hf = hf_model(TEXT).train()
    hf64 = copy.deepcopy(hf).to(torch.float64)
    model = StagedQwen35(qwen35_config(TEXT, seq_len=T))
    engine = chunked(model, frozenset(), batch=B, seq=T, optim=optim, chunk=None,
                     init_params=params_from_hf(TEXT, state(hf), model))
    ours, theirs = train_both(engine, hf, *torch_adamw(hf, optim), TEXT["vocab_size"], B, T)
    assert all(r.h2d_bytes > 0 and r.d2h_bytes > 0 for r in ours)
    np.testing.assert_allclose([r.loss for r in ours], theirs, rtol=2e-6)
    torch_steps(hf64, *torch_adamw(hf64, optim), TEXT["vocab_size"], B, T)
    exact = params_from_hf(TEXT, {n: v.astype(np.float64) for n, v in state(hf64).items()}, model)
    mine = engine.params()
    for name, value in params_from_hf(TEXT, state(hf), model).items():
        rounding = max(np.abs(value - exact[name]).max(), 1e-6)
        np.testing.assert_allclose(mine[name], exact[name], rtol=0, atol=2 * rounding, err_msg=name)


@pytest.mark.slow  # (10-16 s on 2 cores)
def test_packed_sft_rows_give_each_example_its_own_loss_and_grads():
    """test_batch's check on Qwen3.5: a packed row of 3 examples has the loss sum and every gradient
    of the examples run alone (each padded, with its own mask), through the convolution, the delta
    rule and attention, to fp32 rounding: 64 ulps of each gradient's largest value, but 1024 for the
    decay's parameters (A_log, dt_bias, in_a), whose gradients sum each token's dL/dg, terms of
    both signs that largely cancel (measured: 11 x 64 ulps apart; one ulp more on the embeddings
    alone moves them by 1 x 64)."""
    from test_batch import assert_packed_row_equals_its_examples_alone
    from pstar_models.qwen35 import StagedQwen35
    decay = ("A_log", "dt_bias", "in_a.kernel")
    assert_packed_row_equals_its_examples_alone(StagedQwen35(qwen35_config(TEXT, seq_len=32)),
                                                ulps=lambda name: 1024 if name.endswith(decay) else 64)


@pytest.mark.slow  # (10-16 s on 2 cores)
def test_lora_targets_every_projection_and_step_zero_is_the_base_model():
    """peft's initialisation (lora_b zero): the adapted model's loss is the base's, to the bit, with
    an adapter on each projection of both kinds of block."""
    import dataclasses
    from pstar_jax.model.staged import compose_loss
    from pstar_models.lora import LoraSpec
    from pstar_models.qwen35 import StagedQwen35
    config = qwen35_config(TEXT, seq_len=16)
    base, adapted = StagedQwen35(config), StagedQwen35(dataclasses.replace(config, lora=LoraSpec(rank=4, alpha=8.0)))
    params = adapted.init_params(3)
    assert {n.split(".", 2)[2].rsplit(".", 2)[0] for n in params if ".lora." in n} == {
        "attn.q", "attn.k", "attn.v", "attn.o", "linear_attn.in_qkv", "linear_attn.in_z", "linear_attn.in_b",
        "linear_attn.in_a", "linear_attn.out", "mlp.gate", "mlp.up", "mlp.down"}
    x = jnp.asarray(tokens(17, seed=5))
    loss = [compose_loss(m.stages(jnp.float32))({n: params[n] for n in m.param_shapes()}, x[:, :-1], x[:, 1:])
            for m in (base, adapted)]
    assert float(loss[0]) == float(loss[1])


def test_a_lora_target_of_neither_kind_is_one_line():
    import dataclasses
    from pstar_models.lora import LoraSpec
    with pytest.raises(ValueError, match=r"^LoRA target 'attn\.qkv' matches no projection of a qwen3_5_text block; "
                                         r"choose among attn\.q, attn\.k, attn\.v, attn\.o, linear_attn\.in_qkv"):
        dataclasses.replace(qwen35_config(TEXT), lora=LoraSpec(rank=4, alpha=8.0, targets=("attn.qkv",)))


@pytest.mark.hf_reference
def test_a_lora_step_gives_pefts_loss_and_gradients_on_every_projection():
    """Adapters (random, lora_b too, so every adapter tensor gets a gradient) on the twelve
    projections under peft's module names (q_proj ... out_proj, in_proj_qkv ... down_proj): peft's
    loss and adapter gradients on transformers' Qwen3_5ForCausalLM, fp32."""
    import dataclasses
    import jax
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers.models.qwen3_5", reason=NO_QWEN3_5)
    peft = pytest.importorskip("peft")
    from pstar_jax.model.staged import compose_loss
    from pstar_models.hf_qwen35 import hf_name, params_from_hf
    from pstar_models.lora import LoraSpec
    from pstar_models.qwen35 import StagedQwen35
    hf = hf_model(TEXT)
    base = StagedQwen35(qwen35_config(TEXT, seq_len=16))
    model = StagedQwen35(dataclasses.replace(base.config, lora=LoraSpec(rank=4, alpha=8.0)))
    rng = np.random.default_rng(6)
    params = {n: jnp.asarray(v) for n, v in params_from_hf(TEXT, state(hf), base).items()}
    adapters = {n: jnp.asarray(0.3 * rng.standard_normal(s), jnp.float32) for n, s in model.param_shapes().items()
                if ".lora." in n}
    modules = sorted({hf_name(n.split(".lora.")[0] + ".kernel").rsplit(".", 2)[-2] for n in adapters})
    assert modules == ["down_proj", "gate_proj", "in_proj_a", "in_proj_b", "in_proj_qkv", "in_proj_z", "k_proj",
                       "o_proj", "out_proj", "q_proj", "up_proj", "v_proj"]
    peft_model = peft.get_peft_model(hf, peft.LoraConfig(r=4, lora_alpha=8, target_modules=modules, lora_dropout=0.0))
    theirs = dict(peft_model.named_parameters())

    def peft_name(ours):  # blocks.0.attn.q.lora.lora_a -> ...layers.0.self_attn.q_proj.lora_A.default.weight
        module = hf_name(ours.split(".lora.")[0] + ".kernel").removesuffix(".weight")
        return f"base_model.model.{module}.lora_{'A' if ours.endswith('lora_a') else 'B'}.default.weight"
    with torch.no_grad():
        for n, v in adapters.items():
            theirs[peft_name(n)].copy_(torch.tensor(np.asarray(v).T))
    x = tokens(17, seed=7)

    def torch_grads(dtype):
        peft_model.to(dtype).zero_grad()
        logits = peft_model(torch.tensor(x[:, :-1])).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 torch.tensor(x[:, 1:]).reshape(-1))
        loss.backward()
        return float(loss.detach()), {n: theirs[peft_name(n)].grad.double().numpy().T.copy() for n in adapters}
    exact = torch_grads(torch.float64)[1]
    loss_t, grads_t = torch_grads(torch.float32)
    compose = compose_loss(model.stages(jnp.float32))
    loss, grads = jax.value_and_grad(lambda a: compose({**params, **a}, jnp.asarray(x[:, :-1]),
                                                        jnp.asarray(x[:, 1:])))(adapters)
    np.testing.assert_allclose(float(loss), loss_t, rtol=2e-6)
    # fp32 rounding: off peft's float64 gradients by at most twice peft's own fp32 error on each
    # tensor (which the gated norm and the delta rule magnify on the linear layers).
    for n, g in grads.items():
        rounding = max(np.abs(grads_t[n] - exact[n]).max(), 2e-6 * np.abs(exact[n]).max())
        np.testing.assert_allclose(np.asarray(g), exact[n], rtol=0, atol=2 * rounding, err_msg=n)


@pytest.mark.hf_reference
@pytest.mark.parametrize("source", ["none", "v5", "flat", "multimodal"])
def test_exports_load_in_transformers_with_the_same_logits(source, tmp_path):
    """Our config.json (the RoPE keys in the source's layout; a multimodal source's text tower as a
    qwen3_5_text model) and weights under transformers' names: Qwen3_5ForCausalLM loads them with no
    tensor missing or left over, and gives our logits."""
    pytest.importorskip("transformers.models.qwen3_5", reason=NO_QWEN3_5)
    import transformers
    from safetensors.numpy import save_file
    from pstar_models.hf_qwen35 import hf_tensors, qwen35_hf_config, to_hf
    from pstar_models.qwen35 import StagedQwen35
    flat = {**{k: v for k, v in TEXT.items() if k != "rope_parameters"}, "rope_theta": 10000.0,
            "partial_rotary_factor": 0.25}
    sources = {"none": None, "v5": TEXT, "flat": flat,
               "multimodal": dict(model_type="qwen3_5", text_config=TEXT, vision_config=VISION)}
    model = StagedQwen35(qwen35_config(TEXT, seq_len=16))
    rng = np.random.default_rng(1)
    params = {n: np.asarray(v) + 0.1 * rng.standard_normal(v.shape).astype(np.float32)
              for n, v in model.init_params(0).items()}  # norms away from 0 (1 + weight)
    save_file({hf: np.ascontiguousarray(to_hf(n, params[n])) for n, hf in hf_tensors(model).items()},
              str(tmp_path / "model.safetensors"))
    exported = qwen35_hf_config(model.config, "float32", sources[source])
    assert ("rope_parameters" in exported) == (source != "flat")
    assert qwen35_config(exported, seq_len=16) == model.config
    (tmp_path / "config.json").write_text(json.dumps(exported))
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info.values()), info
    assert type(hf).__name__ == "Qwen3_5ForCausalLM"
    x = tokens(16, seed=8)
    ours = np.asarray(model.module({n: jnp.asarray(v) for n, v in params.items()})(jnp.asarray(x)))
    hf = hf.float().eval()
    assert_rounding(ours, hf_logits(hf, x), hf_logits(hf, x, double=True))


def test_presets_have_the_published_shapes_and_round_trip():
    """The text decoders' parameter counts (without the vision towers and the MTP layers), pinned
    from the shapes models/qwen35.py cites, and each preset survives its config.json."""
    from pstar_models import PRESET_NAMES, build_model
    from pstar_models.hf_qwen35 import qwen35_hf_config
    counts = {"qwen3.5-0.8b": 752_393_024, "qwen3.5-2b": 1_881_825_088, "qwen3.5-4b": 4_205_751_296,
              "qwen3.5-9b": 8_953_803_264, "qwen3.5-27b": 26_895_998_464}
    for name, count in counts.items():
        model = build_model(name)
        assert name in PRESET_NAMES and model.n_params() == count, name
        assert qwen35_config(qwen35_hf_config(model.config), seq_len=4096) == model.config
    c = build_model("qwen3.5-27b").config
    assert (c.rotary_dim, c.layer_types[:4], c.layer_types.count("full_attention")) == (
        64, ("linear_attention",) * 3 + ("full_attention",), 16)


# transformers' apply_chat_template(..., add_generation_prompt=True) on Qwen/Qwen3.5-9B's tokenizer
# for enable_thinking unset / False / True, as the stored golden file records it (tests/chat_fixtures.py).
CHATS = {"user": [{"role": "user", "content": "Hi"}],
         "sys_user": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
         "multi": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                   {"role": "user", "content": "And?"}]}
_OPEN, _CLOSED = "<|im_start|>assistant\n<think>\n", "<|im_start|>assistant\n<think>\n\n</think>\n\n"
_BEFORE = {"user": "<|im_start|>user\nHi<|im_end|>\n",
           "sys_user": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n",
           "multi": "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
                    "<|im_start|>user\nAnd?<|im_end|>\n"}


@pytest.mark.parametrize("thinking", [None, False, True], ids=["unset", "off", "on"])
def test_the_chat_template_renders_as_the_checkpoint_ships_it(thinking, tmp_path):
    """Qwen3.5's template (macros, namespaces, loop.previtem, thinking open by default) through our
    renderer: the generation prompts transformers wrote for the published tokenizer."""
    from chat_fixtures import tokenizer_dir
    from pstar_jax.data.template import ChatTemplate
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    template = ChatTemplate.from_tokenizer_dir(tokenizer_dir(tmp_path, "qwen3_5"), kwargs=kwargs)
    for name, chat in CHATS.items():
        assert template.render(chat, add_generation_prompt=True) == _BEFORE[name] + (
            _CLOSED if thinking is False else _OPEN), (name, thinking)


@pytest.mark.hf_reference
def test_chat_ids_equal_transformers_and_each_assistant_turn_is_trained_as_written(tmp_path):
    """Token ids equal transformers' apply_chat_template; as Qwen3's, the template renders earlier
    assistant turns bare and the last one after a think block, so each assistant turn is an example
    of its own (the conversation through it), only what the model writes after the generation
    prompt (which opens the think block) trained."""
    transformers = pytest.importorskip("transformers")
    from chat_fixtures import CONVERSATIONS, tokenizer_dir
    from pstar_jax.data.template import ChatTemplate
    directory = tokenizer_dir(tmp_path, "qwen3_5")
    reference = transformers.AutoTokenizer.from_pretrained(directory)
    template = ChatTemplate.from_tokenizer_dir(directory)

    def hf_ids(conversation, **kwargs):
        out = reference.apply_chat_template(conversation, tokenize=True, **kwargs)
        return list(out["input_ids"] if not isinstance(out, list) else out)
    for conversation in CONVERSATIONS:
        for prompt in (False, True):
            assert template.encode(template.render(conversation, prompt)) == hf_ids(
                conversation, add_generation_prompt=prompt)
        ends = [i + 1 for i, m in enumerate(conversation) if m["role"] == "assistant"]
        examples = template.encode_batch_with_mask(template.prepare(conversation))
        assert len(examples) == len(ends)
        for (ids, labels), end in zip(examples, ends):
            assert ids.tolist() == hf_ids(conversation[:end])
            trained = template.tokenizer.decode(ids[labels == 1].tolist(), skip_special_tokens=False)
            # (the generation prompt already opens the think block: the model writes its close)
            assert trained == "\n</think>\n\n" + conversation[end - 1]["content"].strip() + "<|im_end|>\n"


def saved_checkpoint(directory, config: dict):
    """transformers' model of ``config`` (random weights) saved by save_pretrained, fp32: the model."""
    model = hf_model(config)
    model.save_pretrained(directory)
    return model


@pytest.mark.hf_reference
@pytest.mark.parametrize("multimodal", [False, True], ids=["qwen3_5_text", "qwen3_5"])
def test_a_lora_run_from_a_checkpoint_exports_what_transformers_and_peft_load(multimodal, tmp_path, capsys):
    """pstar-train --init-from-hf on a checkpoint transformers saved (a multimodal one: its text tower,
    the vision tower left unread), --lora-rank 4 on every projection: --export-hf writes a
    qwen3_5_text checkpoint that transformers loads with nothing missing or left over, and
    --export-lora an adapter that peft loads onto the source's text model, giving the merged
    export's logits."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers.models.qwen3_5", reason=NO_QWEN3_5)
    peft = pytest.importorskip("peft")
    import transformers
    from pstar_jax.cli.train import main as train_main
    config = dict(model_type="qwen3_5", text_config=TEXT, vision_config=VISION) if multimodal else TEXT
    saved_checkpoint(tmp_path / "src", config)
    np.random.default_rng(0).integers(0, 113, 4000).astype(np.uint16).tofile(tmp_path / "d.u16.bin")
    code = train_main(["--init-from-hf", str(tmp_path / "src"), "--data", str(tmp_path / "d.u16.bin"), "--steps", "3",
                       "--batch-size", "8", "--seq-len", "16", "--lora-rank", "4", "--lr", "1e-2", "--quiet",
                       "--export-lora", str(tmp_path / "adapter"), "--export-hf", str(tmp_path / "merged"),
                       "--export-dtype", "fp32"])
    assert code == 0, capsys.readouterr().err
    adapter = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert adapter["target_modules"] == ["down_proj", "gate_proj", "in_proj_a", "in_proj_b", "in_proj_qkv",
                                         "in_proj_z", "k_proj", "o_proj", "out_proj", "q_proj", "up_proj", "v_proj"]
    merged, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", output_loading_info=True,
                                                                      dtype=torch.float32)
    assert not any(info.values()), info
    assert type(merged).__name__ == "Qwen3_5ForCausalLM"
    base = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "src", dtype=torch.float32)
    x = tokens(16, seed=9)
    before = hf_logits(base.eval(), x)
    adapted = peft.PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        ours = adapted(torch.from_numpy(x).long()).logits.numpy()
    theirs = hf_logits(merged.eval(), x)
    assert not np.allclose(theirs, before, atol=1e-3)  # the run changed the model
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=2e-5 * float(np.abs(theirs).max()))


def test_init_from_hf_reads_both_kinds_of_file_and_refuses_bad_ones_in_one_line():
    """build_from_hf (what --init-from-hf calls) builds Qwen3.5 from a qwen3_5_text file and a
    multimodal qwen3_5 one alike; a field that disagrees with an override, and the bad configs
    above, are one line."""
    from pstar_models import build_from_hf
    from pstar_models.qwen35 import StagedQwen35
    text = build_from_hf(TEXT, seq_len=16)
    assert isinstance(text, StagedQwen35) and text.config == qwen35_config(TEXT, seq_len=16)
    assert build_from_hf(dict(model_type="qwen3_5", text_config=TEXT), seq_len=16).config == text.config
    with pytest.raises(ValueError, match=r"^n_layer=4 disagrees with config.json, which gives 3; leave n_layer out"):
        build_from_hf(TEXT, seq_len=16, n_layer=4)
    with pytest.raises(ValueError, match="layer_types has 'sliding_attention'") as err:
        build_from_hf({**TEXT, "layer_types": ["linear_attention", "sliding_attention", "full_attention"]})
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match=r"^config.json model_type 'qwen3_5_moe' is not supported; supported: ") as err:
        build_from_hf({"model_type": "qwen3_5_moe", "text_config": TEXT})  # the mixtures of experts: not yet
    assert "\n" not in str(err.value)


@pytest.mark.slow  # (about 40 s on 2 cores)
def test_pstar_train_trains_the_tiny_preset_in_bf16_and_its_exports_decode_alike(tmp_path, capsys):
    """The command line's defaults (bf16, 64 tokens, half the model data on the device; this once
    hung in its first steps, in the delta rule's LAPACK solve: see delta_rule.unit_lower_solve);
    pstar-generate then decodes the same text from the run's checkpoint and from its --export-flax."""
    from pstar_jax.cli.generate import main as generate_main
    from pstar_jax.cli.train import main as train_main
    out, ckpt, flax = tmp_path / "m.jsonl", tmp_path / "ckpt", tmp_path / "flax"
    code = train_main(["--model", "qwen3.5-tiny", "--steps", "6", "--quiet", "--metrics-out", str(out),
                       "--checkpoint-dir", str(ckpt), "--export-flax", str(flax)])
    assert code == 0, capsys.readouterr().err
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(6)) and all(np.isfinite(r["loss"]) for r in records)
    assert all(r["h2d_bytes"] > 0 for r in records[1:]), records
    capsys.readouterr()
    texts = []
    for source in (["--checkpoint-dir", str(ckpt)], ["--flax", str(flax)]):
        code = generate_main([*source, "--prompt", "abc", "--max-new-tokens", "12", "--temperature", "0",
                              "--precision", "fp32"])
        text, err = capsys.readouterr()
        assert code == 0, err
        texts.append(text)
    assert texts[0] == texts[1] and texts[0].strip()
