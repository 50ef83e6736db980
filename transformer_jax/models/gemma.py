"""Gemma 3 (text): a decoder-only Transformer whose layers alternate local and global attention.

Read top to bottom: config and presets -> one block -> the model.

  tokens (B, T) -> wte (B, T, D) * sqrt(D)
    -> L x GemmaBlock:  x = x + post_attn_norm(self_attn(input_norm(x)))
                        x = x + post_mlp_norm(mlp(pre_mlp_norm(x)))
    -> final norm -> logits (B, T, V) through the tied embedding (fp32)
       [-> cap * tanh(logits / cap) with ``final_logit_softcap``]

Every norm is RMSNorm with Gemma's ``1 + w`` (``layers.norms`` "rmsnorm_plus_one", w stored
and initialised to 0): the four of each block, the final one, and the per-head query and
key norms (over H, before RoPE). The MLP is gated GELU-tanh (``gelu_pytorch_tanh``); the
attention is grouped-query with an explicit head size H (not D / N) and the logit scale
``query_pre_attn_scalar ** -0.5``. A "local" layer sees a causal sliding window of
``sliding_window`` keys (itself included) and rotates with ``rope_local_base`` (10^4); a
"global" layer sees every key and rotates with ``rope_base`` (10^6) rescaled by
``rope_scaling`` (linear, factor 8, in the 4B and larger models). The pattern is
``layer_types`` when given, else every ``sliding_window_pattern``-th layer is global (5
local, 1 global). Decoding keeps a KV cache per layer: a ring of W slots for a local layer
(``MultiHeadAttention``'s sliding-window cache), the whole length for a global one.

Why Gemma is its own family and not GPT options: its block has two norms per sublayer (one
before and one after), its embedding is scaled, and its layers differ from one another
(window and RoPE table). GPT's ``DecoderBlock`` and stack have one of each and identical
layers; the options to bend them would make GPT harder to read for every other model.

``scan_layers=True`` is refused by name: a scan repeats one compiled layer, and Gemma's
layers differ. Scanning groups of one pattern period (MaxText) would need a second layer
layout in every converter and would still leave the remainder (26 = 4 x 6 + 2 in the 1B
model) unrolled; the unrolled stack compiles in seconds at these depths.

Parameter names: ``wte``, ``h_0`` ... ``h_{L-1}`` (each: input_norm, self_attn{query,
key, value, out, query_norm, key_norm}, post_attn_norm, pre_mlp_norm, mlp{wi_0, wi_1, wo},
post_mlp_norm), ``ln_f`` and, when embeddings are untied, ``lm_head``.
``interop.hf`` converts ``Gemma3ForCausalLM`` (and the text model of
``Gemma3ForConditionalGeneration``) to and from this module.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from ..errors import UserError
from ..layers.cpu_tuning import residual
from ..layers.dense import Dense, Embed, canonical_dtype
from ..layers.embeddings import RopeScaling
from ..layers.lora import LoraConfig, with_lora
from ..layers.masks import AttentionPattern, key_padding_mask
from ..layers.mlp import ACTIVATIONS, FeedForward
from ..layers.multi_head import MultiHeadAttention
from ..layers.norms import make_norm
from ..layers.stack import layer_stack
from .base import (PresetConfig, check_causal_lm_mask, check_ids, check_segment_ids,
                   running_position)

Array = jax.Array

LAYER_KINDS = ("local", "global")

#: Gemma 3's 4B and larger models: global layers rescale RoPE linearly by 8.
_LINEAR_8 = dict(kind="linear", factor=8.0)


@dataclasses.dataclass(frozen=True)
class GemmaConfig(PresetConfig):
    vocab_size: int = 262144
    max_len: int = 32768                 # max_position_embeddings
    num_layers: int = 26
    num_heads: int = 4
    num_kv_heads: int = 1
    head_dim: int = 256                  # H, explicit (not d_model / num_heads)
    d_model: int = 1152
    mlp_dim: int = 6912
    activation: str = "gelu_tanh"        # HF's gelu_pytorch_tanh
    norm_eps: float = 1e-6
    query_pre_attn_scalar: float = 256.0  # attention scale = query_pre_attn_scalar ** -0.5
    sliding_window: int = 512            # W of the local layers
    sliding_window_pattern: int = 6      # every 6th layer global, unless layer_types
    layer_types: tuple[str, ...] | None = None   # "local"/"global" per layer (wins)
    rope_base: float = 1_000_000.0       # global layers
    rope_scaling: RopeScaling | None = None  # global layers; a dict is converted
    rope_local_base: float = 10_000.0    # local layers (no scaling)
    final_logit_softcap: float | None = None  # Gemma 2's cap * tanh(logits / cap)
    tie_embeddings: bool = True
    dropout_rate: float = 0.0            # embedding and residual dropout
    attention_dropout_rate: float = 0.0
    initializer_range: float = 0.02
    scan_layers: bool = False            # refused: the layers differ (module docstring)
    remat: bool = False
    remat_policy: str = "nothing_saveable"
    attention_impl: str = "auto"
    cpu_tuning: bool = True
    dtype: str = "float32"
    param_dtype: str = "float32"
    lora: LoraConfig | None = None

    # The shapes of the google/gemma-3-* config.json files (the text model of 4B/12B:
    # text_config); the 1B is Gemma3ForCausalLM with 32768 positions and the 262144-token
    # vocabulary, the multimodal ones have 262208 tokens (image tokens) and 131072 positions.
    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "gemma3-tiny": dict(vocab_size=512, max_len=128, num_layers=3, num_heads=4,
                            num_kv_heads=2, head_dim=16, d_model=64, mlp_dim=128,
                            query_pre_attn_scalar=16.0, sliding_window=8,
                            sliding_window_pattern=3, rope_scaling=_LINEAR_8),
        "gemma3-1b": dict(),
        "gemma3-4b": dict(vocab_size=262208, max_len=131072, num_layers=34, num_heads=8,
                          num_kv_heads=4, d_model=2560, mlp_dim=10240, sliding_window=1024,
                          rope_scaling=_LINEAR_8),
        "gemma3-12b": dict(vocab_size=262208, max_len=131072, num_layers=48, num_heads=16,
                           num_kv_heads=8, d_model=3840, mlp_dim=15360, sliding_window=1024,
                           rope_scaling=_LINEAR_8),
    }

    def __post_init__(self):
        """Every field on its own (base.py's helpers), then the relations between them."""
        self._require_positive("vocab_size", "max_len", "num_layers", "num_heads",
                               "num_kv_heads", "head_dim", "d_model", "mlp_dim",
                               "sliding_window", "sliding_window_pattern")
        object.__setattr__(self, "rope_scaling", RopeScaling.from_value(self.rope_scaling))
        if isinstance(self.layer_types, list):          # from JSON
            object.__setattr__(self, "layer_types", tuple(self.layer_types))
        self._require_choice("activation", ACTIVATIONS)
        for name in ("norm_eps", "query_pre_attn_scalar", "rope_base", "rope_local_base"):
            self._require_number(name, minimum=0, exclusive_min=True)
        self._require_number("final_logit_softcap", minimum=0, exclusive_min=True,
                             allow_none=True)
        self._require_bools("tie_embeddings")
        self._require_rates("dropout_rate", "attention_dropout_rate")
        self._require_number("initializer_range", minimum=0)
        self._require_model_settings()
        if self.layer_types is not None and not (
                isinstance(self.layer_types, tuple)
                and all(k in LAYER_KINDS for k in self.layer_types)):
            raise self._bad("layer_types", f"None or a list of {LAYER_KINDS} per layer")
        self._require_relation(not self.scan_layers, ("scan_layers",),
                               "is not supported by Gemma: its local and global layers differ, "
                               "and a scan repeats one layer; use scan_layers=False")
        self._require_relation(self.layer_types is None
                               or len(self.layer_types) == self.num_layers,
                               ("layer_types", "num_layers"),
                               f"needs one entry per layer (num_layers={self.num_layers})")
        self._require_divisible("num_heads", "num_kv_heads")
        self._require_relation(self.head_dim % 2 == 0, ("head_dim",),
                               "must be even for rotary positions")

    @property
    def layer_kinds(self) -> tuple[str, ...]:
        """"local" or "global" for each layer."""
        if self.layer_types is not None:
            return self.layer_types
        p = self.sliding_window_pattern
        return tuple("global" if (i + 1) % p == 0 else "local" for i in range(self.num_layers))

    @property
    def layer_stacks(self) -> tuple[tuple[tuple[str, ...], str, int], ...]:
        """(parent path, name, count) of the layer stack: ``h_{i}``."""
        return (((), "h", self.num_layers),)

    def num_params(self, *, non_embedding: bool = False) -> int:
        """Parameter count from the config alone (equals HF's; a tied head counts once).
        ``non_embedding`` leaves out wte and an untied lm_head."""
        d, f, h = self.d_model, self.mlp_dim, self.head_dim
        q, kv = self.num_heads * h, self.num_kv_heads * h
        layer = 2 * d * q + 2 * d * kv + 2 * h + 3 * d * f + 4 * d
        total = self.num_layers * layer + d
        emb = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        return total if non_embedding else total + emb

    def flops_per_token(self, seq_len: int, *, frozen_base: bool = False) -> float:
        """Training FLOPs per token, PaLM/nanoGPT convention (``GPTConfig.flops_per_token``,
        ``frozen_base`` too): 6 N + 12 (N H) x the keys each layer reads (T, or min(T, W)
        for a local layer)."""
        n = self.num_params(non_embedding=True) + self.vocab_size * self.d_model
        reach = sum(min(seq_len, self.sliding_window) if k == "local" else seq_len
                    for k in self.layer_kinds)
        return (4 if frozen_base else 6) * n + 12 * self.num_heads * self.head_dim * reach


class GemmaBlock(nn.Module):
    """One Gemma 3 layer (module docstring); ``local``: sliding-window attention."""
    config: GemmaConfig
    local: bool = False

    def forward(self, x: Array, mask: Array | None = None, positions: Array | None = None, *,
                deterministic: bool = True, decode: bool = False,
                segment_ids: Array | None = None) -> Array:
        """x (B, T, D) -> (B, T, D); mask (B, 1, 1, S) of real keys; positions (B, T);
        segment_ids (B, T) of packed documents."""
        cfg = self.config
        dtype, param_dtype = canonical_dtype(cfg.dtype), canonical_dtype(cfg.param_dtype)
        init = nn.initializers.normal(cfg.initializer_range)
        norm = lambda name: make_norm("rmsnorm_plus_one", cfg.norm_eps, dtype,  # noqa: E731
                                      param_dtype, name=name)
        window = AttentionPattern("window", cfg.sliding_window) if self.local else None
        attn = MultiHeadAttention(
            num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
            use_bias=False, dropout_rate=cfg.attention_dropout_rate,
            attention_impl=cfg.attention_impl, scale=cfg.query_pre_attn_scalar ** -0.5,
            rope_base=cfg.rope_local_base if self.local else cfg.rope_base,
            rope_scaling=None if self.local else cfg.rope_scaling,
            qk_norm="rmsnorm_plus_one", qk_norm_eps=cfg.norm_eps, dtype=dtype,
            param_dtype=param_dtype, kernel_init=init, cpu_tuning=cfg.cpu_tuning,
            pattern=window, name="self_attn")
        mlp = FeedForward(mlp_dim=cfg.mlp_dim, activation=cfg.activation, gated=True,
                          use_bias=False, dtype=dtype, param_dtype=param_dtype,
                          kernel_init=init, cpu_tuning=cfg.cpu_tuning, name="mlp")
        drop = nn.Dropout(cfg.dropout_rate)
        x = residual(x, cfg.cpu_tuning)
        y = attn(norm("input_norm")(x), mask=mask, causal=True, positions=positions,
                 deterministic=deterministic, decode=decode, segment_ids=segment_ids)
        x = x + drop(norm("post_attn_norm")(y), deterministic=deterministic)
        self.sow("intermediates", "+sa", x)
        x = residual(x, cfg.cpu_tuning)
        y = mlp(norm("pre_mlp_norm")(x), deterministic=deterministic)
        x = x + drop(norm("post_mlp_norm")(y), deterministic=deterministic)
        x = nn.with_logical_constraint(x, ("act_batch", "act_length", "act_embed"))
        self.sow("intermediates", "+mlp", x)
        return x

    @nn.compact
    def __call__(self, x, mask=None, positions=None, *, deterministic=True, decode=False,
                 segment_ids=None):
        return self.forward(x, mask, positions, deterministic=deterministic, decode=decode,
                            segment_ids=segment_ids)


class Gemma(nn.Module):
    """Gemma 3 language model. ``apply(variables, input_ids)`` -> logits (B, T, V) fp32."""
    config: GemmaConfig

    @with_lora
    @nn.compact
    def __call__(self, input_ids: Array, attention_mask: Array | None = None,
                 position_ids: Array | None = None, *, deterministic: bool = True,
                 decode: bool = False, segment_ids: Array | None = None,
                 return_hidden: bool = False) -> Array:
        """input_ids (B, T) int; attention_mask (B, S) with 1 = real token (HF convention);
        packed documents: ``segment_ids`` (B, T) with ``position_ids`` restarting per document.

        As ``GPT``: without ``decode`` S = T and the layers attend causally; with
        ``decode=True`` (a KV cache in the ``cache`` collection) ``attention_mask`` covers
        the whole cache length S_max and ``position_ids`` default to the running position.
        ``return_hidden=True``: ``(hidden after ln_f, {"kernel", "softcap"})`` (as ``GPT``).
        """
        cfg = self.config
        dtype, param_dtype = canonical_dtype(cfg.dtype), canonical_dtype(cfg.param_dtype)
        b, t = self._check_inputs(input_ids, attention_mask, decode)
        input_ids = check_ids("input_ids", input_ids, cfg)
        segment_ids = check_segment_ids("segment_ids", segment_ids, (b, t), decode)
        init = nn.initializers.normal(cfg.initializer_range)
        wte = Embed(cfg.vocab_size, cfg.d_model, dtype=dtype, param_dtype=param_dtype,
                    embedding_init=init, cpu_tuning=cfg.cpu_tuning, name="wte")
        # HF: embed_scale = sqrt(D) as a float32 tensor, cast to the embedding's dtype
        scale = jnp.asarray(math.sqrt(cfg.d_model), jnp.float32).astype(param_dtype)
        x = wte(input_ids) * scale.astype(dtype)
        if position_ids is None:
            position_ids = running_position(self, t, decode) + jnp.arange(t)[None, :]
        position_ids = jnp.broadcast_to(position_ids, (b, t))
        x = nn.Dropout(cfg.dropout_rate)(x, deterministic=deterministic)
        x = nn.with_logical_constraint(x, ("act_batch", "act_length", "act_embed"))
        mask = None if attention_mask is None else key_padding_mask(attention_mask)
        x = layer_stack(GemmaBlock, {"config": cfg}, cfg.num_layers, x, name="h",
                        operands={"mask": mask, "positions": position_ids,
                                  "segment_ids": segment_ids},
                        static={"deterministic": deterministic, "decode": decode},
                        remat=cfg.remat, remat_policy=cfg.remat_policy,
                        per_layer=[{"local": k == "local"} for k in cfg.layer_kinds])
        x = make_norm("rmsnorm_plus_one", cfg.norm_eps, dtype, param_dtype, name="ln_f")(x)
        if cfg.tie_embeddings:
            logits = (x, {"kernel": wte.readout_kernel()}) if return_hidden else wte.attend(x)
        else:
            head = Dense(cfg.vocab_size, use_bias=False, kernel_axes=("embed", "vocab"),
                         dtype=dtype, param_dtype=param_dtype, kernel_init=init,
                         cpu_tuning=cfg.cpu_tuning, name="lm_head")
            logits = (x, head(x, weights_only=True)) if return_hidden else head(x).astype(jnp.float32)
        if return_hidden:   # (hidden, read-out weights and the cap): losses.head_loss
            return logits[0], {**logits[1], "softcap": cfg.final_logit_softcap}
        if cfg.final_logit_softcap is not None:
            cap = cfg.final_logit_softcap
            logits = cap * jnp.tanh(logits / cap)
        return logits

    def _check_inputs(self, input_ids, attention_mask, decode: bool) -> tuple[int, int]:
        cfg = self.config
        if jnp.ndim(input_ids) != 2:
            raise UserError(f"input_ids must be (B, T); got shape {jnp.shape(input_ids)}")
        b, t = jnp.shape(input_ids)
        if t > cfg.max_len and not decode:
            raise UserError(f"sequence length {t} exceeds the model's max_len={cfg.max_len}; "
                            "shorten the input or use a config with a larger max_len")
        check_causal_lm_mask(attention_mask, b, t, decode)
        return b, t


def init_params(model: Gemma, rng: Array, batch_size: int = 1, seq_len: int | None = None):
    """Initialised, unboxed parameters."""
    seq_len = seq_len or min(model.config.max_len, 8)
    ids = jnp.zeros((batch_size, seq_len), jnp.int32)
    return nn.meta.unbox(model.init(rng, ids)["params"])
