"""Mixtures of experts (issue 32, part 2): Qwen3-MoE and Mixtral checkpoints give transformers'
logits for the same weights (fp32), our exports load in transformers unchanged, the grouped
matmul equals a dense one-hot reference, the experts land in chunks of their own, and configs
transformers would train differently are refused in one line."""

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pstar_models import build_from_hf, hf_config, hf_tensors
from pstar_models.hf import check_hf_shapes
from pstar_models.moe import grouped_swiglu, route
import test_hf_models as hf_models  # (a module: its test functions imported by name would be collected here too)
from test_hf_models import SEQ_LEN

EPS32 = float(np.finfo(np.float32).eps)

# 4 experts, 2 per token, head_dim 12 beside a width-32 model (Qwen3-MoE reads head_dim as given).
QWEN3_MOE = dict(model_type="qwen3_moe", vocab_size=109, hidden_size=32, intermediate_size=56,
                 moe_intermediate_size=20, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                 head_dim=12, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, decoder_sparse_step=1,
                 mlp_only_layers=[], rope_theta=1000000.0, rms_norm_eps=1e-6, max_position_embeddings=64,
                 tie_word_embeddings=False, output_router_logits=False, router_aux_loss_coef=0.001)
MIXTRAL = dict(model_type="mixtral", vocab_size=107, hidden_size=36, intermediate_size=28, num_hidden_layers=2,
               num_attention_heads=6, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
               rope_theta=1000000.0, rms_norm_eps=1e-5, max_position_embeddings=64, sliding_window=None,
               tie_word_embeddings=False, output_router_logits=False, router_aux_loss_coef=0.02,
               router_jitter_noise=0.0)
CHECKPOINTS = {
    "qwen3_moe": QWEN3_MOE,
    "qwen3_moe_unnormalised": {**QWEN3_MOE, "norm_topk_prob": False, "num_experts_per_tok": 3},  # the class default
    "qwen3_moe_tied": {**QWEN3_MOE, "tie_word_embeddings": True},
    "mixtral": MIXTRAL,
    # Dense layers among the experts' (transformers' Qwen3MoeDecoderLayer rule): layer 0 listed
    # in mlp_only_layers; every 2nd layer sparse, so of 3 only layer 1 has experts.
    "qwen3_moe_mlp_only_layer_0": {**QWEN3_MOE, "mlp_only_layers": [0]},
    "qwen3_moe_sparse_step_2": {**QWEN3_MOE, "num_hidden_layers": 3, "decoder_sparse_step": 2},
}


@pytest.mark.hf_reference
@pytest.mark.parametrize("config", CHECKPOINTS.values(), ids=CHECKPOINTS.keys())
def test_moe_checkpoints_give_transformers_logits_and_loss(config):
    hf_models.test_hf_weights_give_hf_logits(config)


@pytest.mark.hf_reference
@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_moe_exports_load_in_transformers_with_the_same_logits(name, tmp_path):
    source = CHECKPOINTS[name]
    config = build_from_hf(source, seq_len=SEQ_LEN).config
    hf_models.test_export_loads_in_transformers_with_the_same_logits(config, tmp_path, source)


