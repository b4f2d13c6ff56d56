"""A small Llama-style decoder written the way a user writes one in plain PyTorch.

It is the model our resharding tests, examples and benchmarks train: the module tree and
parameter names follow torchtitan's llama3 (``tok_embeddings``, ``layers.<i>.attention.wq``,
``layers.<i>.feed_forward.w1``, ``norm``, ``output``), so a parallelization plan written
for torchtitan applies unchanged (see ``parallel.py``).

It must not import anything from ``elastic`` nor from ``torch.distributed``: it stands for
the user's own code, which knows nothing about meshes or resharding. Every shape it needs
at run time comes from the tensors it is given (head counts through ``-1`` in ``view``),
so the same code runs on a tensor-parallel shard that holds only some of the heads.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaConfig:
    vocab: int = 256
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_hidden: int = 128
    max_seq_len: int = 32
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        problems = []
        if self.dim % self.n_heads:
            problems.append(f"dim {self.dim} is not a multiple of n_heads {self.n_heads}")
        elif (self.dim // self.n_heads) % 2:
            problems.append(f"head_dim {self.dim} / {self.n_heads} = {self.dim // self.n_heads} is odd; "
                            "RoPE rotates pairs")
        if self.n_heads % self.n_kv_heads:
            problems.append(f"n_heads {self.n_heads} is not a multiple of n_kv_heads {self.n_kv_heads} "
                            "(GQA groups)")
        for name in ("vocab", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_hidden", "max_seq_len"):
            if getattr(self, name) < 1:
                problems.append(f"{name} = {getattr(self, name)} < 1")
        if problems:
            raise ValueError("LlamaConfig: " + "; ".join(problems))

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def num_params(self) -> int:
        """Parameter count (a tied output head counted once)."""
        kv = self.n_kv_heads * self.head_dim
        block = 2 * self.dim * self.dim + 2 * self.dim * kv + 3 * self.dim * self.ffn_hidden + 2 * self.dim
        head = 0 if self.tie_embeddings else self.vocab * self.dim
        return self.vocab * self.dim + self.n_layers * block + self.dim + head

    def max_tp(self) -> int:
        """The largest tensor-parallel degree that splits every sharded dimension evenly."""
        dims = (self.n_heads, self.n_kv_heads, self.ffn_hidden, self.vocab)
        return math.gcd(*dims)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def tiny(cls) -> LlamaConfig:
        """Byte vocabulary, two blocks: small enough to train in float64 on a few CPU processes.

        4 query heads over 2 key/value heads: tensor parallel up to 2.
        """
        return cls(vocab=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=128, max_seq_len=32)

    @classmethod
    def bench_1g(cls) -> LlamaConfig:
        """About 100M parameters: fp32 parameters plus Adam's two moments take just over 1 GiB.

        12 query heads over 4 key/value heads and a vocabulary of 2**14: tensor parallel up to 4.
        """
        return cls(vocab=16384, dim=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_hidden=2048,
                   max_seq_len=1024)


# --------------------------------------------------------------------------------------------
# Rotary position embedding
# --------------------------------------------------------------------------------------------


def precompute_freqs_cis(head_dim: int, max_seq_len: int, theta: float) -> torch.Tensor:
    """``(max_seq_len, head_dim // 2, 2)``: cos and sin of every position's rotation angles.

    Real rather than complex (torchtitan keeps a complex table) because ``Module.to(dtype)``
    would cast a complex buffer to a real dtype and silently drop its imaginary part.
    Computed in float64 so a float64 model gets a float64-exact table.
    """
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)
    return torch.stack((angles.cos(), angles.sin()), dim=-1)


def apply_rotary_emb(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs of ``x`` (bs, seq, heads, head_dim) by the angles of its positions.

    The pairs are (0, 1), (2, 3), ... as in Meta's reference and torchtitan (``view_as_complex``
    of the last dimension). The number of heads is whatever ``x`` holds: on a tensor-parallel
    shard it is the local count.
    """
    seqlen = x.shape[1]
    freqs = freqs_cis[:seqlen].to(x.dtype)
    cos, sin = freqs[..., 0].unsqueeze(1), freqs[..., 1].unsqueeze(1)  # (seq, 1, head_dim/2)
    pairs = x.unflatten(-1, (-1, 2))
    real, imag = pairs[..., 0], pairs[..., 1]
    return torch.stack((real * cos - imag * sin, real * sin + imag * cos), dim=-1).flatten(-2)


# --------------------------------------------------------------------------------------------
# Blocks
# --------------------------------------------------------------------------------------------


class Attention(nn.Module):
    """Causal grouped-query attention with RoPE; no biases."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        bs, seqlen, _ = x.shape
        # -1, not n_heads: under tensor parallel wq/wk/wv produce only this rank's heads
        q = self.wq(x).view(bs, seqlen, -1, self.head_dim)
        k = self.wk(x).view(bs, seqlen, -1, self.head_dim)
        v = self.wv(x).view(bs, seqlen, -1, self.head_dim)
        q, k = apply_rotary_emb(q, freqs_cis), apply_rotary_emb(k, freqs_cis)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (bs, heads, seq, head_dim)
        # causal SDPA rather than FlexAttention: FlexAttention has no CPU backward
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=q.shape[1] != k.shape[1])
        return self.wo(out.transpose(1, 2).reshape(bs, seqlen, -1))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1 x) * w3 x)``."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, cfg: LlamaConfig, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.attention_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """Token ids (bs, seq) -> logits (bs, seq, vocab).

    ``layers`` is a ModuleDict keyed "0", "1", ... so a pipeline stage can drop the blocks it
    does not run and keep every other name; ``tok_embeddings``, ``norm`` and ``output`` may be
    None on such a stage (then the stage takes or returns hidden states).
    """

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(cfg, i) for i in range(cfg.n_layers)})
        self.norm: nn.RMSNorm | None = nn.RMSNorm(cfg.dim, eps=cfg.norm_eps)
        self.output: nn.Linear | None = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        if cfg.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        # not persistent: derived from the config, so no checkpoint or reshard carries it
        self.register_buffer("freqs_cis", precompute_freqs_cis(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
                             .to(torch.get_default_dtype()), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h, self.freqs_cis)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h

    @torch.no_grad()
    def init_weights(self, seed: int = 0) -> Llama:
        """Deterministic weights: the same ``seed`` gives bitwise the same values in every process.

        Each parameter draws from its own generator, seeded from ``seed`` and its name, so the
        values do not depend on which other parameters exist (a pipeline stage that holds only
        some blocks gets the same values as the full model) nor on the model's dtype (values are
        drawn in float32 and then cast). Call it on the plain model, before parallelizing.
        The std follows torchtitan: 0.02, output projections of block ``i`` scaled by
        ``1/sqrt(2 (i + 1))``, the output head ``dim**-0.5``.
        """
        cfg = self.cfg
        self.freqs_cis.copy_(precompute_freqs_cis(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta))
        for name, p in self.named_parameters():  # a tied weight is listed once, under its first name
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            std = 0.02
            if name.endswith(("attention.wo.weight", "feed_forward.w2.weight", "feed_forward.w3.weight")):
                std = 0.02 / math.sqrt(2 * (int(name.split(".")[1]) + 1))
            elif name == "output.weight":
                std = self.cfg.dim ** -0.5
            elif name == "tok_embeddings.weight":
                std = 1.0
            g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
            value = torch.empty(p.shape, dtype=torch.float32)
            nn.init.trunc_normal_(value, mean=0.0, std=std, a=-3 * std, b=3 * std, generator=g)
            p.copy_(value)
        return self
