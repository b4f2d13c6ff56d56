"""A deterministic, learnable synthetic token stream indexed by (step, sample).

What it is for: the fixed-global-batch contract. Sample ``i`` of step ``s`` is a pure
function of ``(seed, s, i)``, so every layout -- whatever its dp, micro-batch and
gradient-accumulation split -- trains on exactly the same tokens at the same step, and a
rescaled run can be compared with a never-rescaled one token for token.

The rule (learnable, so the loss visibly falls): a fixed random permutation ``perm`` of
the vocabulary; each next token is ``perm[previous]`` with probability ``1 - noise`` and
uniform otherwise. The best achievable loss is about
``-(1-noise+noise/V) ln(1-noise+noise/V) - noise (V-1)/V ln(noise/V)``: 0.86 nats for
``noise=0.1, V=256`` against ln 256 = 5.55 at random.

Must not: keep an iterator position (there is no "next batch": callers ask by index), read
files or the clock.
"""

from __future__ import annotations

import math

import torch

_MASK64 = (1 << 64) - 1


def _mix(*values: int) -> int:
    """splitmix64 over the values: a stable 63-bit seed (Python's hash() is salted per process)."""
    z = 0x9E3779B97F4A7C15
    for v in values:
        z = (z ^ (v & _MASK64)) & _MASK64
        z = (z + 0x9E3779B97F4A7C15) & _MASK64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        z ^= z >> 31
    return z & ((1 << 63) - 1)


class SyntheticData:
    """Sequences of ``seq_len + 1`` tokens following a noisy random-permutation bigram rule."""

    def __init__(self, vocab: int, seq_len: int, seed: int = 0, noise: float = 0.1) -> None:
        if not 0.0 <= noise <= 1.0:
            raise ValueError(f"noise={noise} must lie in [0, 1]")
        self.vocab, self.seq_len, self.seed, self.noise = vocab, seq_len, seed, noise
        g = torch.Generator().manual_seed(_mix(seed, 0x5EED))
        self.perm = torch.randperm(vocab, generator=g)
        self._perm = self.perm.tolist()

    def sample(self, step: int, index: int) -> torch.Tensor:
        """Tokens ``[seq_len + 1]`` of global sample ``index`` at ``step``."""
        g = torch.Generator().manual_seed(_mix(self.seed, step, index))
        n = self.seq_len + 1
        random_tok = torch.randint(self.vocab, (n,), generator=g).tolist()
        keep = (torch.rand(n, generator=g) >= self.noise).tolist()
        out = [random_tok[0]]
        for t in range(1, n):
            out.append(self._perm[out[-1]] if keep[t] else random_tok[t])
        return torch.tensor(out, dtype=torch.long)

    def batch(self, step: int, start: int, count: int, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each ``[count, seq_len]``, of samples ``start .. start+count-1``."""
        return self.samples(step, list(range(start, start + count)), device)

    def samples(self, step: int, indices: list[int], device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each ``[len(indices), seq_len]``, of the global samples ``indices``."""
        seqs = torch.stack([self.sample(step, i) for i in indices])
        return seqs[:, :-1].to(device), seqs[:, 1:].to(device)

    def entropy_floor(self) -> float:
        """The lowest expected loss (nats/token) any model can reach on this stream."""
        v, e = self.vocab, self.noise
        p_hit = 1 - e + e / v
        p_miss = e / v
        return -(p_hit * math.log(p_hit) + (v - 1) * p_miss * math.log(p_miss)) if e > 0 else 0.0