def test_grouped_experts_equal_a_dense_one_hot_reference_with_an_expert_left_out():
    """ragged_dot over tokens sorted by expert against every expert on every token, masked; an
    expert no token chose gets exactly zero gradient, the others the reference's."""
    N, D, I, E, k = 24, 8, 6, 5, 2
    keys = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(keys[0], (N, D))
    gate, up = jax.random.normal(keys[1], (E, D, I)), jax.random.normal(keys[2], (E, D, I))
    down = jax.random.normal(keys[3], (E, I, D))
    logits = jax.random.normal(keys[4], (N, E)).at[:, 3].set(-30.0)  # expert 3: never chosen

    def grouped(x, gate, up, down):
        w, e = route(logits, k, True, x.dtype)
        return jnp.sum(grouped_swiglu(x, e, gate, up, down) * w[..., None], axis=1)

    def dense(x, gate, up, down):
        w, e = route(logits, k, True, x.dtype)
        every = jnp.einsum("edi,nd->nei", up, x) * jax.nn.silu(jnp.einsum("edi,nd->nei", gate, x))
        y_NxExD = jnp.einsum("nei,eid->ned", every, down)
        mix_NxE = jnp.sum(jax.nn.one_hot(e, E) * w[..., None], axis=1)
        return jnp.einsum("ned,ne->nd", y_NxExD, mix_NxE)

    args = (x, gate, up, down)
    scale = float(jnp.abs(dense(*args)).max())
    np.testing.assert_allclose(grouped(*args), dense(*args), rtol=0, atol=1e-5 * scale)
    probe = jax.random.normal(jax.random.key(1), (N, D))
    g_ours = jax.grad(lambda *a: jnp.sum(grouped(*a) * probe), argnums=(0, 1, 2, 3))(*args)
    g_ref = jax.grad(lambda *a: jnp.sum(dense(*a) * probe), argnums=(0, 1, 2, 3))(*args)
    for ours, ref in zip(g_ours, g_ref):
        np.testing.assert_allclose(ours, ref, rtol=0, atol=1e-5 * float(jnp.abs(ref).max()))
    for g in g_ours[1:]:
        g = np.asarray(g)
        assert not np.any(g[3]) and np.all(np.any(g[[0, 1, 2, 4]] != 0, axis=(1, 2)))


def test_moe_tensors_have_the_hub_names_and_configs_round_trip():
    qwen = build_from_hf(QWEN3_MOE, seq_len=SEQ_LEN)
    names = hf_tensors(qwen)
    assert names["blocks.1.mlp.router.kernel"] == ("model.layers.1.mlp.gate.weight", True, False)
    assert names["blocks.0.mlp.experts.3.down.kernel"] == ("model.layers.0.mlp.experts.3.down_proj.weight", True, False)
    mixtral = build_from_hf(MIXTRAL, seq_len=SEQ_LEN)
    names = hf_tensors(mixtral)
    assert names["blocks.0.mlp.router.kernel"] == ("model.layers.0.block_sparse_moe.gate.weight", True, False)
    assert names["blocks.1.mlp.experts.2.up.kernel"] == (
        "model.layers.1.block_sparse_moe.experts.2.w3.weight", True, False)
    assert len({t.name for t in names.values()}) == len(names) == len(mixtral.param_shapes())
    for source, model in ((QWEN3_MOE, qwen), (MIXTRAL, mixtral)):
        exported = hf_config(model, torch_dtype="float32", source=source)
        assert json.loads(json.dumps(exported)) == exported
        assert build_from_hf(exported, seq_len=SEQ_LEN).config == model.config
        assert {k: exported[k] for k in source} == source  # every field the source wrote, kept
    c = qwen.config
    assert (c.n_experts, c.n_experts_per_tok, c.expert_width, c.norm_topk_prob, c.d_head) == (4, 2, 20, True, 12)
    # A token meets k of E experts: the FLOPs count 2 of 4 experts' weights per layer.
    idle = c.n_layer * 2 * 3 * c.d_model * c.expert_width
    dense_flops = 6.0 * (qwen.n_params() - c.vocab_size * c.d_model) + 6.0 * c.n_layer * c.seq_len * c.n_head * 12
    assert qwen.flops_per_token() == dense_flops - 6.0 * idle


