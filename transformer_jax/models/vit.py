"""ViT: the Vision Transformer (Dosovitskiy et al. 2020), big_vision layout, CLS-token head.

Read top to bottom: config and presets -> position-embedding resizing (pure functions)
-> the model.

  images (B, H, W, C) NHWC
    -> patches (B, N, P, P, C), N = (H/P) * (W/P) in row-major grid order
    -> patch embedding ``embedding`` (B, N, D)     [a stride-P, kernel-P convolution]
    -> prepend the learned CLS token ``cls`` (B, N+1, D) -> + ``pos_embedding`` (N+1, D)
    -> [``embedding_norm``: a LayerNorm, CLIP's ``pre_layrnorm``]
    -> dropout -> L x pre-norm EncoderBlock (self-attention, GELU MLP)
    -> final LayerNorm ``encoder_norm`` -> CLS token (B, D) -> ``head`` -> logits (B, K) fp32

Shape legend: B batch, H/W image height/width, C channels, P patch size, G grid side
(H/P), N patches (G*G), T tokens (N + 1), D width, F MLP width, K classes.

Patch embedding. A convolution with kernel = stride = P and no padding is a matmul over
non-overlapping patches, so the image is cut into patches by a reshape and the patches
are contracted with a ``Dense`` whose kernel is (P, P, C, D): (kernel rows, kernel
columns, input channels, output features), i.e. exactly ``nn.Conv``'s HWIO layout
(PyTorch's ``Conv2d`` stores OIHW = (D, C, P, P); the HF converter transposes). Patches
are numbered row by row (token 1 + i*G + j is grid cell (i, j)), as PyTorch's
``conv(x).flatten(2).transpose(1, 2)``.

Position embeddings are learned, one per token including the CLS token (as HF; big_vision
adds none to the CLS token). For another image size, :func:`resize_pos_embedding`
interpolates the patch-grid part (bicubic by default, the same arithmetic as HF's
``interpolate_pos_encoding``) and keeps the CLS row; :func:`resize_params` applies it to
a parameter tree. The model itself only accepts images of ``config.image_size``.

CLIP's vision tower (``models/clip.py``) is this ViT with ``patch_bias=False`` (its patch
convolution has no bias), ``embedding_norm=True`` (a LayerNorm on the embeddings before
the blocks) and ``num_classes=0``: HF's ``post_layernorm`` on the CLS token is our
``encoder_norm`` (per token) followed by taking the CLS token. The defaults keep the
plain ViT: the same parameters and the same numbers.

Parameter names (unscanned): ``embedding`` {kernel (P, P, C, D), bias (D,)}, ``cls`` (D,),
``pos_embedding`` (T, D), ``embedding_norm`` {scale, bias} (only with ``embedding_norm=True``),
``encoderblock_0`` ... ``encoderblock_{L-1}`` (each an
``EncoderBlock``: norm1, self_attn{query,key,value,out}, norm2, mlp{wi,wo}),
``encoder_norm`` and, when ``num_classes > 0``, ``head`` {kernel (D, K), bias (K,)}. With
``scan_layers=True`` the blocks are one module ``encoderblock`` whose parameters carry a
leading (L,) axis (logical axis ``layers``).

Dtype policy: matmuls in ``dtype``; LayerNorm statistics, softmax and the head (logits)
in fp32.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, ClassVar

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from ..errors import UserError
from ..layers.blocks import EncoderBlock
from ..layers.dense import Dense, canonical_dtype
from ..layers.lora import LoraConfig, with_lora
from ..layers.mlp import ACTIVATIONS
from ..layers.norms import LayerNorm
from ..layers.stack import convert_layout, layer_stack
from .base import EfficientAttentionConfig, PresetConfig

Array = jax.Array

#: The ViT paper's model variants: name -> (width D, depth L, heads, MLP width F).
VARIANTS: dict[str, tuple[int, int, int, int]] = {
    "Ti": (192, 12, 3, 768),
    "S": (384, 12, 6, 1536),
    "B": (768, 12, 12, 3072),
    "L": (1024, 24, 16, 4096),
}


def _variant_presets() -> dict[str, dict[str, Any]]:
    """``"B/16"`` etc.: a variant of :data:`VARIANTS` with patch size 16 or 32."""
    out = {}
    for name, (width, depth, heads, mlp) in VARIANTS.items():
        for patch in (16, 32):
            out[f"{name}/{patch}"] = dict(d_model=width, num_layers=depth, num_heads=heads,
                                          mlp_dim=mlp, patch_size=patch)
    return out


@dataclasses.dataclass(frozen=True)
class ViTConfig(EfficientAttentionConfig, PresetConfig):
    image_size: int = 224                # square images, H = W
    patch_size: int = 16
    num_channels: int = 3
    num_classes: int = 1000              # 0: no head, apply returns the CLS representation (B, D)
    num_layers: int = 12
    num_heads: int = 12
    d_model: int = 768
    mlp_dim: int | None = None           # default 4 * d_model
    activation: str = "gelu"             # exact (erf) GELU, as ViT and HF's "gelu"
    norm_eps: float = 1e-6               # big_vision / flax default (HF configs often say 1e-12)
    dropout_rate: float = 0.0            # embedding and residual dropout
    attention_dropout_rate: float = 0.0
    initializer_range: float = 0.02      # position embeddings
    head_zeroinit: bool = True           # big_vision: the classifier starts at zero
    patch_bias: bool = True              # a bias on the patch embedding (CLIP has none)
    embedding_norm: bool = False         # LayerNorm before the blocks (CLIP's pre_layrnorm)
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
        "tiny": dict(image_size=16, patch_size=4, num_classes=10, num_layers=2, num_heads=4,
                     d_model=64, mlp_dim=128),
        **_variant_presets(),
    }

    def __post_init__(self):
        """Every field on its own (base.py's helpers), then the relations between them."""
        self._require_positive("image_size", "patch_size", "num_channels", "num_layers",
                               "num_heads", "d_model")
        self._require_number("num_classes", integer=True, minimum=0, hint=" (0 = no head)")
        self._require_positive("mlp_dim", allow_none=True)                  # None: 4 * d_model
        self._require_choice("activation", ACTIVATIONS)
        self._require_number("norm_eps", minimum=0, exclusive_min=True)
        self._require_rates("dropout_rate", "attention_dropout_rate")
        self._require_number("initializer_range", minimum=0)
        self._require_bools("head_zeroinit", "patch_bias", "embedding_norm")
        self._require_model_settings()
        self._require_attention_options()
        self._require_divisible("d_model", "num_heads")
        self._require_relation(self.image_size % self.patch_size == 0, ("image_size", "patch_size"),
                               f"is not a multiple of patch_size={self.patch_size}; pick sizes "
                               "whose patches tile the image")

    @property
    def mlp_features(self) -> int:
        return self.mlp_dim or 4 * self.d_model

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads

    @property
    def layer_stacks(self) -> tuple[tuple[tuple[str, ...], str, int], ...]:
        """(parent path, name, count) of each layer stack: ``encoderblock_{i}``, scanned ``encoderblock``."""
        return (((), "encoderblock", self.num_layers),)

    @property
    def grid_size(self) -> int:
        """G: patches per image side."""
        return self.image_size // self.patch_size

    @property
    def num_patches(self) -> int:
        return self.grid_size ** 2

    @property
    def seq_len(self) -> int:
        """T: tokens per image, the patches plus the CLS token."""
        return self.num_patches + 1

    # -- parameter and FLOP counts ---------------------------------------------------
    def _patch_params(self) -> int:
        return self.patch_size ** 2 * self.num_channels * self.d_model + self.d_model * self.patch_bias

    def _layer_params(self) -> int:
        d, f = self.d_model, self.mlp_features
        attn = 4 * d * d + 4 * d
        mlp = d * f + f + f * d + d
        return attn + mlp + 2 * 2 * d                        # + norm1, norm2

    def _head_params(self) -> int:
        return self.d_model * self.num_classes + self.num_classes

    def num_params(self) -> int:
        """Parameter count from the config alone.

        Equals HF ``ViTForImageClassification`` with ``num_labels = num_classes``: HF's
        ``ViTModel`` pooler (a dense + tanh on the CLS token) is *not* built by the
        classification model (``add_pooling_layer=False``), and not here either.
        """
        d = self.d_model
        embed = self._patch_params() + d + self.seq_len * d          # patches, cls, positions
        embed += 2 * d * self.embedding_norm
        return (embed + self.num_layers * self._layer_params() + 2 * d  # + encoder_norm
                + self._head_params())

    def flops_per_image(self, seq_len: int | None = None, *, frozen_base: bool = False) -> float:
        """Training FLOPs of one image (forward + backward), PaLM convention.

        6 x (parameters used) x (tokens that use them) + 12 L D T^2 for attention:
        the patch embedding runs on the N = T - 1 patches, the blocks and the final norm
        on all T tokens, the head once per image; the CLS token and the position table
        are additions (no matmul) and are not counted. ``frozen_base``: 4 per parameter
        use, not 6 (no weight gradients).
        """
        t = self.seq_len if seq_len is None else seq_len
        w = 4 if frozen_base else 6
        body = self.num_layers * self._layer_params() + 2 * self.d_model
        return (w * self._patch_params() * (t - 1) + w * body * t + w * self._head_params()
                + 12 * self.num_layers * self.d_model * t * self.attention_reach(t))

    def flops_per_token(self, seq_len: int | None = None, *, frozen_base: bool = False) -> float:
        """:meth:`flops_per_image` / T, T = patches + 1 (``seq_len`` defaults to ``self.seq_len``)."""
        t = self.seq_len if seq_len is None else seq_len
        return self.flops_per_image(t, frozen_base=frozen_base) / t


# ============================================================================ resizing

POS_INTERPOLATIONS = ("bicubic", "bilinear")


def _cubic_weights(t: np.ndarray, a: float = -0.75) -> np.ndarray:
    """Keys cubic-convolution weights of the 4 taps at offsets -1, 0, 1, 2 for fractions t."""
    def near(x):            # |x| <= 1
        return ((a + 2) * x - (a + 3)) * x * x + 1

    def far(x):             # 1 < |x| < 2
        return ((a * x - 5 * a) * x + 8 * a) * x - 4 * a
    return np.stack([far(t + 1), near(t), near(1 - t), far(2 - t)], axis=-1)


def interpolation_matrix(in_size: int, out_size: int, method: str = "bicubic") -> np.ndarray:
    """(out_size, in_size) float64 weights W with ``resized = W @ signal`` along one axis.

    The semantics of ``torch.nn.functional.interpolate(..., align_corners=False,
    antialias=False)`` with an output size: output sample o sits at source coordinate
    ``(o + 0.5) * in/out - 0.5`` (half-pixel centres).

      * ``"bicubic"``: cubic convolution with a = -0.75 on the 4 nearest samples, indices
        past the border clamped to it (PyTorch's bicubic; HF ViT's
        ``interpolate_pos_encoding`` uses it).
      * ``"bilinear"``: the 2 nearest samples, the coordinate clamped at 0. For
        upsampling this equals ``jax.image.resize(..., "bilinear")`` (big_vision's
        choice); for downsampling that one antialiases and this one does not.
    """
    if method not in POS_INTERPOLATIONS:
        raise UserError(f"unknown interpolation {method!r}; choose one of {POS_INTERPOLATIONS}")
    if in_size < 1 or out_size < 1:
        raise UserError(f"interpolation sizes must be >= 1, got {in_size} -> {out_size}")
    scale = in_size / out_size
    src = (np.arange(out_size) + 0.5) * scale - 0.5
    w = np.zeros((out_size, in_size))
    rows = np.arange(out_size)
    if method == "bilinear":
        src = np.maximum(src, 0.0)
        i0 = np.floor(src).astype(int)
        i1 = np.minimum(i0 + 1, in_size - 1)
        frac = src - i0
        np.add.at(w, (rows, i0), 1.0 - frac)
        np.add.at(w, (rows, i1), frac)
        return w
    i0 = np.floor(src).astype(int)
    taps = _cubic_weights(src - i0)                               # (out, 4)
    for k in range(4):
        np.add.at(w, (rows, np.clip(i0 - 1 + k, 0, in_size - 1)), taps[:, k])
    return w


def resize_pos_embedding(posemb: Array, new_grid: int | tuple[int, int], *,
                         old_grid: int | tuple[int, int] | None = None, num_prefix: int = 1,
                         method: str = "bicubic") -> Array:
    """Resize a learned position table to another patch grid (a pure function).

    Args:
      posemb: (..., T, D): ``num_prefix`` rows for prefix tokens (the CLS token) followed by
        the patch grid in row-major order, ``T = num_prefix + gh * gw``.
      new_grid: the target grid, ``g`` or ``(gh, gw)``.
      old_grid: the stored grid; by default square, ``sqrt(T - num_prefix)``.
      num_prefix: rows copied unchanged (1 for ViT's CLS token).
      method: ``"bicubic"`` (default: PyTorch's bicubic, identical to HF ViT's
        ``interpolate_pos_encoding``) or ``"bilinear"``; see :func:`interpolation_matrix`.

    Returns:
      (..., num_prefix + gh' * gw', D) in posemb's dtype (interpolated in fp32). When the
      grid is unchanged the input is returned as is.
    """
    posemb = jnp.asarray(posemb)
    if posemb.ndim < 2:
        raise UserError(f"posemb must be (..., T, D); got shape {posemb.shape}")
    t, d = posemb.shape[-2:]
    n = t - num_prefix
    if old_grid is None:
        g = math.isqrt(max(n, 0))
        if g * g != n:
            raise UserError(f"posemb has {n} patch rows (T={t} minus {num_prefix} prefix), not a "
                            "square grid; pass old_grid=(gh, gw)")
        old_grid = (g, g)
    old = (old_grid, old_grid) if isinstance(old_grid, int) else tuple(old_grid)
    new = (new_grid, new_grid) if isinstance(new_grid, int) else tuple(new_grid)
    if old[0] * old[1] != n:
        raise UserError(f"old_grid {old} holds {old[0] * old[1]} patches but posemb has {n} "
                        f"patch rows (T={t}, num_prefix={num_prefix})")
    if min(new) < 1:
        raise UserError(f"new_grid must be positive, got {new}")
    if new == old:
        return posemb
    wh = jnp.asarray(interpolation_matrix(old[0], new[0], method), jnp.float32)
    ww = jnp.asarray(interpolation_matrix(old[1], new[1], method), jnp.float32)
    lead = posemb.shape[:-2]
    prefix = posemb[..., :num_prefix, :]
    grid = posemb[..., num_prefix:, :].astype(jnp.float32).reshape(lead + old + (d,))
    out = jnp.einsum("ai,bj,...ijd->...abd", wh, ww, grid, precision=jax.lax.Precision.HIGHEST)
    out = out.reshape(lead + (new[0] * new[1], d)).astype(posemb.dtype)
    return jnp.concatenate([prefix, out], axis=-2)


def resize_params(params: Any, config: ViTConfig, image_size: int, *,
                  method: str = "bicubic") -> tuple[ViTConfig, Any]:
    """``(config, params)`` for ``image_size``: the position table resized, all else shared.

    ``params`` is the params tree (or ``{'params': ...}``), scanned or not. The patch size
    stays, so ``image_size`` must be a multiple of it.
    """
    new_cfg = config.replace(image_size=image_size)
    params = nn.meta.unbox(params)
    wrapped = set(params) == {"params"}
    tree = dict(params["params"] if wrapped else params)
    if "pos_embedding" not in tree:
        raise KeyError(f"no 'pos_embedding' in the ViT params (top-level keys: {sorted(tree)})")
    tree["pos_embedding"] = resize_pos_embedding(tree["pos_embedding"], new_cfg.grid_size,
                                                 old_grid=config.grid_size, method=method)
    return new_cfg, ({"params": tree} if wrapped else tree)


def adapt_pretrained(params: Any, config: ViTConfig, pretrained: Any,
                     pretrained_config: ViTConfig, *, method: str = "bicubic") -> Any:
    """Fine-tuning start: ``pretrained`` weights in the shapes of ``params`` (a fresh init).

    The position table is resized to ``config``'s grid; the head is taken from ``params``
    (freshly initialised, zero by default) when the class counts differ; every other leaf
    must match in shape, and ``activation`` and ``norm_eps`` must agree, else a
    ``ValueError`` names the difference. Both trees unscanned or as their configs say
    (``scan_layers``).
    """
    if pretrained_config.patch_size != config.patch_size:
        raise UserError(f"pretrained patch_size={pretrained_config.patch_size} != "
                        f"{config.patch_size}; the patch embedding cannot be reused")
    for name in ("activation", "norm_eps"):         # same shapes, another function: say so
        theirs, ours = getattr(pretrained_config, name), getattr(config, name)
        if theirs != ours:
            raise UserError(f"pretrained {name}={theirs!r} but this model has {name}={ours!r}; "
                            f"set model.{name}={theirs!r} to reuse the weights")
    _, pretrained = resize_params(pretrained, pretrained_config, config.image_size, method=method)
    pretrained = convert_layout(pretrained, pretrained_config.layer_stacks,
                                scanned=config.scan_layers)
    params = nn.meta.unbox(params)
    out = dict(pretrained)
    if pretrained_config.num_classes != config.num_classes:
        out.pop("head", None)
        if "head" in params:
            out["head"] = params["head"]
    mine = jax.tree_util.tree_leaves_with_path(params)
    theirs = dict(jax.tree_util.tree_leaves_with_path(out))
    if len(mine) != len(theirs) or any(p not in theirs for p, _ in mine):
        missing = sorted(jax.tree_util.keystr(p) for p, _ in mine if p not in theirs)
        raise UserError(f"pretrained ViT params do not have this model's structure; missing "
                        f"{missing[:6]}; compare the two configs' num_layers and scan_layers")
    for path, leaf in mine:
        if tuple(theirs[path].shape) != tuple(leaf.shape):
            raise UserError(f"pretrained {jax.tree_util.keystr(path)} has shape "
                            f"{tuple(theirs[path].shape)}, this model needs {tuple(leaf.shape)}")
    return jax.tree_util.tree_map(lambda a, b: jnp.asarray(b, a.dtype), params, out)


# ============================================================================ model

class ViT(nn.Module):
    """Image classifier. ``apply(variables, images_nhwc)`` -> logits (B, K) fp32.

    With ``num_classes=0`` it returns the final CLS representation (B, D) in fp32.
    """
    config: ViTConfig

    @with_lora
    @nn.compact
    def __call__(self, images: Array, *, deterministic: bool = True) -> Array:
        """images (B, H, W, C), any real dtype, H = W = ``config.image_size``."""
        cfg = self.config
        dtype, param_dtype = canonical_dtype(cfg.dtype), canonical_dtype(cfg.param_dtype)
        images = jnp.asarray(images)
        if images.ndim != 4:
            raise UserError(f"images must be NHWC (B, H, W, C); got shape {images.shape}")
        b, h, w, c = images.shape
        if (h, w) != (cfg.image_size, cfg.image_size) or c != cfg.num_channels:
            hint = (" (an NCHW batch? transpose it with x.transpose(0, 2, 3, 1))"
                    if images.shape[1] == cfg.num_channels and c != cfg.num_channels else "")
            raise UserError(
                f"images of shape {images.shape} do not match the model: expected (B, "
                f"{cfg.image_size}, {cfg.image_size}, {cfg.num_channels}){hint}. For another "
                "resolution, resize the position table with vit.resize_params(params, config, "
                "image_size) and use the config it returns")
        p, g = cfg.patch_size, cfg.grid_size
        # (B, H, W, C) -> (B, G, P, G, P, C) -> (B, G, G, P, P, C) -> (B, N, P, P, C)
        patches = images.reshape(b, g, p, g, p, c).transpose(0, 1, 3, 2, 4, 5)
        patches = patches.reshape(b, g * g, p, p, c).astype(dtype)
        x = Dense(cfg.d_model, in_axes=3, use_bias=cfg.patch_bias,
                  kernel_axes=(None, None, None, "embed"), dtype=dtype, param_dtype=param_dtype,
                  cpu_tuning=cfg.cpu_tuning, name="embedding")(patches)       # (B, N, D)

        cls = self.param("cls", nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)),
                         (cfg.d_model,), param_dtype)
        x = jnp.concatenate([jnp.broadcast_to(cls.astype(dtype), (b, 1, cfg.d_model)), x], axis=1)
        pos = self.param("pos_embedding",
                         nn.with_logical_partitioning(nn.initializers.normal(cfg.initializer_range),
                                                      (None, "embed")),
                         (cfg.seq_len, cfg.d_model), param_dtype)
        x = x + pos.astype(dtype)[None]
        if cfg.embedding_norm:
            x = LayerNorm(eps=cfg.norm_eps, dtype=dtype, param_dtype=param_dtype,
                          name="embedding_norm")(x)
        x = nn.Dropout(cfg.dropout_rate)(x, deterministic=deterministic)
        x = nn.with_logical_constraint(x, ("act_batch", "act_length", "act_embed"))

        fields = dict(
            num_heads=cfg.num_heads, mlp_dim=cfg.mlp_features, activation=cfg.activation,
            pre_norm=True, norm="layernorm", norm_eps=cfg.norm_eps, use_bias=True,
            dropout_rate=cfg.dropout_rate, attention_dropout_rate=cfg.attention_dropout_rate,
            attention=cfg.attention, attention_impl=cfg.attention_impl,
            attention_pattern=cfg.attention_pattern, dtype=dtype, param_dtype=param_dtype,
            cpu_tuning=cfg.cpu_tuning)
        x = layer_stack(EncoderBlock, fields, cfg.num_layers, x, name="encoderblock",
                        static={"deterministic": deterministic}, scan=cfg.scan_layers,
                        remat=cfg.remat, remat_policy=cfg.remat_policy)

        x = LayerNorm(eps=cfg.norm_eps, dtype=jnp.float32, param_dtype=param_dtype,
                      name="encoder_norm")(x)
        rep = x[:, 0]                                                            # (B, D) fp32
        if cfg.num_classes == 0:
            return rep
        head_init = (nn.initializers.zeros if cfg.head_zeroinit
                     else nn.initializers.normal(cfg.initializer_range))
        return Dense(cfg.num_classes, kernel_axes=("embed", None), dtype=jnp.float32,
                     param_dtype=param_dtype, kernel_init=head_init, name="head")(rep)


def init_params(model: ViT, rng: Array, batch_size: int = 1):
    """Initialised, unboxed parameters."""
    cfg = model.config
    images = jnp.zeros((batch_size, cfg.image_size, cfg.image_size, cfg.num_channels), jnp.float32)
    return nn.meta.unbox(model.init(rng, images)["params"])
