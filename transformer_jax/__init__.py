"""transformer_jax: functional JAX/Flax Transformers verified against PyTorch.

  from transformer_jax import layers, models, generate
  from transformer_jax.interop import from_torch, from_hf, to_hf   # (needs the torch extra)
  from transformer_jax import to_nnx                  # the models as Flax NNX modules

Importing the package never imports torch or transformers (nor ``flax.nnx``: ``to_nnx``
loads on first use).
"""
from .tpu import quiet_on_cpu_host

quiet_on_cpu_host()   # libtpu installed on a host without a TPU: no runtime start, no warnings

from . import layers, models  # noqa: E402
from .decode import generate, sample_logits  # noqa: E402
from .models import GPT, GPTConfig  # noqa: E402

__version__ = "0.1.0"
__all__ = ["GPT", "GPTConfig", "generate", "layers", "models", "sample_logits", "to_nnx"]


def __getattr__(name: str):
    if name == "to_nnx":           # flax.nnx costs ~0.8 s to import: only when asked for
        from .nnx import to_nnx
        globals()["to_nnx"] = to_nnx
        return to_nnx
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