@pytest.mark.parametrize("config,match", [
    ({**QWEN3_MOE, "output_router_logits": "yes"}, "output_router_logits is 'yes'; it must be true or false"),
    ({**QWEN3_MOE, "router_aux_loss_coef": -1}, "router_aux_loss_coef is -1; it must be a number >= 0"),
    ({**QWEN3_MOE, "mlp_only_layers": [2]}, r"mlp_only_layers holds 2, which is no layer of the 2 \(num_hidden_layers"),
    ({**QWEN3_MOE, "mlp_only_layers": [-1]}, "mlp_only_layers holds -1, which is no layer"),
    ({**QWEN3_MOE, "mlp_only_layers": "0"}, "mlp_only_layers is 0; it must be a list of layer indices"),
    ({**QWEN3_MOE, "decoder_sparse_step": 0}, "decoder_sparse_step is 0; it must be a whole number >= 1"),
    ({**QWEN3_MOE, "decoder_sparse_step": 3, "output_router_logits": True}, "output_router_logits needs a layer "
                                                                              "with experts"),
    ({**QWEN3_MOE, "num_experts_per_tok": 5}, "num_experts_per_tok=5 exceeds num_experts=4"),
    ({**QWEN3_MOE, "num_experts": 0}, "num_experts is 0"),
    ({**MIXTRAL, "router_jitter_noise": 0.01}, "router_jitter_noise 0.01"),
    ({**MIXTRAL, "num_local_experts": 2.5}, "num_local_experts is 2.5"),
    ({**QWEN3_MOE, "num_local_experts": 8}, "num_experts=4 and num_local_experts=8 disagree"),
    ({**QWEN3_MOE, "norm_topk_prob": "yes"}, "norm_topk_prob is 'yes'; it must be true or false"),
])
def test_moe_configs_transformers_would_train_differently_are_one_line(config, match):
    with pytest.raises(ValueError, match=match) as err:
        build_from_hf(config, seq_len=SEQ_LEN)
    assert "\n" not in str(err.value)


def test_qwen3_moe_expert_count_is_read_under_either_transformers_name():
    """transformers 5.x writes Qwen3-MoE's expert count as num_local_experts, 4.x as num_experts."""
    v5 = {k: v for k, v in QWEN3_MOE.items() if k != "num_experts"} | {"num_local_experts": 4}
    assert build_from_hf(v5, seq_len=SEQ_LEN).config == build_from_hf(QWEN3_MOE, seq_len=SEQ_LEN).config
    assert build_from_hf({**QWEN3_MOE, "num_local_experts": 4}, seq_len=SEQ_LEN).config.n_experts == 4
    with pytest.raises(ValueError, match="num_local_experts=4 disagrees with the weights, whose layer 0 holds 8"):
        check_hf_shapes(v5, {f"model.layers.{i}.mlp.experts.{e}.gate_proj.weight": (20, 32)
                             for i in range(2) for e in range(8)})


def test_an_expert_count_the_tensors_contradict_is_one_line():
    def shapes(n_experts, width=20, moe="mlp", mat="gate_proj", config=QWEN3_MOE):
        d = config["hidden_size"]
        out = {"model.embed_tokens.weight": (config["vocab_size"], d), f"model.layers.0.{moe}.gate.weight": (n_experts, d)}
        out.update({f"model.layers.{i}.{moe}.experts.{e}.{mat}.weight": (width, d)
                    for i in range(2) for e in range(n_experts)})
        return out
    check_hf_shapes(QWEN3_MOE, shapes(4))
    with pytest.raises(ValueError, match="num_experts=4 disagrees with the weights, whose layer 0 holds 8 experts; "
                                         "set num_experts to 8") as err:
        check_hf_shapes(QWEN3_MOE, shapes(8))
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="moe_intermediate_size=20 disagrees with the weights"):
        check_hf_shapes(QWEN3_MOE, shapes(4, width=24))
    with pytest.raises(ValueError, match="num_local_experts=4 disagrees with the weights, whose layer 0 holds 3"):
        check_hf_shapes(MIXTRAL, shapes(3, 28, "block_sparse_moe", "w1", MIXTRAL))
    # a hostile count: compared with the weights without ranging over it (set(range(10**12)) ran out of memory)
    with pytest.raises(ValueError, match="num_experts=1000000000000 disagrees with the weights, whose layer 0 holds 4"):
        check_hf_shapes({**QWEN3_MOE, "num_experts": 10**12}, shapes(4))


