"""Domain types shared by every part of elastic.

Pure value objects: they validate themselves (with messages that show the
arithmetic) and do no I/O beyond parsing a file a caller hands them. Runtimes
(process groups, device meshes, DB rows) are built elsewhere from these.

Conventions (see docs/DESIGN.md):

* ``Layout(tp, pp, dp, ep=1, vpp=1, zero=0)`` prints as ``tp2.pp2.dp4``; extra
  axes only when not default (``tp1.pp4.dp8.ep8.vpp2.z1``).
* Rank order is Megatron's default: tp fastest, then dp, then pp:
  ``rank = tp_rank + tp * (dp_rank + dp * pp_rank)``.
"""

from __future__ import annotations

import json
import math
import re
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator


class SpecError(ValueError):
    """Bad user input. The message names the field and the fix; CLI prints it as one line."""


# --------------------------------------------------------------------------------------------
# Model architecture
# --------------------------------------------------------------------------------------------


class MoESpec(BaseModel):
    """Mixture-of-experts block (DeepSeek/Mixtral style)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    experts: int = Field(gt=0, description="routed experts per MoE layer")
    top_k: int = Field(gt=0, description="experts active per token")
    expert_ffn_hidden: int = Field(gt=0, description="FFN width of one expert")
    shared_experts: int = Field(default=0, ge=0, description="always-active experts per MoE layer")
    dense_layers: int = Field(default=0, ge=0, description="the first N layers use a dense MLP")

    @model_validator(mode="after")
    def _check(self) -> MoESpec:
        if self.top_k > self.experts:
            raise ValueError(f"moe.top_k={self.top_k} exceeds moe.experts={self.experts}")
        return self


class MLASpec(BaseModel):
    """Multi-head latent attention (DeepSeek-V2/V3)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    q_lora_rank: int = Field(gt=0)
    kv_lora_rank: int = Field(gt=0)
    qk_nope_head_dim: int = Field(gt=0)
    qk_rope_head_dim: int = Field(gt=0)
    v_head_dim: int = Field(gt=0)


