"""ModelConfig: the typed, validated shape of a Qwen3 or Qwen3-MoE model.

One frozen dataclass describes both architectures (a dense model has ``num_experts == 0``).
It is built from a Hugging Face ``config.json`` (``from_hf_dict``), written back to one
(``to_hf_dict``), and validated in ``__post_init__``: the single place that decides whether
the model can express a configuration. Presets live in ``configs/models.py``; sweeps derive by
``dataclasses.replace`` and are re-validated on construction.

Letter vocabulary used across the model code: B batch, T query length, S key length, N query
heads, K kv heads, G = N // K query heads per kv head, H head dim, D model dim, F dense ffn dim,
I expert ffn dim, E experts, V vocab, L layers.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping

from fp8rl_jax.fields import check_field_types

ARCHITECTURES = {"Qwen3ForCausalLM": "qwen3", "Qwen3MoeForCausalLM": "qwen3_moe"}


class ConfigError(ValueError):
    """A configuration the model cannot express, or an unsupported architecture."""


def fp8_block_size(quant: Mapping[str, Any] | None, source: str = "config.json") -> tuple[int, int] | None:
    """The weight block of a block-FP8 ``quantization_config`` (None when absent).

    Readable: ``{quant_method: "fp8", fmt: "e4m3", activation_scheme: "dynamic",
    weight_block_size: [bn, bk]}``, the format of the public Qwen3-*-FP8 checkpoints and of
    ``fp8rl quantize``. Anything else raises ConfigError naming ``source``.
    """
    if not quant:
        return None
    method, fmt = quant.get("quant_method"), quant.get("fmt", "e4m3")
    block = quant.get("weight_block_size")
    if method != "fp8" or fmt != "e4m3" or quant.get("activation_scheme", "dynamic") != "dynamic":
        raise ConfigError(
            f"{source}: quantization_config {dict(quant)} is not supported; readable quantized checkpoints are "
            "block FP8 (quant_method 'fp8', fmt 'e4m3', activation_scheme 'dynamic', weight_block_size)"
        )
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ConfigError(f"{source}: quantization_config.weight_block_size must be two positive ints, got {block!r}")
    return (block[0], block[1])


def fp8_quantization_config(block_size: tuple[int, int]) -> dict[str, Any]:
    """The config.json ``quantization_config`` of a block-FP8 checkpoint we write."""
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block_size)}


_REQUIRED = object()
_KIND_NAMES = {int: "an integer", float: "a number", bool: "true or false"}


def _checked_float(v: Any, source: str, key: str) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ConfigError(f"{source}: {key} must be a number, got {json.dumps(v)}")
    return float(v)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Shapes and hyper-parameters of a Qwen3 / Qwen3-MoE causal LM (names as in HF)."""

    vocab_size: int  # V
    hidden_size: int  # D
    intermediate_size: int  # F, dense MLP width (unused by a model whose layers are all MoE)
    num_layers: int  # L
    num_heads: int  # N
    num_kv_heads: int  # K
    head_dim: int  # H
    rope_theta: float = 1_000_000.0
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 40_960
    tie_word_embeddings: bool = False
    # Mixture of experts; num_experts == 0 means a dense model.
    num_experts: int = 0  # E
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0  # I
    norm_topk_prob: bool = False  # HF's default; the public Qwen3-MoE checkpoints set it true
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        check_field_types(self)
        positive = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim")
        for name in positive:
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads} (GQA needs it)"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.rope_theta <= 0 or self.rms_norm_eps <= 0:
            raise ConfigError(f"rope_theta and rms_norm_eps must be positive, got {self.rope_theta}, {self.rms_norm_eps}")
        if self.num_experts < 0:
            raise ConfigError(f"num_experts must be >= 0, got {self.num_experts}")
        if self.num_experts:
            if not 0 < self.num_experts_per_tok <= self.num_experts:
                raise ConfigError(
                    f"num_experts_per_tok={self.num_experts_per_tok} must be in [1, num_experts={self.num_experts}]"
                )
            if self.moe_intermediate_size <= 0:
                raise ConfigError(f"moe_intermediate_size must be positive, got {self.moe_intermediate_size}")
            if self.decoder_sparse_step < 1:
                raise ConfigError(f"decoder_sparse_step must be >= 1, got {self.decoder_sparse_step}")
            bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_layers]
            if bad:
                raise ConfigError(f"mlp_only_layers {bad} are outside [0, {self.num_layers})")
        if any(not self.layer_is_moe(i) for i in range(self.num_layers)) and self.intermediate_size <= 0:
            raise ConfigError(f"intermediate_size must be positive for dense layers, got {self.intermediate_size}")
        bad_ids = [t for t in (*self.eos_token_ids, self.bos_token_id) if t is not None and not 0 <= t < self.vocab_size]
        if bad_ids:
            raise ConfigError(f"special token ids {bad_ids} are outside the vocabulary [0, {self.vocab_size})")

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def architecture(self) -> str:
        return "Qwen3MoeForCausalLM" if self.is_moe else "Qwen3ForCausalLM"

    def layer_is_moe(self, layer: int) -> bool:
        """HF's rule: sparse when not in mlp_only_layers and (layer + 1) % decoder_sparse_step == 0."""
        return (
            self.num_experts > 0
            and layer not in self.mlp_only_layers
            and (layer + 1) % self.decoder_sparse_step == 0
        )

    # ----------------------------------------------------------------- Hugging Face config.json

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any], source: str = "config.json") -> "ModelConfig":
        """Parses a HF config dict; raises ConfigError naming ``source`` for what we cannot express.

        Accepts both the public Qwen3 layout (top-level ``rope_theta``, ``num_experts``) and the one
        transformers 5 writes (``rope_parameters``, ``num_local_experts``).
        """
        archs = d.get("architectures") or []
        model_type = d.get("model_type")
        known = [a for a in archs if a in ARCHITECTURES]
        if not known and model_type not in ARCHITECTURES.values():
            raise ConfigError(
                f"{source}: unsupported architecture {archs or model_type!r}; "
                f"supported: {sorted(ARCHITECTURES)} (model_type {sorted(ARCHITECTURES.values())})"
            )
        kind = ARCHITECTURES[known[0]] if known else model_type

        def unsupported(what: str) -> ConfigError:
            return ConfigError(f"{source}: {what} is not supported by the fp8rl_jax Qwen3 model")

        if d.get("hidden_act", "silu") != "silu":
            raise unsupported(f"hidden_act={d['hidden_act']!r}")
        if d.get("attention_bias", False):
            raise unsupported("attention_bias=true")
        if d.get("use_sliding_window", False):
            raise unsupported("use_sliding_window=true")
        rope = dict(d.get("rope_parameters") or {})
        scaling = d.get("rope_scaling")
        rope_type = rope.get("rope_type", (scaling or {}).get("rope_type", (scaling or {}).get("type", "default")))
        if rope_type != "default":
            raise unsupported(f"rope scaling of type {rope_type!r}")
        quant = d.get("quantization_config")
        if quant:
            fp8_block_size(quant, source)  # only block FP8 checkpoints are readable
        def value(key: str, kind: type, default: Any = _REQUIRED, *alternates: str) -> Any:
            """``d[key]`` (else the first present alternate, else ``default``) checked to be a JSON value of
            ``kind``: an int is no bool and no float, a float may be an int, a bool is only true/false."""
            for k in (key, *alternates):
                if k in d and d[k] is not None:
                    key, v = k, d[k]
                    break
            else:
                if default is not _REQUIRED:
                    return default
                if key in d:
                    raise ConfigError(f"{source}: {key} must be {_KIND_NAMES[kind]}, got null")
                raise ConfigError(f"{source}: required key {key!r} is missing")
            ok = isinstance(v, bool) if kind is bool else (
                isinstance(v, (int, float)) and not isinstance(v, bool) if kind is float else
                isinstance(v, int) and not isinstance(v, bool))
            if not ok:
                raise ConfigError(f"{source}: {key} must be {_KIND_NAMES[kind]}, got {json.dumps(v)}")
            return float(v) if kind is float else v

        def int_list(key: str) -> tuple[int, ...]:
            v = d.get(key)
            items = [] if v is None else v if isinstance(v, list) else [v]
            if not all(isinstance(i, int) and not isinstance(i, bool) for i in items):
                raise ConfigError(f"{source}: {key} must be an integer or a list of integers, got {json.dumps(v)}")
            return tuple(items)

        num_heads = value("num_attention_heads", int)
        hidden = value("hidden_size", int)
        if num_heads <= 0:
            raise ConfigError(f"{source}: num_attention_heads must be positive, got {num_heads}")
        rope_theta = value("rope_theta", float, 10_000.0) if "rope_theta" not in rope else None
        kw: dict[str, Any] = dict(
            vocab_size=value("vocab_size", int),
            hidden_size=hidden,
            intermediate_size=value("intermediate_size", int, 0),
            num_layers=value("num_hidden_layers", int),
            num_heads=num_heads,
            num_kv_heads=value("num_key_value_heads", int, num_heads),
            head_dim=value("head_dim", int, hidden // num_heads),
            rope_theta=rope_theta if rope_theta is not None else _checked_float(rope["rope_theta"], source,
                                                                                 "rope_parameters.rope_theta"),
            rms_norm_eps=value("rms_norm_eps", float, 1e-6),
            max_position_embeddings=value("max_position_embeddings", int, 40_960),
            tie_word_embeddings=value("tie_word_embeddings", bool, False),
            bos_token_id=value("bos_token_id", int, None),
            eos_token_ids=int_list("eos_token_id"),
        )
        if kind == "qwen3_moe":
            kw.update(
                num_experts=value("num_experts", int, 0, "num_local_experts"),
                num_experts_per_tok=value("num_experts_per_tok", int),
                moe_intermediate_size=value("moe_intermediate_size", int),
                norm_topk_prob=value("norm_topk_prob", bool, False),
                decoder_sparse_step=value("decoder_sparse_step", int, 1),
                mlp_only_layers=int_list("mlp_only_layers"),
            )
            if kw["num_experts"] <= 0:
                raise unsupported("a qwen3_moe config with num_experts <= 0")
        try:
            return cls(**kw)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None

    def to_hf_dict(self) -> dict[str, Any]:
        """The HF config.json of this model, in the public Qwen3 layout."""
        d: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": ARCHITECTURES[self.architecture],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "attention_bias": False,
            "attention_dropout": 0.0,
            "rope_theta": self.rope_theta,
            "rope_scaling": None,
            "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "use_sliding_window": False,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
            "torch_dtype": "bfloat16",
        }
        if self.is_moe:
            d.update(
                num_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                norm_topk_prob=self.norm_topk_prob,
                decoder_sparse_step=self.decoder_sparse_step,
                mlp_only_layers=list(self.mlp_only_layers),
            )
        return d

    # ----------------------------------------------------------------- parameter counts

    def param_counts(self) -> tuple[int, int]:
        """(total, active per token) parameter counts, derived from the shapes alone."""
        D, H = self.hidden_size, self.head_dim
        attn = D * H * (2 * self.num_heads + 2 * self.num_kv_heads) + 2 * H
        total = active = 0
        for i in range(self.num_layers):
            norms = 2 * D
            if self.layer_is_moe(i):
                expert = 3 * D * self.moe_intermediate_size
                router = D * self.num_experts
                total += attn + norms + router + self.num_experts * expert
                active += attn + norms + router + self.num_experts_per_tok * expert
            else:
                mlp = 3 * D * self.intermediate_size
                total += attn + norms + mlp
                active += attn + norms + mlp
        emb = self.vocab_size * D * (1 if self.tie_word_embeddings else 2) + D
        return total + emb, active + emb
