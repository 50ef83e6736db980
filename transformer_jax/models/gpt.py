"""GPT: a decoder-only Transformer (GPT-2 layout), with KV-cache decoding.

Read top to bottom: config and presets -> the model.

  tokens (B, T) -> wte (B, T, D) + wpe (T, D) -> dropout
    -> L x pre-norm DecoderBlock (causal self-attention, MLP; no cross-attention)
    -> final LayerNorm -> logits (B, T, V) through the tied embedding (fp32)

The same module is a Llama with ``position="rope"`` (no wpe), ``norm="rmsnorm"``,
``gated_mlp=True`` + ``activation="silu"`` (SwiGLU), ``num_kv_heads`` < ``num_heads``
(grouped-query attention), ``use_bias=False`` and ``tie_embeddings=False`` (an ``lm_head``):
the ``llama-*`` presets, which ``interop.hf`` converts to and from ``LlamaForCausalLM``.
Llama 3.1-3.3 add ``rope_scaling`` (``layers.embeddings.RopeScaling``); Qwen 2/2.5 add
q/k/v biases (``qkv_bias``); Qwen 3 adds per-head query/key RMSNorms (``qk_norm``) and a
head size that need not be D / N (``head_size``).

Parameter names (unscanned): ``wte``, ``wpe``, ``h_0`` ... ``h_{L-1}`` (each a
``DecoderBlock``: norm1, self_attn{query,key,value,out}, norm2, mlp{wi,wo}), ``ln_f`` and,
when embeddings are untied, ``lm_head``. With ``scan_layers=True`` the blocks are one
module ``h`` whose parameters carry a leading (L,) axis (logical axis ``layers``).
Prefix tuning (``prefix_tokens`` = P > 0) adds ``prefix_key`` and ``prefix_value`` (P, K, H)
to each ``self_attn`` (``interop.peft.prefix`` converts PEFT's saved prefix).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from ..errors import UserError
from ..layers.blocks import DecoderBlock
from ..layers.dense import Dense, Embed, canonical_dtype
from ..layers.embeddings import RopeScaling
from ..layers.lora import LoraConfig, with_lora
from ..layers.masks import key_padding_mask
from ..layers.mlp import ACTIVATIONS
from ..layers.norms import make_norm
from ..layers.stack import layer_stack
from .base import (EfficientAttentionConfig, PresetConfig, check_causal_lm_mask, check_id_values,
                   check_ids, check_segment_ids, running_position)

Array = jax.Array

#: What every llama-* preset sets (HF LlamaConfig: silu, no biases, rms_norm_eps 1e-5 in
#: the Llama 2/3 and TinyLlama checkpoints, rope_theta 10000 unless the preset says).
_LLAMA: dict[str, Any] = dict(
    position="rope", norm="rmsnorm", norm_eps=1e-5, gated_mlp=True, activation="silu",
    use_bias=False, tie_embeddings=False, dropout_rate=0.0, attention_dropout_rate=0.0)


#: What every qwen* preset sets on top (Qwen2Config/Qwen3Config: rms_norm_eps 1e-6,
#: rope_theta 1e6 in the Qwen 2.5 and Qwen 3 checkpoints; the small ones tie the head).
_QWEN: dict[str, Any] = dict(_LLAMA, norm_eps=1e-6, rope_base=1e6, tie_embeddings=True)


def _llama3_rope(factor: float) -> dict[str, Any]:
    """Llama 3.1-3.3's rope_scaling (low/high frequency factors 1 and 4, 8192 positions)."""
    return dict(kind="llama3", factor=factor, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_len=8192)