class ModelSpec(BaseModel):
    """A decoder-only transformer, described by the numbers its config file publishes.

    ``mlp="swiglu"`` (Llama: gate/up/down, no biases, RMSNorm) or ``mlp="gelu"``
    (GPT-2/3: fc1/fc2 with biases, LayerNorm with bias). ``bias`` defaults from ``mlp``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(min_length=1)
    layers: int = Field(gt=0, description="transformer layers")
    hidden: int = Field(gt=0, description="model width h")
    ffn_hidden: int = Field(gt=0, description="dense MLP width")
    heads: int = Field(gt=0, description="attention (query) heads")
    kv_heads: int = Field(gt=0, description="key/value heads (GQA); = heads for MHA")
    vocab: int = Field(gt=0, description="vocabulary size")
    seq_len: int = Field(gt=0, description="training sequence length")
    mlp: Literal["swiglu", "gelu"] = "swiglu"
    bias: bool | None = None
    tie_embeddings: bool = False
    moe: MoESpec | None = None
    mla: MLASpec | None = None

    @model_validator(mode="after")
    def _check(self) -> ModelSpec:
        if self.hidden % self.heads:
            raise ValueError(
                f"hidden={self.hidden} is not divisible by heads={self.heads} "
                f"({self.hidden}/{self.heads}={self.hidden / self.heads:.3f}); head_dim must be whole"
            )
        if self.heads % self.kv_heads:
            raise ValueError(
                f"heads={self.heads} is not a multiple of kv_heads={self.kv_heads}; "
                "GQA needs each key/value head shared by a whole number of query heads"
            )
        if self.moe and self.moe.dense_layers > self.layers:
            raise ValueError(f"moe.dense_layers={self.moe.dense_layers} exceeds layers={self.layers}")
        return self

    # ---- derived sizes --------------------------------------------------------------------
    @property
    def has_bias(self) -> bool:
        return self.bias if self.bias is not None else self.mlp == "gelu"

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def is_moe(self) -> bool:
        return self.moe is not None

    def is_moe_layer(self, layer: int) -> bool:
        return self.moe is not None and layer >= self.moe.dense_layers

    def attention_params(self) -> int:
        h, b = self.hidden, self.has_bias
        if self.mla:
            m = self.mla
            qk = m.qk_nope_head_dim + m.qk_rope_head_dim
            n = h * m.q_lora_rank + m.q_lora_rank  # q down + q norm
            n += m.q_lora_rank * self.heads * qk  # q up
            n += h * (m.kv_lora_rank + m.qk_rope_head_dim) + m.kv_lora_rank  # kv down + kv norm
            n += m.kv_lora_rank * self.heads * (m.qk_nope_head_dim + m.v_head_dim)  # kv up
            n += self.heads * m.v_head_dim * h  # out
            return n
        q = self.heads * self.head_dim
        kv = self.kv_heads * self.head_dim
        n = h * q + 2 * h * kv + q * h
        if b:
            n += q + 2 * kv + h
        return n

    def mlp_params(self, width: int) -> int:
        h = self.hidden
        if self.mlp == "swiglu":
            return 3 * h * width + (2 * width + h if self.has_bias else 0)
        return 2 * h * width + (width + h if self.has_bias else 0)

    def norm_params(self) -> int:
        return self.hidden * (2 if self.has_bias else 1)

    def layer_params(self, layer: int) -> int:
        n = self.attention_params() + 2 * self.norm_params()
        if self.is_moe_layer(layer):
            assert self.moe is not None
            f, shared = self.moe.expert_ffn_hidden, self.moe.shared_experts
            n += self.moe.experts * self.mlp_params(f)
            # The shared experts run as one MLP of width shared * f: one down-projection bias, not one each.
            n += self.mlp_params(shared * f) if shared else 0
            n += self.moe.experts * self.hidden  # router
        else:
            n += self.mlp_params(self.ffn_hidden)
        return n

    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    def total_params(self) -> int:
        n = sum(self.layer_params(i) for i in range(self.layers))
        n += self.embedding_params() * (1 if self.tie_embeddings else 2)
        n += self.norm_params()  # final norm
        return n

    def active_params(self) -> int:
        """Parameters touched per token (MoE: top_k + shared experts only)."""
        if not self.moe:
            return self.total_params()
        inactive = (self.moe.experts - self.moe.top_k) * self.mlp_params(self.moe.expert_ffn_hidden)
        return self.total_params() - inactive * (self.layers - self.moe.dense_layers)

    # ---- loading ----------------------------------------------------------------------------
    @classmethod
    def from_mapping(cls, data: Any, source: str = "model") -> ModelSpec:
        if not isinstance(data, dict):
            raise SpecError(f"{source}: expected a mapping of model fields, got {type(data).__name__}")
        try:
            return cls.model_validate(data)
        except ValidationError as e:
            raise SpecError(f"{source}: {_one_line(e)}") from None

    @classmethod
    def from_file(cls, path: str | Path, *, base_dir: str | Path | None = None) -> ModelSpec:
        """Read a model file. Only a regular file of at most ``MODEL_FILE_MAX_BYTES`` is read (a
        FIFO would hang the reader, a huge file fill its memory), inside ``base_dir`` when given
        (symbolic links resolved first); a parse error names the line, never its text."""
        p = Path(path)
        if base_dir is not None:
            root = Path(base_dir).resolve()
            where = (root / p).resolve() if not p.is_absolute() else p.resolve()
            if not where.is_relative_to(root):
                raise SpecError(f"model file {_clip(str(p), 200)}: model files are read from {root} only; put it there "
                                "or use a preset")
            p = where
        try:
            st = p.stat()
            if not stat.S_ISREG(st.st_mode):
                raise SpecError(f"model file {_clip(str(p), 200)}: not a regular file")
            if st.st_size > MODEL_FILE_MAX_BYTES:
                raise SpecError(f"model file {_clip(str(p), 200)}: {st.st_size} bytes; a model file is at most "
                                f"{MODEL_FILE_MAX_BYTES} bytes")
            with p.open("rb") as f:
                raw = f.read(MODEL_FILE_MAX_BYTES + 1)
            text = raw.decode()
        except OSError as e:
            raise SpecError(f"model file {_clip(str(p), 200)}: cannot read ({e.strerror})") from None
        except UnicodeDecodeError:
            raise SpecError(f"model file {_clip(str(p), 200)}: not UTF-8 text") from None
        try:
            if p.suffix == ".json":
                data = json.loads(text)
            else:
                data = load_yaml(text)
        except Exception as e:  # noqa: BLE001 - parse errors of any library become one line
            raise SpecError(f"model file {_clip(str(p), 200)}: not valid {p.suffix.lstrip('.') or 'YAML'}: "
                            f"{_parse_error(e)}") from None
        return cls.from_mapping(data, source=f"model file {_clip(str(p), 200)}")


def _one_line(e: ValidationError) -> str:
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"]) or "(root)"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "missing":
            parts.append(f"field '{loc}' is missing")
        elif err["type"] == "extra_forbidden":
            parts.append(f"unknown field '{loc}' (check the spelling)")
        elif not err["loc"]:  # a check across fields: its message names them
            parts.append(msg)
        else:
            parts.append(f"field '{loc}': {msg}{_got(err.get('input'))}")
    return "; ".join(parts)


def _got(value: Any) -> str:
    """`` (got X)`` for an error message: the value a user wrote, not a whole section of the file."""
    if isinstance(value, dict | list):
        return ""
    text = repr(value)
    return f" (got {text if len(text) <= 80 else text[:77] + '...'})"


def _m(name: str, layers: int, hidden: int, ffn: int, heads: int, kv: int, vocab: int, seq: int, **kw: Any) -> ModelSpec:
    return ModelSpec(
        name=name, layers=layers, hidden=hidden, ffn_hidden=ffn, heads=heads, kv_heads=kv, vocab=vocab, seq_len=seq, **kw
    )


MODEL_PRESETS: dict[str, ModelSpec] = {
    m.name: m
    for m in [
        # a few MB: unit tests and the demo's trainer
        _m("tiny", 4, 64, 176, 4, 2, 256, 32),
        # ~100M: the trainer benchmark
        _m("gpt-100m", 12, 768, 2048, 12, 12, 8192, 256),
        # GPT-3 XL (Brown et al. 2020), the Tenplex benchmark model
        _m("gpt-1.3b", 24, 2048, 8192, 16, 16, 50257, 2048, mlp="gelu", tie_embeddings=True),
        _m("llama2-7b", 32, 4096, 11008, 32, 32, 32000, 4096),
        _m("llama2-13b", 40, 5120, 13824, 40, 40, 32000, 4096),
        _m("llama2-70b", 80, 8192, 28672, 64, 8, 32000, 4096),
        _m("llama3-8b", 32, 4096, 14336, 32, 8, 128256, 8192),
        _m("llama3-70b", 80, 8192, 28672, 64, 8, 128256, 8192),
        _m("llama3-405b", 126, 16384, 53248, 128, 8, 128256, 8192),
        _m("gpt3-175b", 96, 12288, 49152, 96, 96, 51200, 2048, mlp="gelu", tie_embeddings=True),
        # Megatron-LM SC'21 Table 1 (vocab 51,200, seq 2,048, ffn 4h)
        _m("megatron-1.7b", 24, 2304, 9216, 24, 24, 51200, 2048, mlp="gelu", tie_embeddings=True),
        _m("megatron-3.6b", 30, 3072, 12288, 32, 32, 51200, 2048, mlp="gelu", tie_embeddings=True),
        _m("megatron-7.5b", 36, 4096, 16384, 32, 32, 51200, 2048, mlp="gelu", tie_embeddings=True),
        _m("megatron-18.4b", 40, 6144, 24576, 48, 48, 51200, 2048, mlp="gelu", tie_embeddings=True),
        _m("megatron-145.6b", 80, 12288, 49152, 96, 96, 51200, 2048, mlp="gelu", tie_embeddings=True),
        _m("megatron-1t", 128, 25600, 102400, 160, 160, 51200, 2048, mlp="gelu", tie_embeddings=True),
        _m(
            "deepseek-v3", 61, 7168, 18432, 128, 128, 129280, 4096,
            moe=MoESpec(experts=256, top_k=8, expert_ffn_hidden=2048, shared_experts=1, dense_layers=3),
            mla=MLASpec(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
        ),
    ]
}

# Published parameter totals the presets are tested against.
PUBLISHED_PARAMS: dict[str, float] = {
    "gpt-1.3b": 1.3e9,
    "llama2-7b": 6.74e9,
    "llama2-13b": 13.02e9,
    "llama2-70b": 68.98e9,
    "llama3-8b": 8.03e9,
    "llama3-70b": 70.55e9,
    "llama3-405b": 405.85e9,
    "gpt3-175b": 175e9,
    # Table 1's 1.7B and 3.6B labels are rounded: its own formula gives 1.65B and 3.56B,
    # which tests/test_model.py checks instead.
    "megatron-7.5b": 7.5e9,
    "megatron-18.4b": 18.4e9,
    "megatron-145.6b": 145.6e9,
    "megatron-1t": 1008.0e9,
    "deepseek-v3": 671e9,
}


MODEL_FILE_MAX_BYTES = 1 << 20
_STRICT_LOADER: Any = None


def load_yaml(text: str) -> Any:
    """``yaml.safe_load`` that refuses a key given twice in one mapping (YAML would keep the last
    silently: a setting written twice means one of them is not what the author thinks)."""
    global _STRICT_LOADER
    import yaml

    if _STRICT_LOADER is None:
        class Strict(yaml.SafeLoader):
            pass

        def mapping(loader: Any, node: Any) -> Any:
            seen: set[Any] = set()
            for key_node, _ in node.value:
                key = loader.construct_object(key_node, deep=True)
                if isinstance(key, (str, int, float, bool)) and key in seen:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key!r} is given twice (line {key_node.start_mark.line + 1}); keep one",
                        key_node.start_mark)
                seen.add(key)
            return loader.construct_mapping(node, deep=True)

        Strict.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, mapping)
        _STRICT_LOADER = Strict
    return yaml.load(text, Loader=_STRICT_LOADER)  # noqa: S506 - a SafeLoader subclass


def _parse_error(e: Exception) -> str:
    """Where a parse failed and why, without the text around it (which may be any file's content)."""
    line = getattr(e, "lineno", None)
    mark = getattr(e, "problem_mark", None)
    if line is None and mark is not None:
        line = mark.line + 1
    why = getattr(e, "msg", None) or getattr(e, "problem", None) or type(e).__name__
    return f"line {line}: {_clip(str(why), 80)}" if line is not None else _clip(str(why), 80)


def load_model(name_or_path: str, *, base_dir: str | Path | None = None) -> ModelSpec:
    """A preset name or a YAML/JSON file with the ModelSpec keys (inside ``base_dir`` when given:
    the directory model files of untrusted specs are read from)."""
    if name_or_path in MODEL_PRESETS:
        return MODEL_PRESETS[name_or_path]
    p = Path(name_or_path)
    if p.suffix in (".yaml", ".yml", ".json") or base_dir is not None or p.exists():
        return ModelSpec.from_file(p, base_dir=base_dir)
    raise SpecError(
        f"unknown model '{_clip(name_or_path)}': use a preset ({', '.join(MODEL_PRESETS)}) or a .yaml/.json file"
    )


# --------------------------------------------------------------------------------------------
# Hardware
# --------------------------------------------------------------------------------------------


class HardwareSpec(BaseModel):
    """One accelerator type and the links between them."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    memory_bytes: int = Field(gt=0, description="device memory per GPU")
    peak_flops: float = Field(gt=0, description="dense bf16 peak FLOP/s per GPU")
    intra_node_bandwidth: float = Field(gt=0, description="bytes/s per GPU inside a node (NVLink)")
    inter_node_bandwidth: float = Field(gt=0, description="bytes/s per GPU across nodes (IB/RoCE)")
    host_memory_bytes: int = Field(default=2 * 1024**4, gt=0, description="host RAM per node")
    gpus_per_node: int = Field(default=8, gt=0)


GiB = 1024**3
GB = 10**9

HARDWARE_PRESETS: dict[str, HardwareSpec] = {
    h.name: h
    for h in [
        HardwareSpec(name="a100-80g", memory_bytes=80 * GiB, peak_flops=312e12, intra_node_bandwidth=300 * GB,
                     inter_node_bandwidth=25 * GB),
        HardwareSpec(name="h100-80g", memory_bytes=80 * GiB, peak_flops=989e12, intra_node_bandwidth=450 * GB,
                     inter_node_bandwidth=50 * GB),
        HardwareSpec(name="h800-80g", memory_bytes=80 * GiB, peak_flops=989e12, intra_node_bandwidth=200 * GB,
                     inter_node_bandwidth=50 * GB),
        HardwareSpec(name="h200-141g", memory_bytes=141 * GB, peak_flops=989e12, intra_node_bandwidth=450 * GB,
                     inter_node_bandwidth=50 * GB),
        HardwareSpec(name="cpu", memory_bytes=16 * GiB, peak_flops=0.2e12, intra_node_bandwidth=4 * GB,
                     inter_node_bandwidth=1 * GB, host_memory_bytes=24 * GiB),
    ]
}


def load_hardware(name: str) -> HardwareSpec:
    try:
        return HARDWARE_PRESETS[name]
    except KeyError:
        raise SpecError(f"unknown hardware '{name}': use one of {', '.join(HARDWARE_PRESETS)}") from None


# --------------------------------------------------------------------------------------------
# Layout
# --------------------------------------------------------------------------------------------

_AXES = ("tp", "pp", "dp", "ep", "vpp", "z")


def _clip(text: str, n: int = 40) -> str:
    """At most ``n`` characters of a bad value for an error message (never the whole of a huge one)."""
    return text if len(text) <= n else f"{text[:n]}... ({len(text)} characters)"
# ASCII digits only (\d also takes other scripts' digits, which int() reads), and few of them: a degree
# of thousands of digits is no layout, only work for whoever reads it
_LAYOUT_RE = re.compile(r"^(tp|pp|dp|ep|vpp|z)([0-9]{1,6})$")


@dataclass(frozen=True, order=True)
class Layout:
    """A 3D-parallel layout. ``zero`` is 0 (replicated optimizer) or 1 (ZeRO-1 / distributed optimizer)."""

    tp: int
    pp: int
    dp: int
    ep: int = 1
    vpp: int = 1
    zero: int = 0

    def __post_init__(self) -> None:
        for axis in ("tp", "pp", "dp", "ep", "vpp"):
            v = getattr(self, axis)
            if not isinstance(v, int) or v < 1:
                raise SpecError(f"layout {axis}={v!r}: every parallel degree must be an integer >= 1")
        if self.zero not in (0, 1):
            raise SpecError(f"layout zero={self.zero!r}: only 0 (off) and 1 (ZeRO-1) are supported")
        if self.ep > 1 and (self.dp % self.ep):
            raise SpecError(
                f"layout ep={self.ep} must divide dp={self.dp} (experts are sharded inside the data-parallel group)"
            )
        if self.vpp > 1 and self.pp == 1:
            raise SpecError(f"layout vpp={self.vpp} needs pp > 1 (interleaving splits pipeline stages)")

    # ---- text form ----------------------------------------------------------------------------
    @classmethod
    def parse(cls, text: str) -> Layout:
        """``tp2.pp2.dp4`` (tp, pp, dp required; ep/vpp/z optional)."""
        if not isinstance(text, str) or not text.strip():
            raise SpecError("layout: empty; expected e.g. 'tp2.pp2.dp4'")
        vals: dict[str, int] = {}
        for part in text.strip().lower().split("."):
            m = _LAYOUT_RE.match(part)
            if not m:
                raise SpecError(f"layout '{_clip(text)}': cannot read '{_clip(part)}'; expected e.g. 'tp2.pp2.dp4' (axes "
                                f"{', '.join(_AXES)}, each with a degree of 1 to 6 ASCII digits)")
            axis, num = m.group(1), int(m.group(2))
            if axis in vals:
                raise SpecError(f"layout '{text}': axis '{axis}' given twice")
            vals[axis] = num
        missing = [a for a in ("tp", "pp", "dp") if a not in vals]
        if missing:
            raise SpecError(f"layout '{text}': missing {', '.join(missing)}; expected e.g. 'tp2.pp2.dp4'")
        for axis, v in vals.items():
            if v < 1 and axis != "z":
                raise SpecError(f"layout '{text}': {axis}{v} is invalid; every degree must be >= 1")
        return cls(tp=vals["tp"], pp=vals["pp"], dp=vals["dp"], ep=vals.get("ep", 1), vpp=vals.get("vpp", 1),
                   zero=vals.get("z", 0))

    def __str__(self) -> str:
        s = f"tp{self.tp}.pp{self.pp}.dp{self.dp}"
        if self.ep != 1:
            s += f".ep{self.ep}"
        if self.vpp != 1:
            s += f".vpp{self.vpp}"
        if self.zero:
            s += f".z{self.zero}"
        return s

    def held(self) -> Layout:
        """How keepers hold a paused job's state: the same model-parallel split, one data-parallel copy
        (``tp.pp.dp1``; ZeRO-1 shards gather into it)."""
        return Layout(self.tp, self.pp, 1, vpp=self.vpp)

    # ---- ranks --------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.dp

    def rank(self, tp_rank: int, dp_rank: int, pp_rank: int) -> int:
        return tp_rank + self.tp * (dp_rank + self.dp * pp_rank)

    def coords(self, rank: int) -> tuple[int, int, int]:
        """``(tp_rank, dp_rank, pp_rank)`` of a global rank."""
        if not 0 <= rank < self.world_size:
            raise SpecError(f"rank {rank} outside layout {self} (world size {self.world_size})")
        tp_rank = rank % self.tp
        dp_rank = (rank // self.tp) % self.dp
        pp_rank = rank // (self.tp * self.dp)
        return tp_rank, dp_rank, pp_rank

    def tp_group(self, rank: int) -> list[int]:
        _, d, p = self.coords(rank)
        return [self.rank(t, d, p) for t in range(self.tp)]

    def dp_group(self, rank: int) -> list[int]:
        t, _, p = self.coords(rank)
        return [self.rank(t, d, p) for d in range(self.dp)]

    def pp_group(self, rank: int) -> list[int]:
        t, d, _ = self.coords(rank)
        return [self.rank(t, d, p) for p in range(self.pp)]

    def ep_group(self, rank: int) -> list[int]:
        """Ranks that together hold all experts: consecutive dp ranks within one block of ``ep``."""
        t, d, p = self.coords(rank)
        base = d - d % self.ep
        return [self.rank(t, base + e, p) for e in range(self.ep)]

    def all_tp_groups(self) -> list[list[int]]:
        return [self.tp_group(self.rank(0, d, p)) for p in range(self.pp) for d in range(self.dp)]

    def all_dp_groups(self) -> list[list[int]]:
        return [self.dp_group(self.rank(t, 0, p)) for p in range(self.pp) for t in range(self.tp)]

    def all_pp_groups(self) -> list[list[int]]:
        return [self.pp_group(self.rank(t, d, 0)) for d in range(self.dp) for t in range(self.tp)]

    def with_(self, **kw: int) -> Layout:
        d = {k: getattr(self, k) for k in ("tp", "pp", "dp", "ep", "vpp", "zero")}
        d.update(kw)
        return Layout(**d)


def check_layout(model: ModelSpec, layout: Layout, gpus_per_node: int | None = None) -> None:
    """Raise SpecError if ``model`` cannot be split by ``layout`` (the message shows the arithmetic)."""
    if model.heads % layout.tp:
        raise SpecError(
            f"layout {layout}: tp={layout.tp} does not divide heads={model.heads} of {model.name} "
            f"({model.heads} % {layout.tp} = {model.heads % layout.tp}); pick tp from "
            f"{[d for d in range(1, model.heads + 1) if model.heads % d == 0 and model.kv_heads % d == 0][:8]}"
        )
    if model.kv_heads % layout.tp and not model.mla:
        raise SpecError(
            f"layout {layout}: tp={layout.tp} does not divide kv_heads={model.kv_heads} of {model.name} "
            f"({model.kv_heads} % {layout.tp} = {model.kv_heads % layout.tp})"
        )
    if gpus_per_node is not None and layout.tp > gpus_per_node:
        raise SpecError(
            f"layout {layout}: tp={layout.tp} exceeds gpus_per_node={gpus_per_node}; a TP group never spans nodes"
        )
    chunks = layout.pp * layout.vpp
    if chunks > model.layers:
        raise SpecError(
            f"layout {layout}: pp*vpp={layout.pp}*{layout.vpp}={chunks} pipeline chunks exceed the "
            f"{model.layers} layers of {model.name}; every chunk needs at least one real layer"
        )
    if layout.ep > 1:
        if not model.moe:
            raise SpecError(f"layout {layout}: ep={layout.ep} but {model.name} has no experts")
        if model.moe.experts % layout.ep:
            raise SpecError(
                f"layout {layout}: ep={layout.ep} does not divide experts={model.moe.experts} "
                f"({model.moe.experts} % {layout.ep} = {model.moe.experts % layout.ep})"
            )


def padded_layers(layers: int, pp: int, vpp: int = 1) -> int:
    """Layer slots after virtual padding: the next multiple of ``pp*vpp`` at or above ``layers``,
    allowing at most ``pp*vpp - 1`` virtual (empty) slots. DeepSeek-V3: 61 layers, pp16 -> 64 slots."""
    chunks = pp * vpp
    return math.ceil(layers / chunks) * chunks


# --------------------------------------------------------------------------------------------
# Workload specs (kept small; later issues extend them)
# --------------------------------------------------------------------------------------------


class _Spec(BaseModel):
    # no inf or NaN in any float field (1e999 reads as inf): they would only fail later, deep inside
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True, allow_inf_nan=False)


class ScalingPolicy(_Spec):
    """One HPA v2 rate policy."""

    type: Literal["Pods", "Percent"]
    value: int = Field(gt=0)
    period_seconds: int = Field(gt=0, le=1800, alias="periodSeconds")


class ScalingRules(_Spec):
    """HPA v2 ``behavior.scaleUp`` / ``behavior.scaleDown``."""

    stabilization_window_seconds: int | None = Field(default=None, ge=0, le=3600, alias="stabilizationWindowSeconds")
    select_policy: Literal["Max", "Min", "Disabled"] = Field(default="Max", alias="selectPolicy")
    policies: list[ScalingPolicy] | None = None
    # HPA v2 (Kubernetes 1.33+) per-direction tolerance; None = the HPA's cluster default 0.1.
    tolerance: float | None = Field(default=None, ge=0, lt=1)


class Behavior(_Spec):
    scale_up: ScalingRules | None = Field(default=None, alias="scaleUp")
    scale_down: ScalingRules | None = Field(default=None, alias="scaleDown")


class MetricTarget(_Spec):
    """What to measure and the value per replica (or in total) to hold it at."""

    preset: str | None = Field(default=None, description="e.g. 'vllm-running', 'sglang-queue', 'request-rate'")
    query: str | None = Field(default=None, description="PromQL instead of a preset")
    prometheus: str | None = Field(default=None, description="Prometheus base URL; none = scrape replicas directly")
    type: Literal["AverageValue", "Value", "Utilization"] = "AverageValue"
    target: float = Field(gt=0, description="target value (per replica for AverageValue)")
    # KEDA's activationThreshold: with min_replicas=0 the service leaves zero only when the
    # metric is strictly above this value, and returns to zero when it is at or below it.
    activation_threshold: float = Field(default=0.0, ge=0, alias="activationThreshold")
    # Shrink only on the mean of the readings of the last windowSeconds (grow on the latest
    # reading as before): an instantaneous gauge such as requests running jitters by
    # +-sqrt(load), and the scale-down window keeps the highest of those jitters, which holds
    # replicas the load does not need. Decided value = max(latest, window mean). 0 = off
    # (the HPA's behaviour: every reading on its own).
    window_seconds: float = Field(default=0.0, ge=0, le=3600, alias="windowSeconds",
                                  description="scale down on the mean of this many seconds of readings "
                                              "(scale up on the latest); 0 = off")
    # A count of requests in flight (Poisson arrivals) scatters by about the square root of its
    # value: at 70 requests a reading of 62 is one standard deviation, not a fall. A scale-down to
    # n replicas needs load + noiseMargin * sqrt(load) <= n * target, so a dip that size does not
    # drain a replica the load still needs (and start it again seconds later). AverageValue only.
    noise_margin: float = Field(default=0.0, ge=0, le=5, alias="noiseMargin",
                                description="scale down only when load + noiseMargin * sqrt(load) fits the "
                                            "smaller count (count metrics: their noise is about sqrt(load)); "
                                            "0 = off")

    @model_validator(mode="after")
    def _one_source(self) -> MetricTarget:
        if (self.preset is None) == (self.query is None):
            raise ValueError("metric: give exactly one of 'preset' or 'query'")
        if self.noise_margin > 0 and self.type != "AverageValue":
            raise ValueError(f"metric.noiseMargin applies to a count summed over replicas (type AverageValue); "
                             f"with type {self.type} set noiseMargin to 0")
        return self


class InferenceSpec(_Spec):
    name: str = Field(min_length=1)
    gpus_per_replica: int = Field(default=1, gt=0, le=4096)
    min_replicas: int = Field(default=1, ge=0)
    max_replicas: int = Field(default=8, gt=0)
    priority: int = Field(default=100)
    metric: MetricTarget | None = None
    behavior: Behavior | None = None
    startup_seconds: float = Field(default=30.0, ge=0)
    # Short-horizon forecast (elastic.policy.forecast): scale up `startup_seconds` ahead of a ramp.
    forecast: Literal["off", "trend", "holt-winters"] = "off"
    forecast_window_seconds: float = Field(default=600.0, gt=0, description="trend: regression window")
    forecast_season_seconds: float = Field(default=86400.0, gt=0, description="holt-winters: season length")
    drain_ahead_seconds: float = Field(
        default=0.0, ge=0,
        description="take the replica a scale-down will remove out of the load balancer this many seconds "
                    "before the scale-down window lets it go, so its requests are done when it leaves and its "
                    "GPU goes to training at once (set it near the longest request you serve); it is put "
                    "back the moment the load rises again. 0 = off (drain only once the window has passed). "
                    "The Ray backend does it; a backend that cannot hold a replica out of the balancer "
                    "(Kubernetes today) ignores it")
    handoff: bool = Field(
        default=False,
        description="a leaving replica hands its requests back to the load balancer, which resumes each on "
                    "another replica from the tokens it had (Llumnix-style migration by recompute), instead of "
                    "finishing them: its GPU is free within a second of the scale-down rather than after its "
                    "longest request, and no request is cut. Needs replicas with POST /admin/handoff (the "
                    "reference replica) and a balancer that resumes handed-off streams (elastic's load "
                    "generator); a replica without the endpoint is drained as usual. The Ray backend does it; "
                    "Kubernetes ignores it")

    @model_validator(mode="after")
    def _bounds(self) -> InferenceSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"min_replicas={self.min_replicas} > max_replicas={self.max_replicas}; raise max_replicas or lower min_replicas"
            )
        return self


class CheckpointSpec(_Spec):
    """Periodic sharded checkpoints of a training job (``elastic.train.checkpoint``)."""

    dir: str = Field(min_length=1, description="a directory every worker can write (a shared volume); the job's "
                                               "checkpoints go into <dir>/<job name>")
    every_steps: int | None = Field(default=100, gt=0, description="save at every multiple of this many steps (the "
                                                                   "step's tensors are copied, then written in the "
                                                                   "background); null: by time only")
    every_seconds: float | None = Field(default=None, gt=0, description="also save once this many seconds have passed "
                                                                       "since the last checkpoint began")
    keep: int = Field(default=2, gt=0, description="complete checkpoints kept; older ones are deleted")

    @model_validator(mode="after")
    def _one_interval(self) -> CheckpointSpec:
        if self.every_steps is None and self.every_seconds is None:
            raise ValueError("neither every_steps nor every_seconds is set; give at least one (e.g. every_steps: 100)")
        return self


class TrainingSpec(_Spec):
    name: str = Field(min_length=1)
    model: str = Field(description="preset name or path to a model file")
    min_gpus: int = Field(default=1, gt=0)
    max_gpus: int = Field(default=8, gt=0)
    priority: int = Field(default=0)
    on_below_minimum: Literal["pause", "preempt"] = Field(
        default="pause",
        description="when inference needs GPUs the job cannot spare above min_gpus: 'pause' moves its state "
                    "off-GPU into keepers and resumes it at the same step later; 'preempt' stops it (state dropped, "
                    "it starts again from step 0)")
    global_batch: int = Field(default=16, gt=0)
    micro_batch: int = Field(default=1, gt=0)
    allowed_tp: list[int] | None = None
    allowed_pp: list[int] | None = None

    zero: int = Field(default=0, ge=0, le=1)
    replicate_optimizer: bool = Field(
        default=False,
        description="never shard the optimizer state (no ZeRO-1) so that every data-parallel replica holds "
                    "a full copy: a lost worker is then recovered from its replica without a restart; costs "
                    "optimizer memory (GPU counts where only ZeRO-1 fits drop out)")
    checkpoint: CheckpointSpec | None = Field(
        default=None,
        description="a safety net for losses no replica covers (dp = 1, ZeRO-1, two losses): the job then starts "
                    "again from its newest complete checkpoint, on any layout, instead of from step 0. Rescales "
                    "never use it (they move the state between live workers). None: no checkpoints")
    entrypoint: str | None = Field(
        default=None,
        description="the user's own training code, run under elastic.torch.Manager by every worker: "
                    "'package.module:function' (called with no arguments) or a script path ending in .py (run as "
                    "__main__). The declared model is what the planner sizes the job from. None: the reference "
                    "trainer")
    args: list[str] = Field(
        default_factory=list,
        description="command-line arguments of the entrypoint (its sys.argv[1:]); only with an entrypoint")
    mesh_dims: dict[str, str] | None = Field(
        default=None,
        description="the name of the user's device mesh dim for each controller axis it shards over (dp, tp, pp), "
                    "e.g. {dp: dp_shard, tp: tp}; an axis without a name always has degree 1 (allowed_tp/allowed_pp "
                    "become [1]). Only with an entrypoint; None: {dp: dp_shard, tp: tp}")
    dp_replicas: bool = Field(
        default=False,
        description="with an entrypoint: the data-parallel ranks hold full copies of the state (DDP-style), so a "
                    "lost worker is recovered in place from a copy; false: they hold shards (FSDP-style) and a "
                    "lost worker fails the job")
    seed: int = Field(default=0, ge=0, description="seed of the data order (the reference trainer may ignore it)")

    @field_validator("allowed_tp", "allowed_pp")
    @classmethod
    def _degrees(cls, v: list[int] | None, info: Any) -> list[int] | None:
        for d in v or ():
            if not 1 <= d <= 65536:
                raise ValueError(f"{info.field_name} contains {d}; degrees are from 1 to 65536")
        return v

    @model_validator(mode="after")
    def _bounds(self) -> TrainingSpec:
        if self.zero and self.replicate_optimizer:
            raise ValueError("zero=1 shards the optimizer state and replicate_optimizer=true forbids it; "
                             "choose one")
        if self.min_gpus > self.max_gpus:
            raise ValueError(f"min_gpus={self.min_gpus} > max_gpus={self.max_gpus}; raise max_gpus or lower min_gpus")
        return self

    @model_validator(mode="after")
    def _user_code(self) -> TrainingSpec:
        """With an entrypoint: the rules of ``elastic.train.userjob`` plus what a user job cannot do
        (elastic's checkpoints, ZeRO-1, pausing into keepers); ``on_below_minimum`` becomes preempt and
        an axis ``mesh_dims`` does not name is held at 1. Without one: the user-job fields stay unset.
        Each error carries the offending field in its context (``ctx["field"]``)."""
        err = self._field_error
        if self.entrypoint is None:
            for name, default in (("args", []), ("mesh_dims", None), ("dp_replicas", False)):
                if getattr(self, name) != default:
                    raise err(name, f"{name}: only a job with an entrypoint (its own training code) takes it; "
                                    f"set entrypoint or remove {name}")
            return self
        # the workers apply these same rules; imported here, so only a user job loads elastic.train
        from elastic.train.userjob import DEFAULT_MESH_DIMS, check_mesh_dims, parse_entrypoint

        try:
            parse_entrypoint(self.entrypoint, "entrypoint")
        except SpecError as e:
            raise err("entrypoint", str(e)) from None
        try:
            dims = check_mesh_dims(self.mesh_dims if self.mesh_dims is not None else DEFAULT_MESH_DIMS)
        except SpecError as e:
            raise err("mesh_dims", str(e)) from None
        if self.checkpoint is not None:
            raise err("checkpoint", "checkpoint: a job with an entrypoint keeps its own checkpoints (elastic "
                                    "saves none of its state); remove checkpoint")
        if self.zero:
            raise err("zero", f"zero={self.zero}: a job with an entrypoint shards its optimizer state its own way "
                              "(ZeRO-1 is the reference trainer's); set zero: 0")
        if "on_below_minimum" in self.model_fields_set and self.on_below_minimum == "pause":
            raise err("on_below_minimum", "on_below_minimum=pause: a job with an entrypoint cannot be paused into "
                                          "keepers; set on_below_minimum: preempt or leave it out")
        held: dict[str, Any] = {"on_below_minimum": "preempt"}
        for axis, name in (("tp", "allowed_tp"), ("pp", "allowed_pp")):
            allowed = getattr(self, name)
            if axis in dims:
                continue
            if allowed not in (None, [1]):
                raise err(name, f"{name}={allowed}: mesh_dims {dims} names no {axis} dim, so the job runs {axis}=1 "
                                f"only; set {name}: [1] (or leave it out), or add a {axis} dim to mesh_dims "
                                f"(e.g. {axis}: {axis})")
            held[name] = [1]
        for name, value in held.items():  # derived, not set: a dump with exclude_unset stays as written
            object.__setattr__(self, name, value)
        return self

    @property
    def no_zero1(self) -> bool:
        """The planner must not shard this job's optimizer state: replicas are to stay whole
        (``replicate_optimizer``), or the optimizer is the user's own (a job with an entrypoint)."""
        return self.replicate_optimizer or self.entrypoint is not None

    @staticmethod
    def _field_error(field_name: str, message: str) -> Exception:
        """An error about one field: ``ctx["field"]`` lets the API and the operator name it."""
        from pydantic_core import PydanticCustomError

        return PydanticCustomError("user_job", message, {"field": field_name})


class PoolSpec(_Spec):
    name: str = Field(default="default", min_length=1)
    nodes: int = Field(default=1, gt=0)
    gpus_per_node: int = Field(default=8, gt=0)
    hardware: str = "cpu"
    rescale_interval_seconds: float = Field(default=60.0, ge=0)
    gain_threshold: float = Field(default=0.1, ge=0)
    headroom_gpus: int = Field(default=0, ge=0)

    @field_validator("hardware")
    @classmethod
    def _hw(cls, v: str) -> str:
        if v not in HARDWARE_PRESETS:
            raise ValueError(f"unknown hardware '{v}'; use one of {', '.join(HARDWARE_PRESETS)}")
        return v

    @property
    def total_gpus(self) -> int:
        return self.nodes * self.gpus_per_node


# --------------------------------------------------------------------------------------------
# Allocation and plan (the co-scheduler's output)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GPU:
    node: str
    index: int

    def __str__(self) -> str:
        return f"{self.node}/{self.index}"


@dataclass(frozen=True)
class Allocation:
    """Which GPUs each workload holds. ``holdings``: workload name -> GPUs."""

    holdings: dict[str, tuple[GPU, ...]]

    def gpus_of(self, workload: str) -> tuple[GPU, ...]:
        return self.holdings.get(workload, ())

    def check_disjoint(self) -> None:
        seen: dict[GPU, str] = {}
        for w, gpus in self.holdings.items():
            for g in gpus:
                if g in seen:
                    raise SpecError(f"GPU {g} allocated to both '{seen[g]}' and '{w}'")
                seen[g] = w


@dataclass(frozen=True)
class PlanStep:
    """One ordered action with a machine-readable reason and a human message."""

    action: Literal["shrink_training", "scale_inference_up", "scale_inference_down", "grow_training",
                    "pause_training", "preempt_training", "noop"]
    workload: str
    reason: str
    message: str
    target: Any = None


@dataclass(frozen=True)
class Plan:
    allocation: Allocation
    steps: tuple[PlanStep, ...]
    reason: str
    message: str