def test_moe_presets_have_the_published_parameter_counts():
    """Qwen3-30B-A3B 30.5B, Qwen3-235B-A22B 235B, Mixtral-8x7B 46.7B: every tensor counted from the
    published shapes; the FLOPs count the k routed experts a token meets."""
    from pstar_models.llama import StagedLlama, preset
    published = {"qwen3-30b-a3b": 30_532_122_624, "qwen3-235b-a22b": 235_093_634_560, "mixtral-8x7b": 46_702_792_704}
    for name, count in published.items():
        model = StagedLlama(preset(name))
        c = model.config
        assert model.n_params() == count, name
        active = count - c.n_layer * (c.n_experts - c.n_experts_per_tok) * 3 * c.d_model * c.expert_width
        lookup = c.vocab_size * c.d_model
        assert model.flops_per_token() == 6.0 * (active - lookup) + 6.0 * c.n_layer * c.seq_len * c.n_head * c.d_head


def test_experts_keep_to_chunks_of_their_own_and_the_plan_reports_their_share():
    """No chunk holds an expert's weights beside attention's or the router's; pstar-plan's report
    names the experts' chunks and their share of model data."""
    from pstar_jax.engine.chunks import build_layout
    from pstar_jax.model.staged import chunk_group, chunk_groups
    model = build_from_hf(MIXTRAL, seq_len=SEQ_LEN)
    shapes = model.param_shapes()
    layout = build_layout(shapes, model.decays, {"trainable": 2500}, group=lambda n: chunk_group(model, n))
    by_chunk = {}
    for s in layout.slots:
        by_chunk.setdefault(s.chunk, set()).add(".mlp.experts." in s.name)
    assert all(len(kinds) == 1 for kinds in by_chunk.values())
    experts = chunk_groups(model, layout.slots)["experts"]
    assert set(experts) == {c for c, kinds in by_chunk.items() if True in kinds} and len(experts) >= 2
    mixed = build_layout(shapes, model.decays, {"trainable": 2500})  # without groups the experts share chunks
    assert any(len({".mlp.experts." in s.name for s in mixed.slots if s.chunk == c}) == 2
               for c in range(mixed.n_chunks))
    from jax.sharding import Mesh
    import pstar_jax as ps
    from pstar_jax.plan.machine import H200
    report = ps.plan_report(model, ps.EngineConfig(device_memory=2**30), 2, Mesh(np.array(jax.devices()[:1]), ("data",)),
                            H200, 2**30)
    chunks = report.groups["experts"]
    expert_params = sum(s.n_params for s in report.planned.layout.slots if ".mlp.experts." in s.name)
    assert expert_params == 2 * 4 * 3 * 36 * 28 and report.group_bytes("experts") >= 14 * expert_params  # bf16 + state
    assert report.to_json()["chunk_groups"]["experts"] == {"n_chunks": len(chunks), "bytes": report.group_bytes("experts")}
    line = next(line for line in report.lines() if line.startswith("experts: "))
    assert f"{len(chunks)} chunks of their own" in line and "once per pass" in line


# 8 experts, one per token, few tokens a step: some expert gets no token in some steps. (Not
# renormalised: a lone choice renormalised weighs exactly 1, so the router would get no gradient
# but rounding noise, which Adam scales up to full-size steps differently on either side.)
SPARSE = {**QWEN3_MOE, "num_experts": 8, "num_experts_per_tok": 1, "norm_topk_prob": False}
TRAINED = {"qwen3_moe": QWEN3_MOE, "qwen3_moe_top1_of_8": SPARSE, "mixtral": MIXTRAL,
           # The routers' load-balancing loss added (a coefficient large enough that its gradient
           # shows); Qwen3-MoE with a dense last layer, whose MLP has no router to count and which
           # passes the stats on to the head.
           "qwen3_moe_aux_loss_dense_layer_1": {**QWEN3_MOE, "output_router_logits": True, "router_aux_loss_coef": 0.3,
                                                "mlp_only_layers": [1]},
           "mixtral_aux_loss": {**MIXTRAL, "output_router_logits": True, "router_aux_loss_coef": 0.3}}


