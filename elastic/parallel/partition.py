"""Pipeline stage partition, virtual (padding) layers included. Pure.

The model's ``layers`` are padded to ``slots = ceil(layers / (pp*vpp)) * pp*vpp`` so that
every pipeline chunk has the same number of slots; the padding slots are *virtual*
(empty) layers. They go to the chunks that also carry the embedding (first) and the
LM head + loss (last), so that those chunks are not the stragglers: DeepSeek-V3's 61
layers at pp16 become 64 slots, 4 per stage, with the 3 virtual slots on the last,
the first and the second-to-last stage.

Chunk ``c`` (0 <= c < pp*vpp) runs on pipeline rank ``c % pp`` (Megatron's interleaved
schedule: rank p holds chunks p, p+pp, p+2pp, ...).
"""

from __future__ import annotations

from dataclasses import dataclass

from elastic.model import ModelSpec, padded_layers


@dataclass(frozen=True)
class StagePartition:
    pp: int
    vpp: int
    slots_per_chunk: int
    chunks: tuple[tuple[int, ...], ...]  # real layer indices per chunk, chunk c on rank c % pp
    virtual: tuple[int, ...]  # virtual slots per chunk

    @property
    def num_chunks(self) -> int:
        return self.pp * self.vpp

    def layers_of_rank(self, pp_rank: int) -> tuple[int, ...]:
        """All real layers a pipeline rank holds, in model order."""
        out: list[int] = []
        for c in range(pp_rank, self.num_chunks, self.pp):
            out.extend(self.chunks[c])
        return tuple(out)

    def rank_of_layer(self, layer: int) -> int:
        for c, ls in enumerate(self.chunks):
            if layer in ls:
                return c % self.pp
        raise ValueError(f"layer {layer} not in partition")

    def stage_layers(self) -> list[int]:
        """Real layers per pipeline rank (all its chunks together)."""
        return [len(self.layers_of_rank(p)) for p in range(self.pp)]


def partition_layers(layers: int, pp: int, vpp: int = 1) -> StagePartition:
    chunks_n = pp * vpp
    if chunks_n > layers:
        raise ValueError(f"pp*vpp={pp}*{vpp}={chunks_n} chunks exceed {layers} layers")
    slots = padded_layers(layers, pp, vpp)
    per = slots // chunks_n
    n_virtual = slots - layers
    virtual = [0] * chunks_n
    # Virtual slots go to the ends first (last chunk, first chunk, then inward), one per round,
    # and never leave a chunk without a real layer.
    order: list[int] = []
    lo, hi = 0, chunks_n - 1
    while lo <= hi:
        order.append(hi)
        if lo != hi:
            order.append(lo)
        lo, hi = lo + 1, hi - 1
    while n_virtual:
        placed = False
        for c in order:
            if n_virtual and virtual[c] < per - 1:
                virtual[c] += 1
                n_virtual -= 1
                placed = True
        if not placed:  # cannot happen: slots - layers < chunks_n <= layers
            raise AssertionError("virtual slots do not fit")
    chunks: list[tuple[int, ...]] = []
    nxt = 0
    for c in range(chunks_n):
        real = per - virtual[c]
        chunks.append(tuple(range(nxt, nxt + real)))
        nxt += real
    assert nxt == layers
    return StagePartition(pp=pp, vpp=vpp, slots_per_chunk=per, chunks=tuple(chunks), virtual=tuple(virtual))


def model_partition(model: ModelSpec, pp: int, vpp: int = 1) -> StagePartition:
    return partition_layers(model.layers, pp, vpp)
