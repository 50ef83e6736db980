"""LoRA (Hu et al. 2021): a trainable low-rank update ``x A B * alpha / r`` beside a Dense's
frozen kernel, on the Dense layers whose parameter path matches a regex.

A model config's ``lora`` field (a :class:`LoraConfig`, or None) switches it on. The
model's entry points (``__call__``, ``encode``, ``decode``: decorated with
:func:`with_lora`) make the config the active one while they run, and every
:class:`~transformer_jax.layers.dense.Dense` beneath asks :func:`active` whether its own
path (``h_0/self_attn/query``; scanned: ``h/self_attn/query``) matches ``targets``
(``re.search``). A matching Dense owns two more parameters beside its kernel:

  lora_a   in_shape + (R,)    e.g. (D, R) for a query projection, (N, H, R) for ``out``
  lora_b   (R,) + features    e.g. (R, N, H); zeros at init, so the model starts unchanged

and adds ``dropout(x) @ lora_a @ lora_b * alpha / R`` to its output (PEFT's ``LoraLayer``:
``lora_A`` (R, in) is ``lora_a`` transposed and flattened, ``lora_B`` (out, R) likewise;
``lora_a`` starts as PEFT's Kaiming-uniform, U(-1/sqrt(in), 1/sqrt(in))). The adapters carry
their kernel's logical axes (the rank axis is unsharded), so a mesh shards them like the
kernel. Freezing everything else is the training loop's business (``train/step.py``);
:func:`merge` folds the adapters into the kernels.
"""
from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
import re
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from ..errors import UserError

Array = jax.Array

