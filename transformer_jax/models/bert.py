"""BERT: an encoder-only, post-norm Transformer with learned positions and segment embeddings.

Read top to bottom: config and presets -> the encoder (HF's ``BertModel``) -> the model
with its heads.

  input_ids (B, T), token_type_ids (B, T), attention_mask (B, T) (1 = real token)
    -> word (V, D) + position (P, D) + token-type (Y, D) embeddings -> LayerNorm -> dropout
    -> L x post-norm EncoderBlock (bidirectional self-attention over the real keys, GELU MLP)
    -> sequence output (B, T, D)
    -> pooler: tanh(Dense(sequence_output[:, 0]))  (the [CLS] position) -> pooled (B, D)

Heads (``BertConfig.head``; the subclasses below fix it):

  ``"pretraining"``     (HF ``BertForPreTraining``) -> ``{"mlm_logits": (B, T, V),
                        "nsp_logits": (B, 2)}``
  ``"mlm"``             (HF ``BertForMaskedLM``, no pooler) -> mlm logits (B, T, V)
  ``"base"``            (HF ``BertModel``) -> ``(sequence_output (B, T, D), pooled (B, D))``
  ``"classification"``  (HF ``BertForSequenceClassification``) -> logits (B, num_classes)

  MLM head: Dense(D) -> activation -> LayerNorm -> read-out through the word embedding
  (tied) + an output bias (V,). NSP head: Dense(2) on the pooled output. Classifier:
  pooled -> dropout -> Dense(num_classes). All logits are fp32.

Legend: B batch, T length, D width, N heads, H = D / N, F MLP width, V vocabulary,
P positions (``max_len``), Y token types (``type_vocab_size``), C classes.

Parameter names (unscanned)::

  bert/word_embeddings/embedding (V, D)      bert/position_embeddings/embedding (P, D)
  bert/token_type_embeddings/embedding (Y, D) bert/embeddings_norm/{scale,bias}
  bert/layer_{i}/{self_attn/{query,key,value,out}, norm1, mlp/{wi,wo}, norm2}
  bert/pooler/{kernel,bias}                  (every head but "mlm")
  mlm/transform/{kernel,bias}, mlm/transform_norm/{scale,bias}, mlm/bias (V,)
  nsp/{kernel,bias}                          ("pretraining")
  classifier/{kernel,bias}                   ("classification")

With ``scan_layers=True`` the layers are one module ``bert/layer`` whose parameters carry a
leading (L,) axis (logical axis ``layers``). The encoder lives under ``bert`` for every
head, so an MLM run's ``bert`` subtree initialises a classifier (``tasks/classify.py``).

Padding id. HF's word embedding is ``nn.Embedding(padding_idx=pad_token_id)``: the
pad row starts at zero and the *lookup* never sends it a gradient (the tied MLM read-out
still does). ``pad_token_id`` reproduces both; ``None`` turns them off.
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp

from ..errors import UserError
from ..layers.blocks import EncoderBlock
from ..layers.dense import Dense, Embed, canonical_dtype
from ..layers.lora import LoraConfig, with_lora
from ..layers.masks import key_padding_mask
from ..layers.mlp import ACTIVATIONS
from ..layers.norms import LayerNorm
from ..layers.stack import layer_stack
from .base import EfficientAttentionConfig, PresetConfig, check_id_values, check_segment_ids

Array = jax.Array

HEADS = ("pretraining", "mlm", "base", "classification")


@dataclasses.dataclass(frozen=True)
class BertConfig(EfficientAttentionConfig, PresetConfig):
    vocab_size: int = 30522
    max_len: int = 512                   # learned position table size (max_position_embeddings)
    type_vocab_size: int = 2             # segment (token type) table size
    num_layers: int = 12
    num_heads: int = 12
    d_model: int = 768
    mlp_dim: int | None = None           # default 4 * d_model (intermediate_size)
    activation: str = "gelu"             # exact erf GELU, as HF's "gelu"
    norm_eps: float = 1e-12
    dropout_rate: float = 0.1            # embedding and residual dropout (hidden_dropout_prob)
    attention_dropout_rate: float = 0.1
    classifier_dropout_rate: float | None = None   # None: dropout_rate (HF's classifier_dropout)
    initializer_range: float = 0.02
    pad_token_id: int | None = 0         # see the module docstring
    head: str = "pretraining"            # one of HEADS
    num_classes: int = 2                 # "classification" head only
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

    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "tiny": dict(vocab_size=512, max_len=128, num_layers=2, num_heads=4, d_model=64),
        "bert-base": dict(),
        "bert-large": dict(num_layers=24, num_heads=16, d_model=1024),
    }

    def __post_init__(self):
        """Every field on its own (base.py's helpers), then the relations between them."""
        self._require_positive("vocab_size", "max_len", "type_vocab_size", "num_layers",
                               "num_heads", "d_model", "num_classes")
        self._require_positive("mlp_dim", allow_none=True)                  # None: 4 * d_model
        self._require_choice("head", HEADS)
        self._require_choice("activation", ACTIVATIONS)
        self._require_number("norm_eps", minimum=0, exclusive_min=True)
        self._require_rates("dropout_rate", "attention_dropout_rate")
        self._require_rates("classifier_dropout_rate", allow_none=True)    # None: dropout_rate
        self._require_number("initializer_range", minimum=0)
        self._require_model_settings()
        self._require_attention_options()
        self._require_divisible("d_model", "num_heads")
        self._require_token_ids("pad_token_id", allow_none=True)           # None: no pad row

    @property
    def mlp_features(self) -> int:
        return self.mlp_dim or 4 * self.d_model

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @property
    def layer_stacks(self) -> tuple[tuple[tuple[str, ...], str, int], ...]:
        """(parent path, name, count) of each layer stack: ``bert/layer_{i}``, scanned ``bert/layer``."""
        return ((("bert",), "layer", self.num_layers),)

    @property
    def has_pooler(self) -> bool:
        return self.head != "mlm"

    def num_params(self, *, head: str | None = None, non_embedding: bool = False) -> int:
        """Parameter count from the config alone, for ``head`` (default: ``self.head``).

        Equals ``sum(p.numel() for p in model.parameters())`` of the HF class of that head
        (tied tensors counted once): for the default ``head="pretraining"`` that is
        ``BertForPreTraining`` (bert-base: 110,106,428; its ``BertModel`` alone: 109,482,240).
        ``non_embedding`` leaves out the three embedding tables.
        """
        head = self.head if head is None else head
        if head not in HEADS:
            raise UserError(f"unknown head {head!r}; choose one of {HEADS}")
        d, f, v = self.d_model, self.mlp_features, self.vocab_size
        tables = v * d + self.max_len * d + self.type_vocab_size * d
        embeddings = 2 * d                                       # embedding LayerNorm
        layer = 4 * (d * d + d) + (d * f + f) + (f * d + d) + 2 * 2 * d
        pooler = d * d + d
        mlm = (d * d + d) + 2 * d + v                            # transform, its norm, bias
        total = embeddings + self.num_layers * layer
        total += {"pretraining": pooler + mlm + 2 * d + 2, "mlm": mlm, "base": pooler,
                  "classification": pooler + d * self.num_classes + self.num_classes}[head]
        return total if non_embedding else total + tables

    def flops_per_token(self, seq_len: int, *, frozen_base: bool = False) -> float:
        """Training FLOPs per token, PaLM convention: 6 N + 12 L D T.

        N excludes the position and token-type tables (lookups) and, for heads without an
        MLM read-out, the word embedding too; with an MLM head the word embedding counts,
        since its transpose is the tied read-out matmul (evaluated at every position).
        ``frozen_base``: 4 per weight, not 6 (``GPTConfig.flops_per_token``).
        """
        n = self.num_params(non_embedding=True)
        if self.head in ("pretraining", "mlm"):
            n += self.vocab_size * self.d_model
        return ((4 if frozen_base else 6) * n
                + 12 * self.num_layers * self.d_model * self.attention_reach(seq_len))


# ----------------------------------------------------------------------------- layers

def _embedding_init(stddev: float, pad_id: int | None):
    """normal(stddev), with the pad row zeroed as torch's ``padding_idx`` does."""
    normal = nn.initializers.normal(stddev)

    def init(rng, shape, dtype=jnp.float32):
        table = normal(rng, shape, dtype)
        return table if pad_id is None else table.at[pad_id].set(0)
    return init


class BertEncoder(nn.Module):
    """Embeddings + post-norm layers (+ pooler): HF's ``BertModel``.

    ``__call__`` -> ``(sequence_output (B, T, D), pooled (B, D) or None)``; ``attend`` reads
    hidden states out through the word embedding (the MLM head's tied decoder).
    """
    config: BertConfig
    add_pooling_layer: bool = True

    def setup(self):
        cfg = self.config
        self.word_embeddings = Embed(
            cfg.vocab_size, cfg.d_model, dtype=canonical_dtype(cfg.dtype),
            param_dtype=canonical_dtype(cfg.param_dtype),
            embedding_init=_embedding_init(cfg.initializer_range, cfg.pad_token_id),
            cpu_tuning=cfg.cpu_tuning)

    def attend(self, x: Array) -> Array:
        """(B, T, D) -> (B, T, V) fp32 logits through the word-embedding table."""
        return self.word_embeddings.attend(x)

    @nn.compact
    def __call__(self, input_ids: Array, token_type_ids: Array | None = None,
                 attention_mask: Array | None = None, position_ids: Array | None = None, *,
                 deterministic: bool = True, segment_ids: Array | None = None,
                 return_hidden: bool = False):
        """``return_hidden=True`` (heads "mlm", "pretraining"): the MLM logits replaced by
        ``(transformed hidden (B, T, D), {"kernel": (D, V) tied, "bias": (V,)})``, for a loss
        that reads out in chunks (``losses.head_loss``)."""
        cfg = self.config
        dtype, param_dtype = canonical_dtype(cfg.dtype), canonical_dtype(cfg.param_dtype)
        input_ids = jnp.asarray(input_ids)
        if input_ids.ndim != 2:
            raise UserError(f"input_ids must be (B, T); got shape {input_ids.shape}")
        b, t = input_ids.shape
        if t > cfg.max_len:
            raise UserError(f"sequence length {t} exceeds the model's max_len={cfg.max_len}; "
                            "shorten the input or use a config with a larger max_len")
        for name, x in (("token_type_ids", token_type_ids), ("attention_mask", attention_mask)):
            if x is not None and jnp.shape(x) != (b, t):
                raise UserError(f"{name} must have the shape of input_ids {(b, t)}; got "
                                f"{jnp.shape(x)}")
        if not jnp.issubdtype(input_ids.dtype, jnp.integer):
            raise UserError(f"input_ids must be integer token ids; got dtype {input_ids.dtype}")
        # ids outside their tables: a UserError when concrete (models/base.py)
        for name, ids, field in (("input_ids", input_ids, "vocab_size"),
                                 ("token_type_ids", token_type_ids, "type_vocab_size"),
                                 ("position_ids", position_ids, "max_len")):
            check_id_values(name, ids, cfg, field)
        segment_ids = check_segment_ids("segment_ids", segment_ids, (b, t))
        init = nn.initializers.normal(cfg.initializer_range)
        token_type_ids = (jnp.zeros((b, t), jnp.int32) if token_type_ids is None
                          else jnp.asarray(token_type_ids))
        position_ids = jnp.broadcast_to(
            jnp.arange(t)[None, :] if position_ids is None else jnp.asarray(position_ids), (b, t))

        x = self.word_embeddings(input_ids)
        if cfg.pad_token_id is not None:      # torch's padding_idx: no lookup gradient to the pad row
            x = jnp.where((input_ids == cfg.pad_token_id)[..., None], jax.lax.stop_gradient(x), x)
        x = x + Embed(cfg.type_vocab_size, cfg.d_model, embedding_axes=(None, "embed"),
                      dtype=dtype, param_dtype=param_dtype, embedding_init=init,
                      name="token_type_embeddings")(token_type_ids)
        x = x + Embed(cfg.max_len, cfg.d_model, embedding_axes=(None, "embed"), dtype=dtype,
                      param_dtype=param_dtype, embedding_init=init,
                      name="position_embeddings")(position_ids)
        x = LayerNorm(eps=cfg.norm_eps, dtype=dtype, param_dtype=param_dtype,
                      name="embeddings_norm")(x)
        x = nn.Dropout(cfg.dropout_rate)(x, deterministic=deterministic)
        x = nn.with_logical_constraint(x, ("act_batch", "act_length", "act_embed"))

        mask = None if attention_mask is None else key_padding_mask(attention_mask)   # (B, 1, 1, T)
        fields = dict(
            num_heads=cfg.num_heads, mlp_dim=cfg.mlp_features, activation=cfg.activation,
            pre_norm=False, norm="layernorm", norm_eps=cfg.norm_eps, use_bias=True,
            dropout_rate=cfg.dropout_rate, attention_dropout_rate=cfg.attention_dropout_rate,
            attention=cfg.attention, attention_impl=cfg.attention_impl,
            attention_pattern=cfg.attention_pattern, dtype=dtype, param_dtype=param_dtype,
            kernel_init=init, cpu_tuning=cfg.cpu_tuning)
        x = layer_stack(EncoderBlock, fields, cfg.num_layers, x, name="layer",
                        operands={"mask": mask, "segment_ids": segment_ids},
                        static={"deterministic": deterministic},
                        scan=cfg.scan_layers, remat=cfg.remat, remat_policy=cfg.remat_policy)

        pooled = None
        if self.add_pooling_layer:
            pooled = jnp.tanh(Dense(cfg.d_model, kernel_axes=("embed", "mlp"), dtype=dtype,
                                    param_dtype=param_dtype, kernel_init=init,
                                    name="pooler")(x[:, 0]))
        return x, pooled


# ----------------------------------------------------------------------------- model

class Bert(nn.Module):
    """BERT with the head ``config.head``; see the module docstring for what each returns.

    ``apply(variables, input_ids, token_type_ids=None, attention_mask=None, position_ids=None,
    deterministic=True)``; ``attention_mask`` (B, T) has 1 for real tokens (HF convention),
    ``token_type_ids`` default to 0, ``position_ids`` to ``arange(T)``. Packed documents:
    ``segment_ids`` (B, T) int (a token attends only to its own document) with
    ``position_ids`` restarting at each document (the pooler reads the first token of a row).
    """
    config: BertConfig

    @with_lora
    @nn.compact
    def __call__(self, input_ids: Array, token_type_ids: Array | None = None,
                 attention_mask: Array | None = None, position_ids: Array | None = None, *,
                 deterministic: bool = True, segment_ids: Array | None = None,
                 return_hidden: bool = False):
        """``return_hidden=True`` (heads "mlm", "pretraining"): the MLM logits replaced by
        ``(transformed hidden (B, T, D), {"kernel": (D, V) tied, "bias": (V,)})``, for a loss
        that reads out in chunks (``losses.head_loss``)."""
        cfg = self.config
        dtype, param_dtype = canonical_dtype(cfg.dtype), canonical_dtype(cfg.param_dtype)
        init = nn.initializers.normal(cfg.initializer_range)
        bert = BertEncoder(cfg, add_pooling_layer=cfg.has_pooler, name="bert")
        sequence, pooled = bert(input_ids, token_type_ids, attention_mask, position_ids,
                                deterministic=deterministic, segment_ids=segment_ids)
        if cfg.head == "base":
            return sequence, pooled
        if cfg.head == "classification":
            rate = cfg.dropout_rate if cfg.classifier_dropout_rate is None else cfg.classifier_dropout_rate
            h = nn.Dropout(rate)(pooled, deterministic=deterministic)
            return Dense(cfg.num_classes, kernel_axes=("embed", None), dtype=dtype,
                         param_dtype=param_dtype, kernel_init=init,
                         name="classifier")(h).astype(jnp.float32)

        mlm_logits = BertMLMHead(cfg, name="mlm")(sequence, bert, return_hidden)
        if cfg.head == "mlm":
            return mlm_logits
        nsp_logits = Dense(2, kernel_axes=("embed", None), dtype=dtype, param_dtype=param_dtype,
                           kernel_init=init, name="nsp")(pooled).astype(jnp.float32)
        return {"mlm_logits": mlm_logits, "nsp_logits": nsp_logits}


class BertMLMHead(nn.Module):
    """transform Dense(D) -> activation -> LayerNorm -> tied read-out + bias (V,): fp32 logits."""
    config: BertConfig

    @nn.compact
    def __call__(self, sequence: Array, encoder: BertEncoder, return_hidden: bool = False):
        cfg = self.config
        dtype, param_dtype = canonical_dtype(cfg.dtype), canonical_dtype(cfg.param_dtype)
        h = Dense(cfg.d_model, kernel_axes=("embed", "mlp"), dtype=dtype, param_dtype=param_dtype,
                  kernel_init=nn.initializers.normal(cfg.initializer_range), name="transform")(sequence)
        h = ACTIVATIONS[cfg.activation](h)
        h = LayerNorm(eps=cfg.norm_eps, dtype=dtype, param_dtype=param_dtype,
                      name="transform_norm")(h)
        bias = self.param("bias", nn.with_logical_partitioning(nn.initializers.zeros, ("vocab",)),
                          (cfg.vocab_size,), param_dtype)
        if return_hidden:
            return h, {"kernel": encoder.word_embeddings.readout_kernel(), "bias": bias}
        return encoder.attend(h) + bias.astype(jnp.float32)


class _FixedHead(Bert):
    """``Bert`` whose ``config.head`` is set by the class (HF-style names)."""
    HEAD: ClassVar[str] = ""

    def __post_init__(self):
        if self.config.head != self.HEAD:
            object.__setattr__(self, "config", self.config.replace(head=self.HEAD))
        super().__post_init__()


class BertForPreTraining(_FixedHead):
    """-> ``{"mlm_logits": (B, T, V), "nsp_logits": (B, 2)}``."""
    HEAD = "pretraining"


class BertForMaskedLM(_FixedHead):
    """-> MLM logits (B, T, V); no pooler."""
    HEAD = "mlm"


class BertModel(_FixedHead):
    """-> ``(sequence_output (B, T, D), pooled_output (B, D))``."""
    HEAD = "base"


class BertForSequenceClassification(_FixedHead):
    """-> logits (B, num_classes)."""
    HEAD = "classification"


def init_params(model: Bert, rng: Array, batch_size: int = 1, seq_len: int | None = None):
    """Initialised, unboxed parameters."""
    seq_len = seq_len or min(model.config.max_len, 8)
    ids = jnp.zeros((batch_size, seq_len), jnp.int32)
    return nn.meta.unbox(model.init(rng, ids)["params"])
