"""Frozen-dataclass configs with named presets, shared by every model family."""
from __future__ import annotations

import dataclasses
import difflib
from typing import Any, ClassVar, TypeVar

import jax.numpy as jnp

from ..errors import UserError
from ..layers.attention import IMPLEMENTATIONS, resolve_implementation
from ..layers.dense import canonical_dtype
from ..layers.stack import REMAT_POLICIES, convert_layout

C = TypeVar("C", bound="PresetConfig")


class PresetConfig:
    """Mixin for ``@dataclasses.dataclass(frozen=True)`` configs.

    Subclasses define ``PRESETS: ClassVar[dict[str, dict]]`` (field overrides per name).
    ``Config.preset("name", **overrides)`` builds one; ``to_dict``/``from_dict`` round-trip
    through JSON (checkpoints store the config this way).
    """
    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {}

    @classmethod
    def preset(cls: type[C], name: str, **overrides: Any) -> C:
        if name not in cls.PRESETS:
            hint = difflib.get_close_matches(name, cls.PRESETS, n=1)
            extra = f" Did you mean {hint[0]!r}?" if hint else ""
            raise UserError(f"unknown {cls.__name__} preset {name!r}; choose one of "
                            f"{sorted(cls.PRESETS)}.{extra}")
        return cls.from_dict({**cls.PRESETS[name], **overrides})

    @classmethod
    def from_dict(cls: type[C], values: dict[str, Any]) -> C:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - names)
        if unknown:
            hints = {u: difflib.get_close_matches(u, names, n=1) for u in unknown}
            detail = ", ".join(f"{u!r}" + (f" (did you mean {h[0]!r}?)" if h else "")
                               for u, h in hints.items())
            raise UserError(f"unknown {cls.__name__} field(s): {detail}; valid fields: {sorted(names)}")
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self: C, **changes: Any) -> C:
        return type(self).from_dict({**self.to_dict(), **changes})

    # -- validation helpers for ``__post_init__`` (errors name ``Config.field``) ----------
    def _require_positive(self, *names: str) -> None:
        for name in names:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise UserError(f"{type(self).__name__}.{name} must be an integer >= 1, got "
                                f"{value!r}")

    def _require_divisible(self, name: str, by: str) -> None:
        if getattr(self, name) % getattr(self, by):
            raise UserError(f"{type(self).__name__}: {name}={getattr(self, name)} is not divisible "
                            f"by {by}={getattr(self, by)}")

    def _require_model_settings(self) -> None:
        """The fields every family shares: attention implementation, layer stack, dtypes."""
        self._require_choice("attention_impl", IMPLEMENTATIONS)
        self._require_choice("remat_policy", REMAT_POLICIES)
        for name in ("dtype", "param_dtype"):
            try:
                canonical_dtype(getattr(self, name))
            except ValueError as e:
                raise UserError(f"{type(self).__name__}.{name}: {e}") from None

    def _require_choice(self, name: str, choices, hint: str = "") -> None:
        value = getattr(self, name)
        if value not in choices:
            raise UserError(f"{type(self).__name__}.{name}={value!r} is unknown; choose one of "
                            f"{sorted(choices)}{hint}")

    def _require_rates(self, *names: str) -> None:
        for name in names:
            value = getattr(self, name)
            numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
            if not numeric or not 0.0 <= value < 1.0:
                raise UserError(f"{type(self).__name__}.{name} must be in [0, 1), got {value!r}")

    def _require_token_ids(self, *names: str) -> None:
        for name in names:
            if not 0 <= getattr(self, name) < self.vocab_size:
                raise UserError(f"{type(self).__name__}.{name}={getattr(self, name)} is outside the "
                                f"vocabulary [0, {self.vocab_size})")


def check_ids(name: str, ids: Any):
    """Token ids as a (B, length) integer array, or a UserError naming ``name``."""
    ids = jnp.asarray(ids)
    if ids.ndim != 2:
        raise UserError(f"{name} must be (B, length) token ids; got shape {ids.shape}")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise UserError(f"{name} must be integer token ids; got dtype {ids.dtype}")
    return ids


def check_decoder_inputs(decoder_input_ids, encoded, decoder_attention_mask, decode: bool):
    """An encoder-decoder's ``decode`` inputs: checked target ids (B, T) that match the batch
    of ``encoded`` (B, S, D), and no target padding mask while decoding from the cache."""
    decoder_input_ids = check_ids("decoder_input_ids", decoder_input_ids)
    if encoded.ndim != 3 or encoded.shape[0] != decoder_input_ids.shape[0]:
        raise UserError(f"encoded must be (B, S, D) with B = {decoder_input_ids.shape[0]}; "
                        f"got {tuple(encoded.shape)}")
    if decode and decoder_attention_mask is not None:
        raise UserError("decoder_attention_mask is not supported with decode=True (the cache "
                        "masks positions that are not written yet)")
    return decoder_input_ids


