"""T5: the text-to-text encoder-decoder (v1.0 and v1.1), with KV-cache decoding.

Read top to bottom: config and presets -> stack (relative position bias, the shared
pre-norm blocks) -> model. The blocks are ``layers.EncoderBlock``/``DecoderBlock`` with
RMSNorm, no biases and an attention scale of 1; they keep the KV caches.

  input_ids (B, S) -> shared (B, S, D) -> dropout
    -> L_enc x pre-norm block (self-attention + FF) -> RMSNorm -> dropout  = encoded (B, S, D)
  decoder_input_ids (B, T) -> shared (B, T, D) -> dropout
    -> L_dec x pre-norm block (causal self-attention, cross-attention over encoded, FF)
    -> RMSNorm -> dropout -> [x D^-0.5] -> logits (B, T, V) fp32

T5 specifics, as in the paper and Hugging Face's ``T5ForConditionalGeneration``:
  * RMSNorm ("T5 LayerNorm": no mean subtraction, no bias), pre-norm residual blocks;
    no bias in any dense layer;
  * attention logits are ``Q K^T + position bias`` *without* the 1/sqrt(H) factor (T5
    folds it into the query initialisation, std (D H)^-1/2);
  * relative position bias: bucketed relative positions (``layers.relative``) looked up
    in one (R, N) table per stack, computed once per stack and added to the self-attention
    logits of every layer; bidirectional buckets in the encoder, causal ones in the
    decoder; cross-attention has no position bias;
  * feed-forward: v1.0 ``relu`` (``wi``, ``wo``); v1.1 gated GELU (tanh approximation)
    ``gelu(x wi_0) * (x wi_1)``;
  * output head: tied to ``shared`` (v1.0; the decoder output is scaled by D^-1/2 before
    the tied read-out) or a separate ``lm_head`` (v1.1, no scaling). HF >= 5 decouples the
    scaling from the tying (``scale_decoder_outputs``); ``scale_decoder_output`` does too.
  * generation starts from ``decoder_start_token_id`` (the pad id, 0).

Parameter names: ``shared/embedding`` (V, D); ``encoder`` and ``decoder`` stacks, each with
``relative_attention_bias`` (R, N), ``layers_{i}`` (``norm1``, ``self_attn{query,key,value,
out}``, [decoder: ``norm2``, ``cross_attn``], ``norm2``|``norm3``, ``mlp{wi|wi_0,wi_1,wo}``)
and ``final_norm``; ``lm_head/kernel`` (D, V) when untied. Attention kernels: query/key/value
(D, N, H), out (N, H, D) with H = ``head_dim`` (HF's ``d_kv``; N H need not equal D). With
``scan_layers=True`` each stack's layers are one module ``layers`` whose parameters carry a
leading (L,) axis.

KV cache (``decode=True`` on ``decode``): self-attention keys/values are appended step by
step; cross-attention keys/values are computed from the encoder output once, when the
cache is created, and reused. Create the cache by calling ``decode`` with ``decode=True``
on decoder inputs of the full length L and ``mutable=['cache']`` (see
``transformer_jax.beam_search``); each later call appends its tokens, and the decoder
position bias uses the absolute query position (the number of cached tokens).
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from ..errors import UserError
from ..layers.blocks import DecoderBlock, EncoderBlock
from ..layers.dense import Dense, Embed, canonical_dtype
from ..layers.lora import LoraConfig, with_lora
from ..layers.masks import key_padding_mask
from ..layers.mlp import ACTIVATIONS
from ..layers.norms import RMSNorm
from ..layers.relative import relative_position_bias
from ..layers.stack import layer_stack
from .base import (EncoderDecoderConfig, PresetConfig, check_decoder_inputs, check_ids,
                   check_packed_decoder, check_positions, check_segment_ids, encode_then_decode)

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class T5Config(EncoderDecoderConfig, PresetConfig):
    # every attention call adds it: ``attention_plan`` names it (splash cannot add one)
    ATTENTION_BIAS: ClassVar[str] = "T5 relative positions"
    vocab_size: int = 32128
    d_model: int = 512
    num_heads: int = 8
    head_dim: int = 64                          # HF d_kv
    mlp_dim: int | None = None                  # HF d_ff; default 4 * d_model
    num_layers: int = 6                         # encoder layers
    num_decoder_layers: int | None = None       # default: num_layers
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    activation: str = "relu"                    # v1.0 "relu"; v1.1 "gelu_tanh" (HF gelu_new)
    gated_mlp: bool = False                     # v1.1: True
    norm_eps: float = 1e-6
    dropout_rate: float = 0.1                   # embeddings, residuals, FF hidden, attention weights
    tie_embeddings: bool = True                 # read out through `shared` (v1.0) or an lm_head (v1.1)
    scale_decoder_output: bool | None = None    # x D^-1/2 before the read-out; default: tie_embeddings
    pad_token_id: int = 0
    eos_token_id: int = 1
    decoder_start_token_id: int = 0
    initializer_factor: float = 1.0             # multiplies every init std (HF's meaning)
    scan_layers: bool = False                   # one scanned layer per stack
    remat: bool = False                         # recompute activations in the backward pass
    remat_policy: str = "nothing_saveable"
    attention_impl: str = "auto"                # layers.attention_dispatch.IMPLEMENTATIONS
    cpu_tuning: bool = True                     # layers/cpu_tuning.py on XLA:CPU
    dtype: str = "float32"                      # compute dtype
    param_dtype: str = "float32"
    lora: LoraConfig | None = None       # LoRA adapters (layers/lora.py); a dict is converted

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "tiny": dict(vocab_size=512, d_model=64, num_heads=4, head_dim=16, mlp_dim=128,
                     num_layers=2, relative_attention_num_buckets=16,
                     relative_attention_max_distance=64),
        "t5-small": dict(),
        "t5-base": dict(d_model=768, num_heads=12, mlp_dim=3072, num_layers=12),
        "t5-large": dict(d_model=1024, num_heads=16, mlp_dim=4096, num_layers=24),
        "t5-v1_1-small": dict(d_model=512, num_heads=6, mlp_dim=1024, num_layers=8,
                              activation="gelu_tanh", gated_mlp=True, tie_embeddings=False,
                              dropout_rate=0.0),
        "t5-v1_1-base": dict(d_model=768, num_heads=12, mlp_dim=2048, num_layers=12,
                             activation="gelu_tanh", gated_mlp=True, tie_embeddings=False,
                             dropout_rate=0.0),
    }

    def __post_init__(self):
        """Every field on its own (base.py's helpers), then the relations between them."""
        self._require_positive("vocab_size", "d_model", "num_heads", "head_dim", "num_layers",
                               "relative_attention_max_distance")
        self._require_positive("mlp_dim", "num_decoder_layers", allow_none=True)  # None: default
        even = " and even (half of them per direction in the encoder)"
        self._require_number("relative_attention_num_buckets", integer=True, minimum=4, hint=even)
        r = self.relative_attention_num_buckets
        if r % 2:
            raise self._bad("relative_attention_num_buckets", "an integer >= 4" + even)
        self._require_choice("activation", ACTIVATIONS,
                             " (v1.0: 'relu'; v1.1: 'gelu_tanh' with gated_mlp=True)")
        self._require_bools("gated_mlp", "tie_embeddings")
        self._require_bools("scale_decoder_output", allow_none=True)      # None: tie_embeddings
        self._require_number("norm_eps", minimum=0, exclusive_min=True)
        self._require_rates("dropout_rate")
        self._require_number("initializer_factor", minimum=0)
        self._require_model_settings()
        self._require_relation(self.relative_attention_max_distance > r // 2,
                               ("relative_attention_max_distance", "relative_attention_num_buckets"),
                               f"must exceed the {r // 2} exact buckets of the decoder "
                               "(relative_attention_num_buckets // 2)")
        self._require_token_ids("pad_token_id", "eos_token_id", "decoder_start_token_id")

    @property
    def mlp_features(self) -> int:
        return self.mlp_dim or 4 * self.d_model

    @property
    def inner_dim(self) -> int:
        """N H: the width of the concatenated heads (may differ from d_model)."""
        return self.num_heads * self.head_dim

    @property
    def scales_output(self) -> bool:
        return self.tie_embeddings if self.scale_decoder_output is None else self.scale_decoder_output

    def _layer_params(self) -> tuple[int, int]:
        d, i, f = self.d_model, self.inner_dim, self.mlp_features
        attn = 4 * d * i
        mlp = (2 if self.gated_mlp else 1) * d * f + f * d
        return attn + mlp + 2 * d, 2 * attn + mlp + 3 * d

    def num_params(self, *, non_embedding: bool = False) -> int:
        """Parameter count from the config alone; equals HF ``T5ForConditionalGeneration``'s
        (shared, encoder/decoder aliases and a tied lm_head counted once)."""
        enc, dec = self._layer_params()
        rel = 2 * self.relative_attention_num_buckets * self.num_heads
        total = self.num_layers * enc + self.decoder_layers * dec + 2 * self.d_model + rel
        if non_embedding:
            return total
        head = 0 if self.tie_embeddings else self.vocab_size * self.d_model
        return total + self.vocab_size * self.d_model + head


# ----------------------------------------------------------------------------- stack

def block_fields(cfg: T5Config) -> dict[str, Any]:
    """The shared blocks' fields for T5: pre-norm RMSNorm, no biases, attention scale 1 (T5
    folds 1/sqrt(H) into the query initialisation), dropout everywhere, HF's init stds."""
    f, d = cfg.initializer_factor, cfg.d_model
    normal = nn.initializers.normal
    return dict(
        num_heads=cfg.num_heads, head_dim=cfg.head_dim, mlp_dim=cfg.mlp_features,
        activation=cfg.activation, gated_mlp=cfg.gated_mlp, pre_norm=True, norm="rmsnorm",
        norm_eps=cfg.norm_eps, use_bias=False, norm_bias=False, dropout_rate=cfg.dropout_rate,
        attention_dropout_rate=cfg.dropout_rate, mlp_dropout_rate=cfg.dropout_rate,
        attention_impl=cfg.attention_impl, attention_scale=1.0,
        dtype=canonical_dtype(cfg.dtype), param_dtype=canonical_dtype(cfg.param_dtype),
        kernel_init=normal(f * d ** -0.5), query_kernel_init=normal(f * (d * cfg.head_dim) ** -0.5),
        out_kernel_init=normal(f * cfg.inner_dim ** -0.5),
        mlp_out_kernel_init=normal(f * cfg.mlp_features ** -0.5), cpu_tuning=cfg.cpu_tuning)


class T5Stack(nn.Module):
    """The encoder (``is_decoder=False``) or decoder stack, from embeddings to the final norm."""
    config: T5Config
    is_decoder: bool = False

    def _cached_length(self) -> int:
        """L of the decoder's self-attention cache (static: read from the cache's shape)."""
        cache = self.variables["cache"]
        layer = cache["layers"] if self.config.scan_layers else cache["layers_0"]
        return layer["self_attn"]["cached_key"].shape[-2]               # (..., N, L, H)

    def _position_bias(self, t: int, decode: bool, positions: Array | None = None) -> Array:
        """The relative position bias (1, N, T, S), computed once and shared by every layer;
        from per-row ``positions`` (B, T) (packed documents), (B, N, T, T)."""
        cfg = self.config
        table = self.param(
            "relative_attention_bias",
            nn.with_logical_partitioning(
                nn.initializers.normal(cfg.initializer_factor * cfg.d_model ** -0.5), (None, "heads")),
            (cfg.relative_attention_num_buckets, cfg.num_heads), canonical_dtype(cfg.param_dtype))
        q_offset, k_len = 0, t
        if decode:
            if not self.is_decoder:
                raise UserError("decode=True is for the decoder stack; the encoder has no cache")
            started = self.has_variable("cache", "position_index")
            index = self.variable("cache", "position_index", lambda: jnp.array(0, jnp.int32))
            if started:
                q_offset, k_len = index.value, self._cached_length()
                index.value = index.value + t
        return relative_position_bias(table, t, k_len, bidirectional=not self.is_decoder,
                                      max_distance=cfg.relative_attention_max_distance,
                                      q_offset=q_offset, q_positions=positions,
                                      k_positions=positions)

    @nn.compact
    def __call__(self, x: Array, mask: Array | None = None, memory: Array | None = None,
                 memory_mask: Array | None = None, *, deterministic: bool = True,
                 decode: bool = False, positions: Array | None = None,
                 segment_ids: Array | None = None,
                 memory_segment_ids: Array | None = None) -> Array:
        """x (B, T, D) embeddings; mask (B|1, 1, T|1, T) bool; memory (B, S, D) -> (B, T, D).
        Packed documents: ``segment_ids`` (B, T), ``positions`` (B, T) restarting at each
        document, and the decoder's ``memory_segment_ids`` (B, S)."""
        cfg = self.config
        bias = self._position_bias(x.shape[1], decode, positions)
        x = nn.Dropout(cfg.dropout_rate)(x, deterministic=deterministic)
        stack = dict(scan=cfg.scan_layers, remat=cfg.remat, remat_policy=cfg.remat_policy)
        if self.is_decoder:
            x = layer_stack(DecoderBlock, block_fields(cfg), cfg.decoder_layers, x, name="layers",
                            operands={"memory": memory, "self_mask": mask,
                                      "cross_mask": memory_mask, "self_bias": bias,
                                      "segment_ids": segment_ids,
                                      "memory_segment_ids": memory_segment_ids},
                            static={"causal": True, "deterministic": deterministic,
                                    "decode": decode}, **stack)
        else:
            x = layer_stack(EncoderBlock, block_fields(cfg), cfg.num_layers, x, name="layers",
                            operands={"mask": mask, "bias": bias, "segment_ids": segment_ids},
                            static={"deterministic": deterministic}, **stack)
        x = RMSNorm(eps=cfg.norm_eps, dtype=canonical_dtype(cfg.dtype),
                    param_dtype=canonical_dtype(cfg.param_dtype), name="final_norm")(x)
        return nn.Dropout(cfg.dropout_rate)(x, deterministic=deterministic)


# ----------------------------------------------------------------------------- model

def _check_mask(name: str, mask: Array | None, ids: Array, what: str) -> Array | None:
    if mask is None:
        return None
    mask = jnp.asarray(mask)
    if mask.shape != ids.shape:
        raise UserError(f"{name} must have the shape of {what} {tuple(ids.shape)} (1 = real "
                        f"token, 0 = padding); got {tuple(mask.shape)}")
    return mask


class T5(nn.Module):
    """``apply(variables, input_ids, decoder_input_ids, attention_mask=None)`` -> logits (B, T, V) fp32.

    ``attention_mask`` (B, S): 1 = real source token, 0 = padding (HF convention); it masks
    the encoder's self-attention and the decoder's cross-attention. ``decoder_attention_mask``
    (B, T) optionally masks padded decoder keys (right padding needs none: attention is causal).
    Packed documents: ``segment_ids``/``positions`` (B, S) of the source tokens and
    ``decoder_segment_ids``/``decoder_positions`` (B, T) of the targets (the k-th source and
    target documents share an id; positions restart at each document); not with decode.
    """
    config: T5Config

    def setup(self):
        cfg = self.config
        dtype, param_dtype = canonical_dtype(cfg.dtype), canonical_dtype(cfg.param_dtype)
        self.shared = Embed(cfg.vocab_size, cfg.d_model, dtype=dtype, param_dtype=param_dtype,
                            embedding_init=nn.initializers.normal(cfg.initializer_factor),
                            cpu_tuning=cfg.cpu_tuning)
        self.encoder = T5Stack(cfg, is_decoder=False)
        self.decoder = T5Stack(cfg, is_decoder=True)
        if not cfg.tie_embeddings:
            self.lm_head = Dense(cfg.vocab_size, use_bias=False, kernel_axes=("embed", "vocab"),
                                 dtype=dtype, param_dtype=param_dtype,
                                 kernel_init=nn.initializers.normal(cfg.initializer_factor),
                                 cpu_tuning=cfg.cpu_tuning)

    @with_lora
    def __call__(self, input_ids: Array, decoder_input_ids: Array,
                 attention_mask: Array | None = None, decoder_attention_mask: Array | None = None,
                 *, deterministic: bool = True, segment_ids: Array | None = None,
                 positions: Array | None = None, decoder_segment_ids: Array | None = None,
                 decoder_positions: Array | None = None, return_hidden: bool = False) -> Array:
        return encode_then_decode(self, input_ids, decoder_input_ids, attention_mask,
                                  decoder_attention_mask, deterministic,
                                  segment_ids=segment_ids, positions=positions,
                                  decoder_segment_ids=decoder_segment_ids,
                                  decoder_positions=decoder_positions,
                                  return_hidden=return_hidden)

    @with_lora
    def encode(self, input_ids: Array, attention_mask: Array | None = None, *,
               deterministic: bool = True, segment_ids: Array | None = None,
               positions: Array | None = None) -> Array:
        """input_ids (B, S) -> encoder output (B, S, D)."""
        input_ids = check_ids("input_ids", input_ids, self.config)   # in [0, vocab_size)
        segment_ids = check_segment_ids("segment_ids", segment_ids, input_ids.shape)
        positions = check_positions("positions", positions, input_ids.shape)
        attention_mask = _check_mask("attention_mask", attention_mask, input_ids, "input_ids")
        mask = None if attention_mask is None else key_padding_mask(attention_mask)
        x = self.shared(input_ids)
        x = nn.with_logical_constraint(x, ("act_batch", "act_length", "act_embed"))
        return self.encoder(x, mask, deterministic=deterministic, positions=positions,
                            segment_ids=segment_ids)

    @with_lora
    def decode(self, decoder_input_ids: Array, encoded: Array, attention_mask: Array | None = None,
               decoder_attention_mask: Array | None = None, *, deterministic: bool = True,
               decode: bool = False, segment_ids: Array | None = None,
               positions: Array | None = None,
               memory_segment_ids: Array | None = None, return_hidden: bool = False) -> Array:
        """decoder_input_ids (B, T), encoder output (B, S, D) -> logits (B, T, V) fp32.

        ``attention_mask`` (B, S) is the *source* padding mask. With ``decode=True`` the
        tokens are appended to the KV cache (``decoder_attention_mask`` must then be None).
        Packed documents: the targets' ``segment_ids``/``positions`` (B, T) and the source's
        ``memory_segment_ids`` (B, S). ``return_hidden=True``: ``(hidden (B, T, D) as read
        out, {"kernel": (D, V)})`` instead of the logits (``losses.head_loss``).
        """
        cfg = self.config
        decoder_input_ids = check_decoder_inputs(decoder_input_ids, encoded,
                                                 decoder_attention_mask, decode, self.config)
        segment_ids, memory_segment_ids = check_packed_decoder(
            segment_ids, memory_segment_ids, decoder_input_ids.shape, encoded.shape[:2], decode)
        positions = check_positions("positions", positions, decoder_input_ids.shape)
        if attention_mask is not None and tuple(jnp.shape(attention_mask)) != encoded.shape[:2]:
            raise UserError(f"attention_mask must be (B, S) = {encoded.shape[:2]}, the source "
                            f"padding mask; got {tuple(jnp.shape(attention_mask))}")
        decoder_attention_mask = _check_mask("decoder_attention_mask", decoder_attention_mask,
                                             decoder_input_ids, "decoder_input_ids")
        self_mask = None if decoder_attention_mask is None else key_padding_mask(decoder_attention_mask)
        memory_mask = None if attention_mask is None else key_padding_mask(attention_mask)
        x = self.shared(decoder_input_ids)
        x = nn.with_logical_constraint(x, ("act_batch", "act_length", "act_embed"))
        x = self.decoder(x, self_mask, encoded, memory_mask, deterministic=deterministic,
                         decode=decode, positions=positions, segment_ids=segment_ids,
                         memory_segment_ids=memory_segment_ids)
        if cfg.scales_output:
            x = x * jnp.asarray(cfg.d_model ** -0.5, x.dtype)
        if return_hidden:
            return x, ({"kernel": self.shared.readout_kernel()} if cfg.tie_embeddings
                       else self.lm_head(x, weights_only=True))
        if cfg.tie_embeddings:
            return self.shared.attend(x)
        return self.lm_head(x).astype(jnp.float32)


def init_params(model: T5, rng: Array, batch_size: int = 1, src_len: int = 8, tgt_len: int = 8):
    """Initialised, unboxed parameters."""
    src = jnp.zeros((batch_size, src_len), jnp.int32)
    tgt = jnp.zeros((batch_size, tgt_len), jnp.int32)
    return nn.meta.unbox(model.init(rng, src, tgt)["params"])


def shift_right(labels: Array, decoder_start_token_id: int, pad_token_id: int = 0) -> Array:
    """Decoder inputs from labels (B, T): ``[start, labels[:-1]]``; -100 (HF's ignore) -> pad."""
    labels = jnp.asarray(labels)
    shifted = jnp.concatenate(
        [jnp.full(labels.shape[:-1] + (1,), decoder_start_token_id, labels.dtype), labels[..., :-1]],
        axis=-1)
    return jnp.where(shifted == -100, pad_token_id, shifted)