@pytest.mark.hf_reference
@pytest.mark.parametrize("config", TRAINED.values(), ids=TRAINED.keys())
def test_ten_fp32_steps_under_chunk_eviction_equal_transformers_and_torch_adamw(config):
    """The chunked engine, its chunks moving every step, against transformers' model trained by
    torch.optim.AdamW on the same batches (fp32, no clipping, the same warmup-cosine schedule,
    decay on matrices only): equal losses at every step and equal params after ten.

    An expert no token chose has a zero gradient here, and AdamW still decays its moments and
    its weights: that is torch AdamW over transformers 5.x, whose experts are one fused tensor.
    transformers 4.57 runs only the experts a token chose, so the others' .grad stays None and
    torch skips them: the reference then fills those grads with zeros, as 5.x has them.

    With output_router_logits the loss is transformers' own when training: the language-model
    loss plus router_aux_loss_coef times its aux_loss (load_balancing_loss_func over the sparse
    layers' router logits), which the engine reports as aux_loss.

    The weights come from a fixed torch seed (transformers initialises from torch's global
    generator), so a case does not depend on which tests ran before it: Adam divides each
    element's gradient by its own scale, so an element whose gradient falls near rounding noise
    by chance (an embedding element's 1e-7 against terms of 1e-2, in some weight draws) ends ten
    steps up to 1e-5 apart on the two sides, past this check's 2e-6."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    from torch_adamw import assert_trained_alike, chunked_and_reference
    B, T, steps = 2, 8, 10
    hf_model, model, engine, opt, lr_at = chunked_and_reference(config, B, T)
    params = list(hf_model.parameters())
    rng = np.random.default_rng(1)
    unrouted, ours, theirs, aux_theirs = 0, [], [], []
    for _ in range(steps):
        seq = rng.integers(0, config["vocab_size"], (B, T + 1)).astype(np.int32)
        ours.append(engine.step([(seq[:, :-1], seq[:, 1:])]))
        opt.zero_grad(set_to_none=True)
        out = hf_model(torch.from_numpy(seq[:, :-1]).long(), output_router_logits=True)
        loss = torch.nn.functional.cross_entropy(out.logits.reshape(-1, out.logits.shape[-1]),
                                                 torch.from_numpy(seq[:, 1:]).long().reshape(-1))
        if config["output_router_logits"]:
            assert len(out.router_logits) == len(model.config.sparse_layers)
            loss = loss + config["router_aux_loss_coef"] * out.aux_loss
            aux_theirs.append(float(out.aux_loss.detach()))
        loss.backward()
        k = config["num_experts_per_tok"]
        chosen = [set(torch.topk(logits, k, dim=-1).indices.reshape(-1).tolist()) for logits in out.router_logits]
        unrouted += sum(len(chosen_i) < model.config.n_experts for chosen_i in chosen)
        for p in params:
            if p.grad is None:  # transformers 4.57: an expert no token chose
                p.grad = torch.zeros_like(p)
        opt.step()
        lr_at.step()
        theirs.append(float(loss.detach()))
    if config is SPARSE:
        assert unrouted > 0, "the case meant to leave an expert without a token routed every one"
    assert_trained_alike(engine, model, hf_model, ours, theirs)
    if config["output_router_logits"]:  # aux near k (balanced routing): a few ulps of it
        np.testing.assert_allclose([r.metrics["aux_loss"] for r in ours], aux_theirs, rtol=2e-6)
    else:
        assert all("aux_loss" not in r.metrics for r in ours)


def test_a_lora_run_over_experts_exports_its_adapter_and_the_merged_model(tmp_path, capsys):
    """pstar-train --lora-rank on a Mixtral checkpoint with --lora-targets naming the experts: the
    adapter (attention's projections and each expert's three matrices; the router frozen) and the
    merged model are written (both once ended in a KeyError); the experts' adapters trained and
    merged, the router kept as it was."""
    from safetensors.numpy import load_file
    from test_hf import lora_run_exports
    source, config = lora_run_exports(tmp_path, MIXTRAL, capsys, extra=("--lora-targets", "attn.*,mlp.experts.*"))
    assert config["target_modules"] == ["k_proj", "o_proj", "q_proj", "v_proj", "w1", "w2", "w3"]
    adapter = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    n_experts, n_layer = MIXTRAL["num_local_experts"], MIXTRAL["num_hidden_layers"]
    assert len(adapter) == 2 * n_layer * (4 + 3 * n_experts)
    assert not any(".gate." in k for k in adapter)  # the router
    merged = load_file(tmp_path / "merged" / "model.safetensors")
    assert set(merged) == set(source)
    router = "model.layers.1.block_sparse_moe.gate.weight"
    np.testing.assert_array_equal(merged[router], source[router])  # frozen: the source's own values
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.block_sparse_moe.experts.2.w3.weight"):
        assert not np.array_equal(merged[name], source[name]), name


@pytest.mark.parametrize("n_tokens,k,n_experts", [(1024, 2, 8), (2048, 8, 128)])
def test_grouped_experts_compile_to_about_the_routed_pairs_flops(n_tokens, k, n_experts):
    """What XLA compiles (the trace's count, pstar_jax.model.flops) is at most 1.5x the routed
    pairs' own matmul FLOPs plus the tiles' rounding, never the E/k times of a dense expansion
    (jax.lax.ragged_dot's on the CPU)."""
    from pstar_jax.model.flops import call_flops
    D, I = 64, 32
    keys = jax.random.split(jax.random.key(0), 5)
    x = jax.random.normal(keys[0], (n_tokens, D))
    gate, up = jax.random.normal(keys[1], (n_experts, D, I)), jax.random.normal(keys[2], (n_experts, D, I))
    down = jax.random.normal(keys[3], (n_experts, I, D))
    _, chosen = route(jax.random.normal(keys[4], (n_tokens, n_experts)), k, True, x.dtype)
    _, flops = call_flops(jax.jit(lambda *a: grouped_swiglu(x, chosen, *a)), gate, up, down)
    pairs = 3 * 2 * n_tokens * k * D * I
    assert pairs <= flops <= 1.6 * pairs


@pytest.mark.skipif(len(jax.devices()) < 8, reason="needs conftest's 8 fake devices")
@pytest.mark.parametrize("aux", [False, True], ids=["", "aux_loss"])
def test_zero_over_8_devices_trains_a_mixture_of_experts_as_one_device_does(aux):
    """Routing is per token, so each device routes its own rows: the sharded step equals one
    device's (fp32, two micro-batches, chunks moving). The routers' load-balancing loss is one
    per micro-batch over all its rows, every device's counts summed, not one per device."""
    from frozen_engines import chunked
    from pstar_jax.config import OptimConfig
    optim = OptimConfig(lr=3e-3, warmup_steps=1, total_steps=4, weight_decay=0.1, clip_norm=1.0)
    model = build_from_hf({**MIXTRAL, "output_router_logits": aux, "router_aux_loss_coef": 0.3}, seq_len=8)
    one, eight = (chunked(model, frozenset(), batch=8, seq=8, optim=optim, chunk=None, micro_batches=2, W=W)
                  for W in (1, 8))
    last, _ = steps_agree(one, eight, MIXTRAL["vocab_size"], (2, 8, 9), 3, 3, 1e-5)
    assert ("aux_loss" in last.metrics) == aux
    for name, value in one.params().items():
        np.testing.assert_allclose(eight.params()[name], value, rtol=0, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("rate", [0.0, 0.4])
def test_expert_adapters_add_what_each_experts_own_lora_linear_adds(rate):
    """LoRA on every expert's three matrices: the grouped branch equals, token by token, the routed
    experts' own LoraLinear SwiGLU (dropout masks included, drawn from the token's seed and the
    projection's path), weighted as the router says; with lora_b zero it adds exactly nothing."""
    from flax import nnx
    from pstar_models.llama_config import LlamaConfig
    from pstar_models.lora import LoraSpec, project
    from pstar_models.moe import SparseMoE
    from pstar_jax.model.tiling import TileBudget
    config = LlamaConfig(vocab_size=64, d_model=16, n_layer=1, n_head=2, n_kv_head=1, d_ff=8, seq_len=8,
                         family="mixtral", n_experts=4, n_experts_per_tok=2,
                         lora=LoraSpec(rank=3, alpha=6.0, dropout=rate, targets=("mlp.experts.*",)))
    moe = SparseMoE(config, 0.02, rngs=nnx.Rngs(0), tiling=TileBudget())
    x_BxTxD = jax.random.normal(jax.random.key(1), (2, 5, 16))
    seeds_BxT = jax.random.bits(jax.random.key(2), (2, 5), jnp.uint32)
    without = moe.plain(x_BxTxD, seeds_BxT)
    rng = np.random.default_rng(3)
    for expert in moe.experts:
        for m in ("gate", "up", "down"):
            b = getattr(expert, m).lora.lora_b
            b[...] = jnp.asarray(rng.standard_normal(b[...].shape), jnp.float32)
    ours = np.asarray(moe.plain(x_BxTxD, seeds_BxT))

    x_NxD, seeds_N = x_BxTxD.reshape(10, 16), seeds_BxT.reshape(10)
    weights_NxK, experts_NxK = route(moe.router(x_NxD), 2, True, x_NxD.dtype)
    every_expert = []  # each expert's LoraLinear SwiGLU over every token: [E, N, D]
    for e in moe.experts:
        h = jax.nn.silu(project(e.gate, x_NxD[None], seeds_N[None])) * project(e.up, x_NxD[None], seeds_N[None])
        every_expert.append(project(e.down, h, seeds_N[None])[0])
    chosen_NxKxD = jnp.stack(every_expert)[experts_NxK, jnp.arange(10)[:, None]]
    want = np.asarray(jnp.sum(weights_NxK[..., None] * chosen_NxKxD, axis=1))
    np.testing.assert_allclose(ours.reshape(10, 16), want, rtol=0, atol=32 * EPS32 * float(np.abs(want).max()))
    assert np.abs(ours - np.asarray(without)).max() > 0.1  # the adapters matter; with lora_b zero:
    np.testing.assert_array_equal(np.asarray(without), np.asarray(
        SparseMoE(dataclasses.replace(config, lora=None), 0.02, rngs=nnx.Rngs(0), tiling=TileBudget()).plain(x_BxTxD)))


def test_lora_leaves_the_experts_frozen_unless_a_target_names_them():
    """No --lora-targets: attention's projections only (an adapter per expert multiplies compile
    time and trained state); 'mlp.experts.*' or a matrix of them adds the experts' adapters."""
    from pstar_models.lora import LoraSpec
    def adapted(targets):
        model = build_from_hf(MIXTRAL, seq_len=SEQ_LEN, lora=LoraSpec(rank=2, alpha=4.0, targets=targets))
        return {n.split(".", 2)[2].rsplit(".lora.", 1)[0] for n in model.param_shapes() if ".lora." in n}
    assert adapted(()) == {"attn.q", "attn.k", "attn.v", "attn.o"}
    assert adapted(("mlp.experts.*.down",)) == {f"mlp.experts.{e}.down" for e in range(4)}
    assert len(adapted(("attn.*", "mlp.experts.*"))) == 4 + 3 * 4


def test_dense_layers_among_the_experts_have_their_own_tensors_chunks_and_counts():
    """Qwen3-MoE with layer 0 in mlp_only_layers: its MLP is dense (gate/up/down of
    intermediate_size, hub names mlp.*_proj), layer 1 holds the experts; only expert tensors go to
    the experts' chunks, the FLOPs leave out the idle experts of the sparse layer alone, the
    config round-trips, and pstar-plan's experts share is layer 1's."""
    from pstar_jax.engine.chunks import build_layout
    from pstar_jax.model.staged import chunk_group, chunk_groups
    source = {**QWEN3_MOE, "mlp_only_layers": [0]}
    model = build_from_hf(source, seq_len=SEQ_LEN)
    c, shapes = model.config, model.param_shapes()
    stages = model.stages(jnp.float32)
    assert c.sparse_layers == (1,) and stages[1].apply is not stages[2].apply  # two kinds of block, two compiles
    assert shapes["blocks.0.mlp.gate.kernel"] == (32, 56) and shapes["blocks.0.mlp.down.kernel"] == (56, 32)
    assert not any(n.startswith("blocks.0.mlp.experts.") or n == "blocks.0.mlp.router.kernel" for n in shapes)
    assert shapes["blocks.1.mlp.experts.3.up.kernel"] == (32, 20) and "blocks.1.mlp.gate.kernel" not in shapes
    names = hf_tensors(model)
    assert names["blocks.0.mlp.up.kernel"].name == "model.layers.0.mlp.up_proj.weight"
    assert names["blocks.1.mlp.router.kernel"].name == "model.layers.1.mlp.gate.weight"
    exported = hf_config(model, torch_dtype="float32", source=source)
    assert exported["mlp_only_layers"] == [0] and build_from_hf(exported, seq_len=SEQ_LEN).config == c
    step = build_from_hf({**QWEN3_MOE, "num_hidden_layers": 4, "decoder_sparse_step": 2}, seq_len=SEQ_LEN)
    assert step.config.sparse_layers == (1, 3)
    assert hf_config(step, torch_dtype="float32")["decoder_sparse_step"] == 2
    # Parameters: the dense layer's 3 matrices and the sparse one's router and 4 experts.
    attention = sum(np.prod(s) for n, s in shapes.items() if n.startswith("blocks.0.") and ".mlp." not in n)
    assert model.n_params() == (2 * 109 * 32 + 32 + 2 * attention + 3 * 32 * 56 + 32 * 4 + 4 * 3 * 32 * 20)
    idle = 1 * 2 * 3 * 32 * 20  # layer 1's 2 unchosen experts of 4; layer 0 has none
    assert model.flops_per_token() == 6.0 * (model.n_params() - 109 * 32 - idle) + 6.0 * 2 * SEQ_LEN * 4 * 12
    layout = build_layout(shapes, model.decays, {"trainable": 2500}, group=lambda n: chunk_group(model, n))
    experts = set(chunk_groups(model, layout.slots)["experts"])
    assert {s.name for s in layout.slots if s.chunk in experts} == {n for n in shapes if ".mlp.experts." in n}


def steps_agree(a, b, vocab, shape_MxBxL1, steps, seed, rtol):
    """Both engines step on the same random micro-batches (``shape_MxBxL1``: micro-batches, rows,
    positions + 1) with equal losses and router losses (both None or both close); the last
    step's result of ``a`` and its micro-batches."""
    rng = np.random.default_rng(seed)
    for _ in range(steps):
        seq = rng.integers(0, vocab, shape_MxBxL1).astype(np.int32)
        batches = [(s[:, :-1], s[:, 1:]) for s in seq]
        x, y = a.step(batches), b.step(batches)
        np.testing.assert_allclose(y.loss, x.loss, rtol=rtol)
        assert x.metrics.keys() == y.metrics.keys()
        if "aux_loss" in x.metrics:
            np.testing.assert_allclose(y.metrics["aux_loss"], x.metrics["aux_loss"], rtol=rtol)
    return x, batches