def encode_then_decode(model: Any, input_ids, decoder_input_ids, attention_mask,
                       decoder_attention_mask, deterministic: bool):
    """An encoder-decoder's ``__call__``: checked ids, ``model.encode``, ``model.decode``."""
    input_ids = check_ids("input_ids", input_ids)
    decoder_input_ids = check_ids("decoder_input_ids", decoder_input_ids)
    if input_ids.shape[0] != decoder_input_ids.shape[0]:
        raise UserError(f"input_ids {tuple(input_ids.shape)} and decoder_input_ids "
                        f"{tuple(decoder_input_ids.shape)} have different batch sizes")
    encoded = model.encode(input_ids, attention_mask, deterministic=deterministic)
    return model.decode(decoder_input_ids, encoded, attention_mask, decoder_attention_mask,
                        deterministic=deterministic)


def to_config_layout(params: dict, config: Any) -> dict:
    """``params`` with every layer stack in ``config``'s layout (``scan_layers``): one
    subtree with a leading (L,) axis per stack, or one subtree per layer. For weights made
    in the other layout, e.g. by ``interop.from_torch`` (unrolled) for a scanned Transformer."""
    return convert_layout(params, config.layer_stacks, scanned=config.scan_layers)


def attention_plan(config: Any, seq_len: int, platform: str) -> dict[str, str]:
    """What ``config.attention_impl`` runs on ``platform`` ("cpu", "gpu", "tpu") for
    sequences of ``seq_len`` (a ViT's own patch count instead), in training (with its
    attention dropout) and at eval: ``{"implementation", "platform", "train", "eval"}``."""
    rate = getattr(config, "attention_dropout_rate", getattr(config, "dropout_rate", 0.0))
    seq_len = getattr(config, "seq_len", seq_len)
    shape = dict(dtype=config.dtype, head_dim=config.head_dim, q_len=seq_len, kv_len=seq_len)
    impl = config.attention_impl
    return {"implementation": impl, "platform": platform,
            "train": resolve_implementation(impl, platform, dropout=rate > 0, **shape),
            "eval": resolve_implementation(impl, platform, **shape)}


def describe_attention_plan(plan: dict[str, str], config: Any) -> str:
    """One line for the start of a run, e.g. ``attention: auto -> pallas (tpu)``."""
    head = f"attention: {plan['implementation']} -> "
    if plan["train"] == plan["eval"]:
        return head + f"{plan['train']} ({plan['platform']})"
    rate = getattr(config, "attention_dropout_rate", getattr(config, "dropout_rate", 0.0))
    return (head + f"{plan['train']} while training ({plan['platform']}: attention dropout "
            f"{rate} needs it; set it to 0 for {plan['eval']}), {plan['eval']} at eval")


class EncoderDecoderConfig:
    """What the encoder-decoder configs (T5, Transformer) share: their two layer stacks and
    their training FLOPs, PaLM convention.

    Needs ``_layer_params() -> (encoder layer, decoder layer)`` weight counts and the fields
    ``num_layers``, ``decoder_layers``, ``vocab_size``, ``d_model``, ``num_heads``, ``head_dim``.
    """

    @property
    def decoder_layers(self) -> int:
        return self.num_layers if self.num_decoder_layers is None else self.num_decoder_layers

    @property
    def layer_stacks(self) -> tuple[tuple[tuple[str, ...], str, int], ...]:
        """(parent path, name, count) of each layer stack: ``{encoder,decoder}/layers_{i}``,
        scanned ``{encoder,decoder}/layers``."""
        return ((("encoder",), "layers", self.num_layers),
                (("decoder",), "layers", self.decoder_layers))

    def flops_per_example(self, src_len: int, tgt_len: int) -> float:
        """Training FLOPs of one (source, target) pair: 6 per matmul weight per token (the
        encoder's weights x S, the decoder's and the V D read-out x T) + 12 N H per attention
        logit per layer (L_enc S^2 + L_dec (T^2 + T S)). Embedding lookups, position terms
        and norms' elementwise work are not counted."""
        enc, dec = self._layer_params()
        s, t = src_len, tgt_len
        weights = self.num_layers * enc * s + self.decoder_layers * dec * t
        weights += self.vocab_size * self.d_model * t
        width = self.num_heads * self.head_dim
        attn = width * (self.num_layers * s * s + self.decoder_layers * (t * t + t * s))
        return 6.0 * weights + 12.0 * attn

    def flops_per_token(self, seq_len: int) -> float:
        """``flops_per_example(seq_len, seq_len)`` per token of the pair (2 seq_len tokens)."""
        return self.flops_per_example(seq_len, seq_len) / (2 * seq_len)