@dataclasses.dataclass(frozen=True)
class GPTConfig(EfficientAttentionConfig, PresetConfig):
    vocab_size: int = 50257
    max_len: int = 1024                  # learned position table size (n_positions)
    num_layers: int = 12
    num_heads: int = 12
    num_kv_heads: int | None = None      # grouped-query attention when < num_heads
    head_size: int | None = None         # H when not d_model / num_heads (HF head_dim; Qwen 3)
    d_model: int = 768
    mlp_dim: int | None = None           # default 4 * d_model
    activation: str = "gelu_tanh"        # GPT-2's "gelu_new"
    gated_mlp: bool = False
    norm: str = "layernorm"
    norm_eps: float = 1e-5
    position: str = "learned"            # "learned" (GPT-2) or "rope"
    rope_base: float = 10000.0
    rope_scaling: RopeScaling | None = None  # Llama 3's frequency rescaling; a dict is converted
    use_bias: bool = True
    qkv_bias: bool = False               # q/k/v biases even without use_bias (Qwen 2/2.5)
    qk_norm: bool = False                # RMSNorm of each query and key head (Qwen 3)
    tie_embeddings: bool = True
    dropout_rate: float = 0.1            # embedding and residual dropout
    attention_dropout_rate: float = 0.1
    initializer_range: float = 0.02
    scan_layers: bool = False            # one scanned layer (compile time independent of depth)
    remat: bool = False                  # recompute activations in the backward pass
    remat_policy: str = "nothing_saveable"
    attention_impl: str = "auto"         # layers.attention_dispatch.IMPLEMENTATIONS
    attention: str = "softmax"           # or "linear" (models/base.py EfficientAttentionConfig)
    attention_window: int | None = None  # sliding window W (None: every key)
    attention_sparsity: str | None = None  # "strided:L" or "fixed:L:C" (Child et al. 2019)
    cpu_tuning: bool = True              # layers/cpu_tuning.py on XLA:CPU
    dtype: str = "float32"               # compute dtype
    param_dtype: str = "float32"
    lora: LoraConfig | None = None       # LoRA adapters (layers/lora.py); a dict is converted
    prefix_tokens: int = 0               # prefix tuning: P learned keys/values per layer (0: none)

    # The llama-* presets: the shapes of HF's config.json for each model (Llama has no
    # embedding/residual/attention dropout: all 0). Llama 3.1-3.3 rescale RoPE ("llama3":
    # factor 8 for 3.1 8B, 32 for 3.2; 8192 original positions) for 131072 positions.
    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "tiny": dict(vocab_size=512, max_len=128, num_layers=2, num_heads=4, d_model=64),
        "gpt2": dict(),
        "gpt2-medium": dict(num_layers=24, num_heads=16, d_model=1024),
        "gpt2-large": dict(num_layers=36, num_heads=20, d_model=1280),
        "gpt2-xl": dict(num_layers=48, num_heads=25, d_model=1600),
        "llama-tiny": dict(_LLAMA, vocab_size=512, max_len=128, num_layers=2, num_heads=4,
                           num_kv_heads=2, d_model=64, mlp_dim=176),
        "llama-2-7b": dict(_LLAMA, vocab_size=32000, max_len=4096, num_layers=32, num_heads=32,
                           num_kv_heads=32, d_model=4096, mlp_dim=11008),
        "tinyllama-1.1b": dict(_LLAMA, vocab_size=32000, max_len=2048, num_layers=22,
                               num_heads=32, num_kv_heads=4, d_model=2048, mlp_dim=5632),
        "llama-3.2-1b": dict(_LLAMA, vocab_size=128256, max_len=131072, num_layers=16,
                             num_heads=32, num_kv_heads=8, d_model=2048, mlp_dim=8192,
                             rope_base=500000.0, rope_scaling=_llama3_rope(32.0),
                             tie_embeddings=True),
        "llama-3.2-3b": dict(_LLAMA, vocab_size=128256, max_len=131072, num_layers=28,
                             num_heads=24, num_kv_heads=8, d_model=3072, mlp_dim=8192,
                             rope_base=500000.0, rope_scaling=_llama3_rope(32.0),
                             tie_embeddings=True),
        "llama-3.1-8b": dict(_LLAMA, vocab_size=128256, max_len=131072, num_layers=32,
                             num_heads=32, num_kv_heads=8, d_model=4096, mlp_dim=14336,
                             rope_base=500000.0, rope_scaling=_llama3_rope(8.0)),
        # Qwen 2.5 (q/k/v biases) and Qwen 3 (per-head q/k RMSNorm, head_size 128): the
        # shapes of Qwen/Qwen2.5-0.5B, -1.5B, Qwen/Qwen3-0.6B, -1.7B config.json.
        "qwen2.5-tiny": dict(_QWEN, qkv_bias=True, vocab_size=512, max_len=128, num_layers=2,
                             num_heads=4, num_kv_heads=2, d_model=64, mlp_dim=176),
        "qwen3-tiny": dict(_QWEN, qk_norm=True, vocab_size=512, max_len=128, num_layers=2,
                           num_heads=4, num_kv_heads=2, head_size=32, d_model=64, mlp_dim=176),
        "qwen2.5-0.5b": dict(_QWEN, qkv_bias=True, vocab_size=151936, max_len=32768,
                             num_layers=24, num_heads=14, num_kv_heads=2, d_model=896,
                             mlp_dim=4864),
        "qwen2.5-1.5b": dict(_QWEN, qkv_bias=True, vocab_size=151936, max_len=32768,
                             num_layers=28, num_heads=12, num_kv_heads=2, d_model=1536,
                             mlp_dim=8960),
        "qwen3-0.6b": dict(_QWEN, qk_norm=True, vocab_size=151936, max_len=40960,
                           num_layers=28, num_heads=16, num_kv_heads=8, head_size=128,
                           d_model=1024, mlp_dim=3072),
        "qwen3-1.7b": dict(_QWEN, qk_norm=True, vocab_size=151936, max_len=40960,
                           num_layers=28, num_heads=16, num_kv_heads=8, d_model=2048,
                           mlp_dim=6144),
        # Mistral: a Llama with a sliding window (HF sliding_window = attention_window);
        # mistral-7b is Mistral-7B-v0.1's config.json (rms_norm_eps 1e-5, rope_theta 1e4).
        "mistral-tiny": dict(_LLAMA, vocab_size=512, max_len=128, num_layers=2, num_heads=4,
                             num_kv_heads=2, d_model=64, mlp_dim=176, attention_window=16),
        "mistral-7b": dict(_LLAMA, vocab_size=32000, max_len=32768, num_layers=32, num_heads=32,
                           num_kv_heads=8, d_model=4096, mlp_dim=14336, attention_window=4096),
    }

    def __post_init__(self):
        """Every field on its own (base.py's helpers), then the relations between them."""
        self._require_positive("vocab_size", "max_len", "num_layers", "num_heads", "d_model")
        self._require_positive("num_kv_heads", "mlp_dim", "head_size", allow_none=True)
        object.__setattr__(self, "rope_scaling", RopeScaling.from_value(self.rope_scaling))
        self._require_choice("activation", ACTIVATIONS)
        self._require_choice("norm", ("layernorm", "rmsnorm"))
        self._require_number("norm_eps", minimum=0, exclusive_min=True)
        self._require_choice("position", ("learned", "rope"))
        self._require_number("rope_base", minimum=0, exclusive_min=True)
        self._require_bools("gated_mlp", "use_bias", "qkv_bias", "qk_norm", "tie_embeddings")
        self._require_rates("dropout_rate", "attention_dropout_rate")
        self._require_number("initializer_range", minimum=0)
        self._require_number("prefix_tokens", integer=True, minimum=0)
        self._require_model_settings()
        self._require_attention_options()
        if self.head_size is None:
            self._require_divisible("d_model", "num_heads")
        if self.num_kv_heads is not None:
            self._require_divisible("num_heads", "num_kv_heads")
        self._require_relation(self.position != "rope" or self.head_dim % 2 == 0,
                               ("position", "d_model", "num_heads"),
                               f"needs an even head_dim (head_size, or d_model / num_heads), "
                               f"got {self.head_dim}")
        self._require_relation(self.rope_scaling is None or self.position == "rope",
                               ("rope_scaling", "position"),
                               "rescales rotary positions: it needs position='rope'")
        self._require_relation(self.prefix_tokens < self.max_len, ("prefix_tokens", "max_len"),
                               "leaves no position for a token: prefix tuning numbers the "
                               f"tokens from prefix_tokens, below max_len={self.max_len}")

    @property
    def mlp_features(self) -> int:
        return self.mlp_dim or 4 * self.d_model

    @property
    def head_dim(self) -> int:
        return self.head_size or self.d_model // self.num_heads

    @property
    def layer_stacks(self) -> tuple[tuple[tuple[str, ...], str, int], ...]:
        """(parent path, name, count) of each layer stack: ``h_{i}``, scanned ``h``."""
        return (((), "h", self.num_layers),)

    def num_params(self, *, non_embedding: bool = False) -> int:
        """Parameter count from the config alone (equals HF's for the GPT-2 and Llama presets;
        a tied head counts once). ``non_embedding`` leaves out wte, wpe and an untied lm_head."""
        d, f, h = self.d_model, self.mlp_features, self.head_dim
        q, kv = self.num_heads * h, (self.num_kv_heads or self.num_heads) * h
        b, qkv_b = int(self.use_bias), int(self.use_bias or self.qkv_bias)
        norm = 2 * d if self.norm == "layernorm" else d
        attn = (2 * d * q + 2 * d * kv + qkv_b * (q + 2 * kv) + b * d
                + 2 * h * int(self.qk_norm))
        mlp = (2 if self.gated_mlp else 1) * (d * f + b * f) + f * d + b * d
        total = self.num_layers * (attn + mlp + 2 * norm) + norm
        emb = self.vocab_size * d + (self.max_len * d if self.position == "learned" else 0)
        if not self.tie_embeddings:
            emb += self.vocab_size * d
        return total if non_embedding else total + emb

    def flops_per_token(self, seq_len: int, *, frozen_base: bool = False) -> float:
        """Training FLOPs per token, PaLM/nanoGPT convention: 6 N + 12 L (N H) T.

        N excludes the lookups (the position table, and the token embedding of an untied
        model) but counts the V x D read-out matmul once: the tied embedding's transpose,
        or the untied ``lm_head``. ``frozen_base``: none of the N weights trains (LoRA,
        QLoRA, prefix tuning), so each costs 4, its forward and its input's gradient, not 6
        (no weight gradient); the adapters are the task's to add (``Task.flops_per_step``).
        """
        n = self.num_params(non_embedding=True) + self.vocab_size * self.d_model
        width = self.num_heads * self.head_dim               # N H (= D unless head_size)
        return ((4 if frozen_base else 6) * n
                + 12 * self.num_layers * width * self.attention_reach(seq_len))


