"""CLIP: contrastive image-text pre-training (Radford et al. 2021), OpenAI's layout, as
Hugging Face's ``CLIPModel``.

Read top to bottom: config and presets -> pooling and normalisation (pure functions)
-> the text tower -> the model.

  images (B, H, W, C) NHWC -> vision tower: this library's ViT (``models/vit.py``) with
      no patch bias, a LayerNorm ``embedding_norm`` before the blocks and no head
      -> final norm, CLS token (B, D_v) fp32 -> ``visual_projection`` (no bias) -> (B, E)
  input_ids (B, T) -> text tower: ``token_embedding`` (B, T, D_t) + ``position_embedding``
      (T, D_t) -> dropout -> L_t pre-norm EncoderBlocks, causal self-attention
      -> ``final_norm`` -> the state at the end-of-text token (B, D_t) fp32
      -> ``text_projection`` (no bias) -> (B, E)
  both divided by their L2 norm; logits_per_image (B_img, B_txt) =
      min(exp(logit_scale), 100) * image_embeds @ text_embeds^T, logits_per_text its transpose

Shape legend: B batch, T text length, D width (D_v vision, D_t text), N heads, H head
dim, F MLP width, V vocabulary, E the joint embedding width (``projection_dim``); images
H/W/C and P the patch size, as in ``models/vit.py``.

Pooling. The caption is read at its end-of-text token (:func:`pooled_positions`):
``text_pooling="eos"``, the first ``eos_token_id`` in each row, or ``"argmax"``, the
largest id (OpenAI's code: its end-of-text token is the last id of its vocabulary). HF's
``CLIPTextTransformer`` chooses by the config's version: argmax for configs with
``eos_token_id == 2`` (written before transformers PR 24773, when the id was wrong), else
the first eos; ``interop.hf.clip`` maps that rule to this field both ways. A row without
the token pools at position 0, as in HF.

Logit scale. One learned scalar ``logit_scale`` (init ``logit_scale_init`` = ln(1/0.07));
the logits use ``min(exp(logit_scale), 100)``, the temperature clamped as in CLIP (OpenAI
clamps the parameter at ln 100 after each step; HF's forward does not clamp, and equals
ours below that bound). The scale used is returned as ``logit_scale``.

Parameter names (unscanned): ``vision`` (a ViT: ``embedding/kernel`` (P, P, C, D_v),
``cls``, ``pos_embedding``, ``embedding_norm``, ``encoderblock_{i}``, ``encoder_norm``),
``text`` (``token_embedding``, ``position_embedding``, ``layers_{i}`` (each an
``EncoderBlock``: norm1, self_attn{query,key,value,out}, norm2, mlp{wi,wo}),
``final_norm``), ``visual_projection/kernel`` (D_v, E), ``text_projection/kernel``
(D_t, E) and ``logit_scale`` (). With ``scan_layers=True`` each tower's blocks are one
module (``vision/encoderblock``, ``text/layers``) with a leading (L,) axis.

Dtype policy: matmuls in ``dtype``; LayerNorm statistics, softmax, both final norms, the
projections, the normalised embeddings and the logits in fp32.
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
from .base import EfficientAttentionConfig, PresetConfig, check_ids
from .vit import ViT, ViTConfig
from .vit import resize_params as vit_resize_params

Array = jax.Array

#: the largest temperature the logits use: ``min(exp(logit_scale), MAX_LOGIT_SCALE)``
MAX_LOGIT_SCALE = 100.0
#: where a caption is read: its first ``eos_token_id``, or its largest id (module docstring)
TEXT_POOLINGS = ("eos", "argmax")


@dataclasses.dataclass(frozen=True)
class CLIPConfig(EfficientAttentionConfig, PresetConfig):
    # images (the vision tower)
    image_size: int = 224                # square images, H = W
    patch_size: int = 32
    num_channels: int = 3
    vision_layers: int = 12
    vision_heads: int = 12
    vision_width: int = 768              # D_v
    vision_mlp_dim: int | None = None    # default 4 * vision_width
    # captions (the text tower)
    vocab_size: int = 49408
    max_len: int = 77                    # text positions (HF max_position_embeddings)
    eos_token_id: int = 49407            # end of text: where "eos" pooling reads
    pad_token_id: int | None = 1         # the tokenizer's pad id (not used by the model)
    text_pooling: str = "eos"            # or "argmax": at the largest id (TEXT_POOLINGS)
    text_layers: int = 12
    text_heads: int = 8
    text_width: int = 512                # D_t
    text_mlp_dim: int | None = None      # default 4 * text_width
    # the joint space
    projection_dim: int = 512            # E
    logit_scale_init: float = 2.6592     # ln(1 / 0.07)
    # both towers
    activation: str = "quick_gelu"       # OpenAI CLIP's x * sigmoid(1.702 x) (HF hidden_act)
    norm_eps: float = 1e-5
    dropout_rate: float = 0.0            # embedding and residual dropout (HF CLIP has none)
    attention_dropout_rate: float = 0.0
    initializer_range: float = 0.02      # embeddings
    scan_layers: bool = False            # one scanned layer per tower
    remat: bool = False                  # recompute activations in the backward pass
    remat_policy: str = "nothing_saveable"
    attention_impl: str = "auto"         # layers.attention_dispatch.IMPLEMENTATIONS
    attention: str = "softmax"           # or "linear" (models/base.py EfficientAttentionConfig)
    attention_window: int | None = None  # sliding window W (None: every key)
    attention_sparsity: str | None = None  # "strided:L" or "fixed:L:C" (Child et al. 2019)
    cpu_tuning: bool = True              # layers/cpu_tuning.py on XLA:CPU
    dtype: str = "float32"               # compute dtype
    param_dtype: str = "float32"
    lora: LoraConfig | None = None       # LoRA adapters (layers/lora.py), in both towers

    # OpenAI's checkpoints (HF's config.json of openai/clip-vit-*); the defaults are B/32.
    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {
        "tiny": dict(image_size=16, patch_size=4, vision_layers=2, vision_heads=4,
                     vision_width=64, vision_mlp_dim=128, vocab_size=512, max_len=32,
                     eos_token_id=1, pad_token_id=0, text_layers=2, text_heads=4,
                     text_width=64, text_mlp_dim=128, projection_dim=32),
        "clip-vit-base-patch32": dict(),
        "clip-vit-base-patch16": dict(patch_size=16),
        "clip-vit-large-patch14": dict(patch_size=14, vision_layers=24, vision_heads=16,
                                       vision_width=1024, text_layers=12, text_heads=12,
                                       text_width=768, projection_dim=768),
    }

    def __post_init__(self):
        """Every field on its own (base.py's helpers), then the relations between them."""
        self._require_positive("image_size", "patch_size", "num_channels", "vision_layers",
                               "vision_heads", "vision_width", "vocab_size", "max_len",
                               "text_layers", "text_heads", "text_width", "projection_dim")
        self._require_positive("vision_mlp_dim", "text_mlp_dim", allow_none=True)
        self._require_number("eos_token_id", integer=True, minimum=0)
        self._require_number("pad_token_id", integer=True, minimum=0, allow_none=True)
        self._require_number("logit_scale_init")
        self._require_choice("text_pooling", TEXT_POOLINGS)
        self._require_choice("activation", ACTIVATIONS)
        self._require_number("norm_eps", minimum=0, exclusive_min=True)
        self._require_rates("dropout_rate", "attention_dropout_rate")
        self._require_number("initializer_range", minimum=0)
        self._require_model_settings()
        self._require_attention_options()
        self._require_token_ids("eos_token_id")
        self._require_token_ids("pad_token_id", allow_none=True)
        self._require_divisible("vision_width", "vision_heads")
        self._require_divisible("text_width", "text_heads")
        self._require_relation(self.image_size % self.patch_size == 0, ("image_size", "patch_size"),
                               f"is not a multiple of patch_size={self.patch_size}; pick sizes "
                               "whose patches tile the image")

    @property
    def vision_mlp_features(self) -> int:
        return self.vision_mlp_dim or 4 * self.vision_width

    @property
    def text_mlp_features(self) -> int:
        return self.text_mlp_dim or 4 * self.text_width

    @property
    def text_head_dim(self) -> int:
        return self.text_width // self.text_heads

    @property
    def vision_head_dim(self) -> int:
        return self.vision_width // self.vision_heads

    @property
    def head_dim(self) -> int:
        """The text tower's H (``attention_plan`` and ``attention_reach`` describe the text
        tower at the run's ``seq_len``; the vision tower's are ``vision_config``'s)."""
        return self.text_head_dim

    @property
    def d_model(self) -> int:
        """The wider tower's width (what the Noam schedule scales by)."""
        return max(self.vision_width, self.text_width)

    @property
    def vision_config(self) -> ViTConfig:
        """The vision tower: a headless ViT without patch bias, with ``embedding_norm``."""
        return ViTConfig(
            image_size=self.image_size, patch_size=self.patch_size,
            num_channels=self.num_channels, num_classes=0, num_layers=self.vision_layers,
            num_heads=self.vision_heads, d_model=self.vision_width, mlp_dim=self.vision_mlp_dim,
            activation=self.activation, norm_eps=self.norm_eps, dropout_rate=self.dropout_rate,
            attention_dropout_rate=self.attention_dropout_rate,
            initializer_range=self.initializer_range, patch_bias=False, embedding_norm=True,
            scan_layers=self.scan_layers, remat=self.remat, remat_policy=self.remat_policy,
            attention_impl=self.attention_impl, attention=self.attention,
            attention_window=self.attention_window, attention_sparsity=self.attention_sparsity,
            cpu_tuning=self.cpu_tuning, dtype=self.dtype, param_dtype=self.param_dtype,
            lora=self.lora)

    @property
    def layer_stacks(self) -> tuple[tuple[tuple[str, ...], str, int], ...]:
        """(parent path, name, count) of each layer stack: ``vision/encoderblock_{i}`` and
        ``text/layers_{i}``; scanned ``vision/encoderblock`` and ``text/layers``."""
        return ((("vision",), "encoderblock", self.vision_layers),
                (("text",), "layers", self.text_layers))

    # -- parameter and FLOP counts ---------------------------------------------------
    def _text_layer_params(self) -> int:
        d, f = self.text_width, self.text_mlp_features
        return 4 * d * d + 4 * d + d * f + f + f * d + d + 2 * 2 * d     # attn, mlp, 2 norms

    def num_params(self, *, non_embedding: bool = False) -> int:
        """Parameter count from the config alone; equals HF ``CLIPModel``'s.
        ``non_embedding`` leaves out the token table and both position tables."""
        text_tables = (self.vocab_size + self.max_len) * self.text_width
        text = text_tables + self.text_layers * self._text_layer_params() + 2 * self.text_width
        joint = (self.vision_width + self.text_width) * self.projection_dim + 1  # + logit_scale
        total = self.vision_config.num_params() + text + joint
        if non_embedding:
            return total - text_tables - self.vision_config.seq_len * self.vision_width
        return total

    def flops_per_example(self, text_len: int | None = None, *,
                          frozen_base: bool = False) -> float:
        """Training FLOPs (forward + backward, PaLM convention) of one image and one caption
        of ``text_len`` tokens (default ``max_len``).

        The image: :meth:`ViTConfig.flops_per_image` of the vision tower, plus 6 D_v E for
        its projection. The caption: 6 x (block and final-norm weights) x T + 12 L_t D_t T
        x reach (T for full attention), plus 6 D_t E for its projection; the lookups are
        not counted. The (B_img, B_txt) similarity matrix (6 E per pair, so 6 E B per
        example) depends on the batch and is left out. ``frozen_base``: 4 per weight use,
        not 6 (no weight gradients).
        """
        t = self.max_len if text_len is None else text_len
        e, w = self.projection_dim, 4 if frozen_base else 6
        image = (self.vision_config.flops_per_image(frozen_base=frozen_base)
                 + w * self.vision_width * e)
        body = self.text_layers * self._text_layer_params() + 2 * self.text_width
        text = (w * body * t + 12 * self.text_layers * self.text_width * t * self.attention_reach(t)
                + w * self.text_width * e)
        return float(image + text)

    def flops_per_token(self, seq_len: int | None = None, *, frozen_base: bool = False) -> float:
        """:meth:`flops_per_example` per caption token (``seq_len`` tokens, default
        ``max_len``): a step of B pairs of T tokens costs ``B T flops_per_token(T)``."""
        t = self.max_len if seq_len is None else seq_len
        return self.flops_per_example(t, frozen_base=frozen_base) / t


# ============================================================================ pure functions

def pooled_positions(input_ids: Array, eos_token_id: int, pooling: str = "eos") -> Array:
    """(B,) the position whose final state stands for each caption (B, T): with ``"eos"``
    the first ``eos_token_id`` (0 for a row without it), with ``"argmax"`` the largest id
    (the first of equal ones), as HF's ``CLIPTextTransformer`` computes them."""
    if pooling not in TEXT_POOLINGS:
        raise UserError(f"unknown text pooling {pooling!r}; choose one of {TEXT_POOLINGS}")
    if pooling == "argmax":
        return jnp.argmax(input_ids, axis=-1)
    return jnp.argmax(input_ids == eos_token_id, axis=-1)


def l2_normalize(x: Array) -> Array:
    """``x / ||x||`` over the last axis, in fp32 (HF's ``CLIPModel``: no epsilon)."""
    x = x.astype(jnp.float32)
    return x / jnp.sqrt(jnp.sum(jnp.square(x), axis=-1, keepdims=True))


def _block_fields(cfg: CLIPConfig, heads: int, mlp_dim: int) -> dict[str, Any]:
    """The EncoderBlock fields of the text tower (the vision tower is a ViT's own)."""
    return dict(
        num_heads=heads, mlp_dim=mlp_dim, activation=cfg.activation, pre_norm=True,
        norm="layernorm", norm_eps=cfg.norm_eps, use_bias=True, dropout_rate=cfg.dropout_rate,
        attention_dropout_rate=cfg.attention_dropout_rate,
        attention=cfg.attention, attention_impl=cfg.attention_impl,
        attention_pattern=cfg.attention_pattern,
        dtype=canonical_dtype(cfg.dtype), param_dtype=canonical_dtype(cfg.param_dtype),
        cpu_tuning=cfg.cpu_tuning)


# ============================================================================ text tower

class CLIPTextTower(nn.Module):
    """Captions (B, T) -> the final state at each caption's end-of-text token (B, D_t) fp32."""
    config: CLIPConfig

    @nn.compact
    def __call__(self, input_ids: Array, attention_mask: Array | None = None, *,
                 deterministic: bool = True) -> Array:
        cfg = self.config
        dtype, param_dtype = canonical_dtype(cfg.dtype), canonical_dtype(cfg.param_dtype)
        input_ids = check_ids("input_ids", input_ids, cfg)       # in [0, vocab_size) (base.py)
        b, t = input_ids.shape
        if t > cfg.max_len:
            raise UserError(f"sequence length {t} exceeds the model's max_len={cfg.max_len}; "
                            "shorten the captions or use a config with a larger max_len")
        if attention_mask is not None and tuple(jnp.shape(attention_mask)) != (b, t):
            raise UserError(f"attention_mask must have the shape of input_ids {(b, t)} (1 = "
                            f"real token, 0 = padding); got {tuple(jnp.shape(attention_mask))}")
        init = nn.initializers.normal(cfg.initializer_range)
        x = Embed(cfg.vocab_size, cfg.text_width, dtype=dtype, param_dtype=param_dtype,
                  embedding_init=init, cpu_tuning=cfg.cpu_tuning,
                  name="token_embedding")(input_ids)                           # (B, T, D)
        positions = Embed(cfg.max_len, cfg.text_width, embedding_axes=(None, "embed"),
                          dtype=dtype, param_dtype=param_dtype, embedding_init=init,
                          name="position_embedding")
        x = x + positions.rows(0, t)[None]
        x = nn.Dropout(cfg.dropout_rate)(x, deterministic=deterministic)
        x = nn.with_logical_constraint(x, ("act_batch", "act_length", "act_embed"))
        mask = None if attention_mask is None else key_padding_mask(attention_mask)  # (B, 1, 1, T)
        x = layer_stack(EncoderBlock, _block_fields(cfg, cfg.text_heads, cfg.text_mlp_features),
                        cfg.text_layers, x, name="layers", operands={"mask": mask},
                        static={"causal": True, "deterministic": deterministic},
                        scan=cfg.scan_layers, remat=cfg.remat, remat_policy=cfg.remat_policy)
        x = LayerNorm(eps=cfg.norm_eps, dtype=jnp.float32, param_dtype=param_dtype,
                      name="final_norm")(x)                                    # (B, T, D) fp32
        where = pooled_positions(input_ids, cfg.eos_token_id, cfg.text_pooling)   # (B,)
        return x[jnp.arange(b), where]                                          # (B, D)


# ============================================================================ model

class CLIP(nn.Module):
    """``apply(variables, input_ids, images, attention_mask=None)`` -> a dict (see ``__call__``).

    ``method="encode_image"`` / ``"encode_text"`` give each tower's projected features alone.
    """
    config: CLIPConfig

    def setup(self):
        cfg = self.config
        param_dtype = canonical_dtype(cfg.param_dtype)
        self.vision = ViT(cfg.vision_config)
        self.text = CLIPTextTower(cfg)

        def projection(width: int) -> Dense:         # HF: normal(width^-1/2), no bias
            return Dense(cfg.projection_dim, use_bias=False, kernel_axes=("embed", None),
                         dtype=jnp.float32, param_dtype=param_dtype,
                         kernel_init=nn.initializers.normal(width ** -0.5))

        self.visual_projection = projection(cfg.vision_width)
        self.text_projection = projection(cfg.text_width)
        self.logit_scale = self.param(
            "logit_scale", nn.with_logical_partitioning(
                nn.initializers.constant(cfg.logit_scale_init), ()), (), param_dtype)

    @with_lora
    def encode_image(self, images: Array, *, deterministic: bool = True) -> Array:
        """images (B, H, W, C) -> image features (B, E) fp32, projected, not normalised
        (HF's ``get_image_features``)."""
        return self.visual_projection(self.vision(images, deterministic=deterministic))

    @with_lora
    def encode_text(self, input_ids: Array, attention_mask: Array | None = None, *,
                    deterministic: bool = True) -> Array:
        """input_ids (B, T), attention_mask (B, T) 1 = real token -> text features (B, E)
        fp32, projected, not normalised (HF's ``get_text_features``)."""
        return self.text_projection(self.text(input_ids, attention_mask,
                                              deterministic=deterministic))

    @with_lora
    def __call__(self, input_ids: Array, images: Array, attention_mask: Array | None = None,
                 *, deterministic: bool = True) -> dict[str, Array]:
        """Captions (B_txt, T) and images (B_img, H, W, C) -> fp32 arrays (HF's ``CLIPOutput``):

          ``logits_per_image`` (B_img, B_txt)  scale x cosine similarity;
          ``logits_per_text``  (B_txt, B_img)  its transpose;
          ``image_embeds`` (B_img, E), ``text_embeds`` (B_txt, E)  L2-normalised features;
          ``logit_scale`` ()  the scale used, ``min(exp(logit_scale), 100)``.
        """
        text_embeds = l2_normalize(self.encode_text(input_ids, attention_mask,   # ids checked first
                                                    deterministic=deterministic))
        image_embeds = l2_normalize(self.encode_image(images, deterministic=deterministic))
        scale = jnp.minimum(jnp.exp(self.logit_scale.astype(jnp.float32)), MAX_LOGIT_SCALE)
        logits_per_image = scale * (image_embeds @ text_embeds.T)          # (B_img, B_txt)
        return {"logits_per_image": logits_per_image, "logits_per_text": logits_per_image.T,
                "image_embeds": image_embeds, "text_embeds": text_embeds, "logit_scale": scale}


def init_params(model: CLIP, rng: Array, batch_size: int = 1, seq_len: int | None = None):
    """Initialised, unboxed parameters."""
    cfg = model.config
    ids = jnp.zeros((batch_size, seq_len or min(cfg.max_len, 8)), jnp.int32)
    images = jnp.zeros((batch_size, cfg.image_size, cfg.image_size, cfg.num_channels), jnp.float32)
    return nn.meta.unbox(model.init(rng, ids, images)["params"])


def resize_params(params: Any, config: CLIPConfig, image_size: int, *,
                  method: str = "bicubic") -> tuple[CLIPConfig, Any]:
    """``(config, params)`` for ``image_size``: the vision tower's position table resized
    (:func:`transformer_jax.models.vit.resize_params`), all else shared."""
    params = nn.meta.unbox(params)
    wrapped = set(params) == {"params"}
    tree = dict(params["params"] if wrapped else params)
    if "vision" not in tree:
        raise KeyError(f"no 'vision' in the CLIP params (top-level keys: {sorted(tree)})")
    _, tree["vision"] = vit_resize_params(tree["vision"], config.vision_config, image_size,
                                          method=method)
    new_cfg = config.replace(image_size=image_size)
    return new_cfg, ({"params": tree} if wrapped else tree)


__all__ = ["CLIP", "CLIPConfig", "CLIPTextTower", "MAX_LOGIT_SCALE", "TEXT_POOLINGS",
           "init_params", "l2_normalize", "pooled_positions", "resize_params"]
