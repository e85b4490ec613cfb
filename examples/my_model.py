"""A model of your own for pstar-train: a small Flax NNX decoder made stageable in a few lines.

    pstar-train --model-module examples.my_model --model mine --steps 50

pstar_jax needs three things from the module: ``embed(tokens) -> h``, a list ``blocks`` of
identical blocks, and ``logits(h)``; ``make(rngs, n_blocks)`` builds it with that many blocks.
"""

import jax
from flax import nnx

import pstar_jax as ps


class Block(nnx.Module):
    def __init__(self, d: int, n_head: int, rngs: nnx.Rngs):
        self.norm1, self.norm2 = nnx.LayerNorm(d, rngs=rngs), nnx.LayerNorm(d, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(n_head, d, decode=False, rngs=rngs)
        self.up, self.down = nnx.Linear(d, 4 * d, rngs=rngs), nnx.Linear(4 * d, d, rngs=rngs)

    def __call__(self, h):
        x = self.norm1(h)
        h = h + self.attn(x, mask=nnx.make_causal_mask(x[..., 0]))
        return h + self.down(jax.nn.gelu(self.up(self.norm2(h))))


class MyLM(nnx.Module):
    def __init__(self, vocab: int, d: int, n_head: int, n_blocks: int, rngs: nnx.Rngs):
        self.tok = nnx.Embed(vocab, d, rngs=rngs)
        self.blocks = nnx.List([Block(d, n_head, rngs) for _ in range(n_blocks)])
        self.norm, self.out = nnx.LayerNorm(d, rngs=rngs), nnx.Linear(d, vocab, rngs=rngs)

    def embed(self, tokens):
        return self.tok(tokens)

    def logits(self, h):
        return self.out(self.norm(h))


def build_model(name: str, n_layer=4, d_model=64, n_head=4, vocab_size=256, seq_len=64, **_) -> ps.NNXStaged:
    if name != "mine":
        raise ValueError(f"unknown model preset {name!r}; this module has: mine")
    return ps.NNXStaged(lambda rngs, n: MyLM(vocab_size, d_model, n_head, n, rngs), n_layer,
                        seq_len=seq_len, vocab_size=vocab_size)