#: parameter names LoRA adds to a Dense
ADAPTER_NAMES = ("lora_a", "lora_b")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Which Dense layers get adapters, and their rank, scale and input dropout.

    ``targets`` is a regex searched in each Dense's path (``"attn/(query|value)"``: the query
    and value projections of every attention layer; ``"attn/|mlp/"``: every attention and
    feed-forward projection). ``alpha / rank`` scales the update, as in PEFT
    (``use_rslora``: ``alpha / sqrt(rank)``). ``dropout`` applies to the adapter's input
    while training.
    """
    rank: int = 8
    alpha: float = 16.0
    targets: str = "attn/(query|value)"
    dropout: float = 0.0
    use_rslora: bool = False
    # QLoRA: the frozen base kernels stored quantized ("int8" per channel, "nf4" in blocks
    # of quantize_block with absmax scales; double_quant quantizes those scales too), and
    # dequantized on the fly in each matmul (layers/quant.py)
    quantize: str | None = None
    quantize_block: int = 64
    double_quant: bool = False

    def __post_init__(self):
        def bad(name, allowed):
            return UserError(f"LoraConfig.{name} must be {allowed}, got {getattr(self, name)!r}")
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 1:
            raise bad("rank", "an integer >= 1")
        if (isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float))
                or not math.isfinite(self.alpha) or self.alpha <= 0):
            raise bad("alpha", "a number > 0")
        if (isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float))
                or not 0 <= self.dropout < 1):
            raise bad("dropout", "a number in [0, 1)")
        if not isinstance(self.use_rslora, bool):
            raise bad("use_rslora", "True or False")
        if not isinstance(self.targets, str) or not self.targets:
            raise bad("targets", "a non-empty regex over parameter paths, e.g. 'attn/(query|value)'")
        if self.quantize not in (None, "int8", "nf4"):
            raise UserError(f"LoraConfig.quantize={self.quantize!r} is unknown; choose None, "
                            "'int8' or 'nf4'")
        if (isinstance(self.quantize_block, bool) or not isinstance(self.quantize_block, int)
                or self.quantize_block < 2 or self.quantize_block % 2):
            raise bad("quantize_block", "an even integer >= 2 (QLoRA: 64)")
        if not isinstance(self.double_quant, bool):
            raise bad("double_quant", "True or False")
        try:
            re.compile(self.targets)
        except re.error as e:
            raise UserError(f"LoraConfig.targets={self.targets!r} is not a valid regex ({e})") from None

    @classmethod
    def from_value(cls, value: Any) -> "LoraConfig | None":
        """None, a LoraConfig, or its dict form (``config.json``; ``--set lora.rank=8``)."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise UserError(f"lora must be None or a dict of LoraConfig fields (rank, alpha, "
                            f"targets, dropout, use_rslora, quantize, ...), got {value!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(value) - names, key=str)
        if unknown:
            raise UserError(f"unknown LoraConfig field(s) {unknown}; valid: {sorted(names)}")
        return cls(**value)

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    def matches(self, path: str) -> bool:
        return re.search(self.targets, path) is not None


# ----------------------------------------------------------------------------- activation

_ACTIVE: contextvars.ContextVar = contextvars.ContextVar("transformer_jax_lora", default=None)


@contextlib.contextmanager
def activated(config: LoraConfig | None, deterministic: bool):
    """Make ``config`` the active LoRA config (None: none) while the body runs (traces)."""
    token = _ACTIVE.set(None if config is None else (config, deterministic))
    try:
        yield
    finally:
        _ACTIVE.reset(token)


def active() -> tuple[LoraConfig, bool] | None:
    """``(config, deterministic)`` of the model entry point now running, or None."""
    return _ACTIVE.get()


def with_lora(method):
    """Decorate a model entry point (above ``nn.compact``): its Dense layers see the model
    config's ``lora`` while it runs; ``deterministic`` (keyword, default True) turns the
    adapters' dropout off."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with activated(getattr(self.config, "lora", None), kwargs.get("deterministic", True)):
            return method(self, *args, **kwargs)
    return wrapper


def module_path(module: nn.Module) -> str:
    """``"h_0/self_attn/query"``: a bound module's path from the model's root."""
    return "/".join(str(p) for p in module.path)


def adapter_delta(module: nn.Module, x2: Array, in_shape: tuple[int, ...],
                  features: tuple[int, ...], kernel_axes: tuple, in_axes: int, dtype: Any,
                  param_dtype: Any, precision: Any) -> Array | None:
    """The LoRA update of the Dense ``module`` for its flattened input ``x2`` (M, in), as
    (M, out), or None when no active config targets this Dense."""
    current = active()
    if current is None:
        return None
    config, deterministic = current
    if not config.matches(module_path(module)):
        return None
    r = config.rank
    fan_in = math.prod(in_shape)
    bound = 1.0 / math.sqrt(fan_in)
    a_init = lambda rng, shape, dt=jnp.float32: jax.random.uniform(  # noqa: E731
        rng, shape, dt, -bound, bound)
    a = module.param("lora_a", nn.with_logical_partitioning(
        a_init, tuple(kernel_axes[:in_axes]) + (None,)), in_shape + (r,), param_dtype)
    b = module.param("lora_b", nn.with_logical_partitioning(
        nn.initializers.zeros_init(), (None,) + tuple(kernel_axes[in_axes:])),
        (r,) + features, param_dtype)
    if config.dropout > 0 and not deterministic:
        x2 = nn.Dropout(config.dropout, name="lora_dropout")(x2, deterministic=False)
    a2 = a.reshape((fan_in, r)).astype(dtype)
    b2 = b.reshape((r, math.prod(features))).astype(dtype)
    h = jnp.dot(x2, a2, precision=precision)
    return jnp.dot(h, b2, precision=precision) * jnp.asarray(config.scaling, dtype)


# ----------------------------------------------------------------------------- params

def is_adapter(path: tuple[str, ...]) -> bool:
    """Whether a parameter path ends in a LoRA adapter leaf."""
    return bool(path) and path[-1] in ADAPTER_NAMES


def merge(params: dict, config: LoraConfig) -> dict:
    """``params`` with every adapter folded into its kernel (``kernel + a @ b * scale``,
    reshaped) and the adapter leaves removed: the plain model's params."""
    def walk(node):
        if not isinstance(node, dict):
            return node
        if "lora_a" in node and "lora_b" in node and "kernel" in node:
            kernel, a, b = node["kernel"], node["lora_a"], node["lora_b"]
            out = {k: walk(v) for k, v in node.items() if k not in ADAPTER_NAMES}
            # kernel (in..., out...) = a (in..., R) @ b (R, out...); scanned layers add a
            # leading (L,) axis to all three
            scanned = kernel.ndim == a.ndim + b.ndim - 3
            delta = jax.vmap(_delta)(a, b) if scanned else _delta(a, b)
            out["kernel"] = (kernel.astype(jnp.float32)
                             + config.scaling * delta.reshape(kernel.shape)).astype(kernel.dtype)
            return out
        return {k: walk(v) for k, v in node.items()}

    return walk(dict(params))


def _delta(a: Array, b: Array) -> Array:
    """``a`` (in..., R) @ ``b`` (R, out...) -> (in..., out...), in fp32."""
    r = a.shape[-1]
    flat = jnp.dot(a.reshape((-1, r)).astype(jnp.float32), b.reshape((r, -1)).astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST)
    return flat.reshape(a.shape[:-1] + b.shape[1:])