class GPT(nn.Module):
    """Decoder-only language model. ``apply(variables, input_ids)`` -> logits (B, T, V) fp32."""
    config: GPTConfig

    @with_lora
    @nn.compact
    def __call__(self, input_ids: Array, attention_mask: Array | None = None,
                 position_ids: Array | None = None, *, deterministic: bool = True,
                 decode: bool = False, segment_ids: Array | None = None,
                 return_hidden: bool = False) -> Array:
        """input_ids (B, T) int; attention_mask (B, S) with 1 = real token (HF convention).

        Without ``decode``, S = T and the layers attend causally (``causal=True``: the
        kernels that can skip the masked blocks do). With ``decode=True``
        (a KV cache in the ``cache`` collection), ``attention_mask`` covers the whole cache
        length S_max and the attention layers add the causal part themselves;
        ``position_ids`` default to the running cache position.

        Packed documents: ``segment_ids`` (B, T) int (a token attends only to the earlier
        tokens of its own segment; not with ``decode``) with ``position_ids`` restarting at
        each document (``data.packing.document_fields``).

        Concrete ids outside [0, vocab_size) (learned positions: [0, max_len)) raise a
        UserError; under jit only inside ``models.checked`` (see ``models/__init__.py``).

        Prefix tuning (``prefix_tokens`` = P > 0; ``layers.multi_head.MultiHeadAttention``)
        numbers the tokens after the P virtual ones, as PEFT does with transformers' GPT-2
        (the prefix is a length-P KV cache there): every position, the default 0, 1, ...
        (PEFT's forward: P + arange(T), padding or not) and given ``position_ids`` alike
        (PEFT adds P to them; ``decode.generate`` passes the real-token count, HF
        ``generate`` the same), is shifted by P before the position table or RoPE.

        ``return_hidden=True``: ``(hidden (B, T, D) after ln_f, {"kernel": (D, V)})`` instead
        of the logits, for a loss that reads out in chunks (``losses.head_loss``).
        """
        cfg = self.config
        dtype, param_dtype = canonical_dtype(cfg.dtype), canonical_dtype(cfg.param_dtype)
        b, t = self._check_inputs(input_ids, attention_mask, decode)
        input_ids = check_ids("input_ids", input_ids, cfg)     # in [0, vocab_size) (base.py)
        segment_ids = check_segment_ids("segment_ids", segment_ids, (b, t), decode)
        if cfg.position == "learned":
            check_id_values("position_ids", position_ids, cfg, "max_len")
        prefix = cfg.prefix_tokens               # prefix tuning: tokens numbered from P
        if prefix and position_ids is not None:
            position_ids = jnp.asarray(position_ids) + prefix
            if cfg.position == "learned":
                check_id_values("position_ids + prefix_tokens", position_ids, cfg, "max_len")
        init = nn.initializers.normal(cfg.initializer_range)
        wte = Embed(cfg.vocab_size, cfg.d_model, dtype=dtype, param_dtype=param_dtype,
                    embedding_init=init, cpu_tuning=cfg.cpu_tuning, name="wte")
        x = wte(input_ids)
        if position_ids is None:
            start = prefix + running_position(self, t, decode)
            position_ids = start + jnp.arange(t)[None, :]
            rows = True           # one run of positions for every row: a slice of the table
        else:
            position_ids, rows = jnp.broadcast_to(position_ids, (b, t)), False
        if cfg.position == "learned":
            wpe = Embed(cfg.max_len, cfg.d_model, embedding_axes=(None, "embed"), dtype=dtype,
                        param_dtype=param_dtype, embedding_init=init, name="wpe")
            x = x + (wpe.rows(start, t)[None] if rows else wpe(position_ids))
        x = nn.Dropout(cfg.dropout_rate)(x, deterministic=deterministic)
        x = nn.with_logical_constraint(x, ("act_batch", "act_length", "act_embed"))
        mask = None if attention_mask is None else key_padding_mask(attention_mask)
        x = self._layers(x, mask, position_ids if cfg.position == "rope" else None,
                         deterministic, decode, segment_ids)
        x = make_norm(cfg.norm, cfg.norm_eps, dtype, param_dtype, name="ln_f")(x)
        if cfg.tie_embeddings:
            return (x, {"kernel": wte.readout_kernel()}) if return_hidden else wte.attend(x)
        head = Dense(cfg.vocab_size, use_bias=False, kernel_axes=("embed", "vocab"), dtype=dtype,
                     param_dtype=param_dtype, kernel_init=init, cpu_tuning=cfg.cpu_tuning,
                     name="lm_head")
        if return_hidden:
            return x, head(x, weights_only=True)
        return head(x).astype(jnp.float32)

    def _check_inputs(self, input_ids, attention_mask, decode: bool) -> tuple[int, int]:
        cfg = self.config
        if input_ids.ndim != 2:
            raise UserError(f"input_ids must be (B, T); got shape {input_ids.shape}")
        b, t = input_ids.shape
        prefix = cfg.prefix_tokens     # prefix tuning: the tokens are numbered from P
        # with a prefix, a KV cache's length too, when it is created (decode.generate's init)
        if t > cfg.max_len - prefix and (not decode or (prefix and self.is_initializing())):
            less = f" less its prefix_tokens={prefix}" if prefix else ""
            raise UserError(f"sequence length {t} exceeds the model's max_len={cfg.max_len}"
                            f"{less}; shorten the input or use a config with a larger max_len")
        check_causal_lm_mask(attention_mask, b, t, decode)
        return b, t

    def _layers(self, x, mask, rope_positions, deterministic: bool, decode: bool,
                segment_ids=None) -> Array:
        """The pre-norm decoder blocks (no cross-attention), causal; the mask holds padding."""
        cfg = self.config
        # GPT-2: residual projections scaled by 1/sqrt(2L) at init.
        out_init = nn.initializers.normal(cfg.initializer_range / math.sqrt(2 * cfg.num_layers))
        fields = dict(
            num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, mlp_dim=cfg.mlp_features,
            activation=cfg.activation, gated_mlp=cfg.gated_mlp, pre_norm=True, norm=cfg.norm,
            norm_eps=cfg.norm_eps, use_bias=cfg.use_bias, dropout_rate=cfg.dropout_rate,
            attention_dropout_rate=cfg.attention_dropout_rate,
            attention=cfg.attention, attention_impl=cfg.attention_impl,
            attention_pattern=cfg.attention_pattern,
            rope_base=cfg.rope_base if cfg.position == "rope" else None,
            rope_scaling=cfg.rope_scaling, head_dim=cfg.head_size,
            qkv_bias=cfg.qkv_bias or cfg.use_bias, qk_norm="rmsnorm" if cfg.qk_norm else None,
            dtype=canonical_dtype(cfg.dtype), param_dtype=canonical_dtype(cfg.param_dtype),
            kernel_init=nn.initializers.normal(cfg.initializer_range), out_kernel_init=out_init,
            cpu_tuning=cfg.cpu_tuning, cross_attention=False, prefix_tokens=cfg.prefix_tokens)
        return layer_stack(DecoderBlock, fields, cfg.num_layers, x, name="h",
                           operands={"self_mask": mask, "positions": rope_positions,
                                     "segment_ids": segment_ids},
                           static={"causal": True, "deterministic": deterministic,
                                   "decode": decode},
                           scan=cfg.scan_layers, remat=cfg.remat, remat_policy=cfg.remat_policy)


def init_params(model: GPT, rng: Array, batch_size: int = 1, seq_len: int | None = None):
    """Initialised, unboxed parameters."""
    seq_len = seq_len or min(model.config.max_len, 8)
    ids = jnp.zeros((batch_size, seq_len), jnp.int32)
    return nn.meta.unbox(model.init(rng, ids)["params"])
