"""The original encoder-decoder Transformer ("Attention Is All You Need", 2017), with KV-cache decoding.

Read top to bottom: config and presets -> stack -> model.

  input_ids (B, S) -> embed x sqrt(D) + PE[0:S] -> dropout
    -> L_enc x post-norm EncoderBlock (self-attention, ReLU FF)          = encoded (B, S, D)
  decoder_input_ids (B, T) -> embed x sqrt(D) + PE[0:T] -> dropout
    -> L_dec x post-norm DecoderBlock (causal self-attention, cross-attention, ReLU FF)
    -> logits (B, T, V) = x @ embed^T (fp32)

As in the paper: post-norm residual blocks ``x = LayerNorm(x + Dropout(Sublayer(x)))``
(``layers.EncoderBlock``/``DecoderBlock``), fixed sinusoidal positions
(``layers.sinusoidal_table``: sin on even, cos on odd columns), one embedding matrix shared
by the source, the target and the (tied) output projection, embeddings multiplied by
sqrt(d_model), dropout on the embedding sums and on every sublayer output. Options beyond
the paper: ``pre_norm`` (then a final LayerNorm per stack, ``final_norm``), an untied output
projection, attention and FF-hidden dropout.

Parameter names: ``embed/embedding`` (V, D); ``encoder/layers_{i}`` (``self_attn``
{query,key,value,out}, ``norm1``, ``mlp``{wi,wo}, ``norm2``) and ``decoder/layers_{i}``
(``self_attn``, ``norm1``, ``cross_attn``, ``norm2``, ``mlp``, ``norm3``) with biases, or
one scanned ``layers`` module per stack with ``scan_layers=True``;
``encoder/norm``, ``decoder/norm`` when ``final_norm``; ``lm_head/kernel`` when untied. The
stacks' trees are those of :class:`~transformer_jax.interop.torch_nn.modules.TorchTransformer`,
so weights of a ``torch.nn.Transformer`` (``final_norm=True``, ``norm_eps=1e-5``) convert
through ``interop.from_torch``.

Parameter count (``num_params``): every weight and bias once; the shared embedding counted
once (it is the source, target and output matrix); the sinusoidal table has no parameters.
With the paper's shared 37k BPE vocabulary: ``base`` 63,082,496 (the paper reports 65M),
``big`` 214,245,376 (paper: 213M).

KV cache: ``decode(..., decode=True)`` appends decoder tokens to the self-attention cache
(create it by a first call on inputs of the full length L with ``mutable=['cache']``; see
``transformer_jax.beam_search``); positions continue from the number of cached tokens.
Cross-attention keys/values are computed from the encoder output once, when the cache is
created, and reused at every step.

Inputs are named as in HF's encoder-decoders (``input_ids``, ``decoder_input_ids``,
``attention_mask``, ``decoder_attention_mask``), in ``torch.nn.Transformer``'s order:
source, target, source mask, target mask.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from ..errors import UserError
from ..layers.blocks import DecoderBlock, EncoderBlock
from ..layers.dense import Dense, Embed, canonical_dtype
from ..layers.embeddings import sinusoidal_table
from ..layers.lora import LoraConfig, with_lora
from ..layers.masks import key_padding_mask
from ..layers.mlp import ACTIVATIONS
from ..layers.norms import LayerNorm
from ..layers.stack import layer_stack
from .base import (EncoderDecoderConfig, PresetConfig, check_decoder_inputs, check_ids,
                   check_packed_decoder, check_positions, check_segment_ids, encode_then_decode)

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class TransformerConfig(EncoderDecoderConfig, PresetConfig):
    vocab_size: int = 37000                 # the paper's shared source/target BPE vocabulary
    max_len: int = 512                      # longest source or target (sinusoidal table rows)
    num_layers: int = 6                     # encoder layers
    num_decoder_layers: int | None = None   # default: num_layers
    d_model: int = 512
    num_heads: int = 8
    mlp_dim: int | None = None              # default 4 * d_model
    activation: str = "relu"
    dropout_rate: float = 0.1               # embedding sums and sublayer outputs (P_drop)
    attention_dropout_rate: float = 0.0
    mlp_dropout_rate: float = 0.0           # on the FF hidden activation
    norm_eps: float = 1e-6
    pre_norm: bool = False                  # the paper: post-norm
    final_norm: bool | None = None          # LayerNorm after each stack; default: pre_norm
    tie_embeddings: bool = True             # output projection = the shared embedding
    pad_token_id: int = 0
    eos_token_id: int = 1
    decoder_start_token_id: int = 0
    scan_layers: bool = False               # one scanned layer per stack
    remat: bool = False                     # recompute activations in the backward pass
    remat_policy: str = "nothing_saveable"
    attention_impl: str = "auto"            # layers.attention_dispatch.IMPLEMENTATIONS
    cpu_tuning: bool = True                 # layers/cpu_tuning.py on XLA:CPU
    dtype: str = "float32"
    param_dtype: str = "float32"
    lora: LoraConfig | None = None       # LoRA adapters (layers/lora.py); a dict is converted

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "tiny": dict(vocab_size=512, max_len=128, num_layers=2, d_model=64, num_heads=4,
                     mlp_dim=128),
        "base": dict(),
        "big": dict(d_model=1024, num_heads=16, mlp_dim=4096, dropout_rate=0.3),
    }

    def __post_init__(self):
        """Every field on its own (base.py's helpers), then the relations between them."""
        self._require_positive("vocab_size", "max_len", "num_layers", "d_model", "num_heads")
        self._require_positive("mlp_dim", "num_decoder_layers", allow_none=True)  # None: default
        if self.d_model % 2:
            raise self._bad("d_model", "an even integer (sinusoidal positions need an even d_model)")
        self._require_choice("activation", ACTIVATIONS)
        self._require_rates("dropout_rate", "attention_dropout_rate", "mlp_dropout_rate")
        self._require_number("norm_eps", minimum=0, exclusive_min=True)
        self._require_bools("pre_norm", "tie_embeddings")
        self._require_bools("final_norm", allow_none=True)                 # None: pre_norm
        self._require_model_settings()
        self._require_divisible("d_model", "num_heads")
        self._require_relation(not (self.pre_norm and self.final_norm is False),
                               ("final_norm", "pre_norm"),
                               "is refused: pre_norm=True needs final_norm (the residual stream "
                               "is never normalised otherwise); leave final_norm=None")
        self._require_token_ids("pad_token_id", "eos_token_id", "decoder_start_token_id")

    @property
    def has_final_norm(self) -> bool:
        return self.pre_norm if self.final_norm is None else self.final_norm

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @property
    def mlp_features(self) -> int:
        return self.mlp_dim or 4 * self.d_model

    def _layer_params(self) -> tuple[int, int]:
        d, f = self.d_model, self.mlp_features
        attn = 4 * (d * d + d)
        ff = d * f + f + f * d + d
        return attn + ff + 2 * 2 * d, 2 * attn + ff + 3 * 2 * d

    def num_params(self, *, non_embedding: bool = False) -> int:
        """Parameter count from the config alone (see the module docstring for what is counted)."""
        enc, dec = self._layer_params()
        total = self.num_layers * enc + self.decoder_layers * dec
        if self.has_final_norm:
            total += 2 * 2 * self.d_model
        if non_embedding:
            return total
        return total + self.vocab_size * self.d_model * (1 if self.tie_embeddings else 2)


# ----------------------------------------------------------------------------- stack

class TransformerStack(nn.Module):
    """Sinusoidal positions + dropout + the encoder or decoder layers [+ final LayerNorm]."""
    config: TransformerConfig
    is_decoder: bool = False

    @nn.compact
    def __call__(self, x: Array, mask: Array | None = None, memory: Array | None = None,
                 memory_mask: Array | None = None, *, deterministic: bool = True,
                 decode: bool = False, positions: Array | None = None,
                 segment_ids: Array | None = None,
                 memory_segment_ids: Array | None = None) -> Array:
        """x (B, T, D) scaled token embeddings; mask (B, 1, 1, T) key padding -> (B, T, D).
        Packed documents: ``segment_ids`` (B, T), ``positions`` (B, T) restarting at each
        document (rows of the sinusoid table), and the decoder's ``memory_segment_ids``."""
        cfg = self.config
        dtype, param_dtype = canonical_dtype(cfg.dtype), canonical_dtype(cfg.param_dtype)
        t, d = x.shape[1], x.shape[2]
        offset = 0
        if decode:
            if not self.is_decoder:
                raise UserError("decode=True is for the decoder stack; the encoder has no cache")
            started = self.has_variable("cache", "position_index")
            index = self.variable("cache", "position_index", lambda: jnp.array(0, jnp.int32))
            if started:
                offset = index.value
                index.value = index.value + t
        elif t > cfg.max_len:
            raise UserError(f"sequence length {t} exceeds the model's max_len={cfg.max_len}; "
                            "shorten the input or use a config with a larger max_len")
        table = sinusoidal_table(cfg.max_len, d)                                  # (P, D) fp32
        if positions is None:
            pe = jax.lax.dynamic_slice_in_dim(table, offset, t, axis=0)           # (T, D)
        else:
            pe = jnp.take(table, jnp.clip(positions, 0, cfg.max_len - 1), axis=0)  # (B, T, D)
        x = (x.astype(jnp.float32) + pe).astype(dtype)
        x = nn.Dropout(cfg.dropout_rate)(x, deterministic=deterministic)
        x = nn.with_logical_constraint(x, ("act_batch", "act_length", "act_embed"))
        fields = dict(num_heads=cfg.num_heads, mlp_dim=cfg.mlp_features,
                      activation=cfg.activation, pre_norm=cfg.pre_norm, norm="layernorm",
                      norm_eps=cfg.norm_eps, use_bias=True, dropout_rate=cfg.dropout_rate,
                      attention_dropout_rate=cfg.attention_dropout_rate,
                      mlp_dropout_rate=cfg.mlp_dropout_rate, attention_impl=cfg.attention_impl,
                      dtype=dtype, param_dtype=param_dtype,
                      kernel_init=nn.initializers.xavier_uniform(), cpu_tuning=cfg.cpu_tuning)
        stack = dict(scan=cfg.scan_layers, remat=cfg.remat, remat_policy=cfg.remat_policy)
        if self.is_decoder:
            x = layer_stack(DecoderBlock, fields, cfg.decoder_layers, x, name="layers",
                            operands={"memory": memory, "self_mask": mask,
                                      "cross_mask": memory_mask, "segment_ids": segment_ids,
                                      "memory_segment_ids": memory_segment_ids},
                            static={"causal": True, "deterministic": deterministic,
                                    "decode": decode}, **stack)
        else:
            x = layer_stack(EncoderBlock, fields, cfg.num_layers, x, name="layers",
                            operands={"mask": mask, "segment_ids": segment_ids},
                            static={"deterministic": deterministic}, **stack)
        if cfg.has_final_norm:
            x = LayerNorm(eps=cfg.norm_eps, dtype=dtype, param_dtype=param_dtype, name="norm")(x)
        return x


# ----------------------------------------------------------------------------- model

def _padding(name: str, mask: Array | None, shape: tuple[int, ...]) -> Array | None:
    if mask is None:
        return None
    mask = jnp.asarray(mask)
    if mask.shape != tuple(shape):
        raise UserError(f"{name} must be (B, length) = {tuple(shape)} with 1 = real token, "
                        f"0 = padding; got {tuple(mask.shape)}")
    return key_padding_mask(mask)


class Transformer(nn.Module):
    """``apply(variables, input_ids, decoder_input_ids, attention_mask=None,
    decoder_attention_mask=None)`` -> logits (B, T, V) fp32.

    Masks are (B, S) / (B, T) validity (1 = real token, 0 = padding); None = no padding.
    ``attention_mask`` masks the encoder's self-attention and the decoder's cross-attention;
    ``decoder_attention_mask`` masks padded decoder keys (the causal mask is always applied).
    Packed documents: ``segment_ids``/``positions`` (B, S) of the source tokens and
    ``decoder_segment_ids``/``decoder_positions`` (B, T) of the targets (the k-th source and
    target documents share an id; positions restart at each document); not with decode.
    """
    config: TransformerConfig

    def setup(self):
        cfg = self.config
        dtype, param_dtype = canonical_dtype(cfg.dtype), canonical_dtype(cfg.param_dtype)
        self.embed = Embed(cfg.vocab_size, cfg.d_model, dtype=dtype, param_dtype=param_dtype,
                           embedding_init=nn.initializers.normal(cfg.d_model ** -0.5),
                           cpu_tuning=cfg.cpu_tuning)
        self.encoder = TransformerStack(cfg, is_decoder=False)
        self.decoder = TransformerStack(cfg, is_decoder=True)
        if not cfg.tie_embeddings:
            self.lm_head = Dense(cfg.vocab_size, use_bias=False, kernel_axes=("embed", "vocab"),
                                 dtype=dtype, param_dtype=param_dtype,
                                 kernel_init=nn.initializers.xavier_uniform(),
                                 cpu_tuning=cfg.cpu_tuning)

    def _embed(self, ids: Array) -> Array:
        x = self.embed(ids)
        return x * jnp.asarray(math.sqrt(self.config.d_model), x.dtype)

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
        mask = _padding("attention_mask", attention_mask, input_ids.shape)
        return self.encoder(self._embed(input_ids), mask, deterministic=deterministic,
                            segment_ids=check_segment_ids("segment_ids", segment_ids,
                                                          input_ids.shape),
                            positions=check_positions("positions", positions, input_ids.shape))

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
        decoder_input_ids = check_decoder_inputs(decoder_input_ids, encoded,
                                                 decoder_attention_mask, decode, self.config)
        segment_ids, memory_segment_ids = check_packed_decoder(
            segment_ids, memory_segment_ids, decoder_input_ids.shape, encoded.shape[:2], decode)
        positions = check_positions("positions", positions, decoder_input_ids.shape)
        self_mask = _padding("decoder_attention_mask", decoder_attention_mask,
                             decoder_input_ids.shape)
        memory_mask = _padding("attention_mask", attention_mask, encoded.shape[:2])
        x = self.decoder(self._embed(decoder_input_ids), self_mask, encoded, memory_mask,
                         deterministic=deterministic, decode=decode, positions=positions,
                         segment_ids=segment_ids, memory_segment_ids=memory_segment_ids)
        if return_hidden:
            return x, ({"kernel": self.embed.readout_kernel()} if self.config.tie_embeddings
                       else self.lm_head(x, weights_only=True))
        if self.config.tie_embeddings:
            return self.embed.attend(x)
        return self.lm_head(x).astype(jnp.float32)


def init_params(model: Transformer, rng: Array, batch_size: int = 1, src_len: int = 8,
                tgt_len: int = 8):
    """Initialised, unboxed parameters."""
    src = jnp.zeros((batch_size, src_len), jnp.int32)
    tgt = jnp.zeros((batch_size, tgt_len), jnp.int32)
    return nn.meta.unbox(model.init(rng, src, tgt)["params"])
