"""The torch side of the fp32 training-step tests: transformers' model trained by torch.optim.AdamW
as pstar_jax's OptimConfig trains (decay on matrices only, optax's warmup-cosine schedule), and
the check that the engine's params equal the model's after the steps."""

import numpy as np


OPTIM = dict(lr=3e-3, warmup_steps=2, total_steps=10, weight_decay=0.1, clip_norm=None)


def chunked_and_reference(config, batch, seq):
    """For a config.json: transformers' model (random weights) and the chunked engine holding the
    same weights (chunks moving), with torch AdamW set up for the model: (hf_model, model, engine,
    optimizer, scheduler)."""
    from frozen_engines import chunked
    from pstar_jax.config import OptimConfig
    from pstar_models import build_from_hf
    from test_hf_models import hf_reference, saved_state, to_pstar
    optim = OptimConfig(**OPTIM)
    hf_model = hf_reference(config).train()
    model = build_from_hf(config, seq_len=seq)
    engine = chunked(model, frozenset(), batch=batch, seq=seq, optim=optim, chunk=None,
                     init_params=to_pstar(model, saved_state(hf_model)))
    return (hf_model, model, engine, *torch_adamw(hf_model, optim))


def torch_adamw(hf_model, optim):
    """(optimizer, scheduler) over ``hf_model``'s parameters; call both once per step."""
    import optax
    import torch
    params = list(hf_model.parameters())
    opt = torch.optim.AdamW([{"params": [p for p in params if p.ndim >= 2], "weight_decay": optim.weight_decay},
                             {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}],
                            lr=optim.lr, betas=(optim.b1, optim.b2), eps=optim.eps)
    warmup, total = optim.schedule_steps()
    schedule = optax.warmup_cosine_decay_schedule(0.0, optim.lr, warmup, max(total, warmup + 1),
                                                  optim.lr * optim.final_lr_fraction)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: float(schedule(step)) / optim.lr)


def train_both(engine, hf_model, opt, lr_at, vocab_size, batch, seq, steps=10, low=0, seed=1):
    """``steps`` steps of the engine and of the torch model on the same random batches (tokens
    low..vocab_size-1): (the engine's step reports, torch's losses)."""
    ours = [engine.step([(tokens[:, :-1], tokens[:, 1:])])
            for tokens in batches(vocab_size, batch, seq, steps, low, seed)]
    return ours, torch_steps(hf_model, opt, lr_at, vocab_size, batch, seq, steps, low, seed)


def batches(vocab_size, batch, seq, steps, low=0, seed=1):
    rng = np.random.default_rng(seed)
    return [rng.integers(low, vocab_size, (batch, seq + 1)).astype(np.int32) for _ in range(steps)]


def torch_steps(hf_model, opt, lr_at, vocab_size, batch, seq, steps=10, low=0, seed=1):
    """train_both's torch half alone (a float64 copy of the model gives the exact trajectory)."""
    import torch
    theirs = []
    for tokens in batches(vocab_size, batch, seq, steps, low, seed):
        opt.zero_grad(set_to_none=True)
        logits = hf_model(torch.from_numpy(tokens[:, :-1]).long()).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 torch.from_numpy(tokens[:, 1:]).long().reshape(-1))
        loss.backward()
        opt.step()
        lr_at.step()
        theirs.append(float(loss.detach()))
    return theirs


def assert_trained_alike(engine, model, hf_model, ours, theirs):
    """The chunks moved every step, the losses agree to a few ulps (fp32, near log(vocab)) and so do
    the params after the last step."""
    from test_hf_models import saved_state, to_pstar
    assert all(r.h2d_bytes > 0 and r.d2h_bytes > 0 for r in ours)
    np.testing.assert_allclose([r.loss for r in ours], theirs, rtol=2e-6)
    mine = engine.params()
    for name, value in to_pstar(model, saved_state(hf_model)).items():
        np.testing.assert_allclose(mine[name], value, rtol=0, atol=2e-6, err_msg=name)
