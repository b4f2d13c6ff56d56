"""A small self-contained GPT decoder for the reference replica (CPU, random weights).

It exists to generate real tokens with real compute so the serving path (batching, queueing,
metrics) is honest; it is not a training model (``elastic.train`` owns that). Byte-level
tokens: the ``tiny`` preset has a 256-entry vocabulary, so text is UTF-8 bytes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from elastic.model import ModelSpec


class _Block(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.heads, self.kv_heads = spec.heads, spec.kv_heads
        self.head_dim = spec.hidden // spec.heads
        self.norm1 = nn.LayerNorm(spec.hidden)
        self.q = nn.Linear(spec.hidden, spec.hidden, bias=False)
        self.kv = nn.Linear(spec.hidden, 2 * spec.kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(spec.hidden, spec.hidden, bias=False)
        self.norm2 = nn.LayerNorm(spec.hidden)
        self.up = nn.Linear(spec.hidden, 2 * spec.ffn_hidden, bias=False)  # gate and up (SwiGLU)
        self.down = nn.Linear(spec.ffn_hidden, spec.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, h = x.shape
        y = self.norm1(x)
        q = self.q(y).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(y).view(b, t, 2, self.kv_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        rep = self.heads // self.kv_heads  # grouped-query attention: share each k/v head
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(att.transpose(1, 2).reshape(b, t, h))
        gate, up = self.up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class TinyGPT(nn.Module):
    def __init__(self, spec: ModelSpec, max_positions: int = 256, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.spec, self.max_positions = spec, max_positions
        self.embed = nn.Embedding(spec.vocab, spec.hidden)
        self.pos = nn.Embedding(max_positions, spec.hidden)
        self.blocks = nn.ModuleList(_Block(spec) for _ in range(spec.layers))
        self.norm = nn.LayerNorm(spec.hidden)
        self.head = nn.Linear(spec.hidden, spec.vocab, bias=False)
        self.eval()

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.embed(tokens) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    @torch.no_grad()
    def next_tokens(self, seqs: list[list[int]]) -> list[int]:
        """One decoding step for a batch of sequences of different lengths (greedy).

        Sequences are right-padded; causal attention keeps padding out of every real
        position, so each sequence's logits are read at its own last position.
        """
        lengths = [len(s) for s in seqs]
        batch = torch.zeros(len(seqs), max(lengths), dtype=torch.long)
        for i, s in enumerate(seqs):
            batch[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        logits = self(batch)
        last = logits[torch.arange(len(seqs)), torch.tensor(lengths) - 1]
        return last.argmax(dim=-1).tolist()


def encode(text: str, vocab: int) -> list[int]:
    return [b % vocab for b in text.encode("utf-8")] or [0]


def decode(tokens: list[int]) -> str:
    return bytes(t % 256 for t in tokens).decode("utf-8", errors="replace")
