"""transformer_jax: functional JAX/Flax Transformers verified against PyTorch.

  from transformer_jax import layers, models, generate
  from transformer_jax.interop import from_torch, from_hf, to_hf   # (needs the torch extra)

Importing the package never imports torch or transformers.
"""
from .tpu import quiet_on_cpu_host

quiet_on_cpu_host()   # libtpu installed on a host without a TPU: no runtime start, no warnings

from . import layers, models  # noqa: E402
from .decode import generate, sample_logits  # noqa: E402
from .models import GPT, GPTConfig  # noqa: E402

__version__ = "0.1.0"
__all__ = ["GPT", "GPTConfig", "generate", "layers", "models", "sample_logits"]
