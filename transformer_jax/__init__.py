"""transformer_jax: functional JAX/Flax Transformers verified against PyTorch.

  from transformer_jax import layers, models, generate
  from transformer_jax.interop import from_torch, from_hf, to_hf   # (needs the torch extra)

Importing the package never imports torch or transformers.
"""
from . import layers, models
from .decode import generate, sample_logits
from .models import GPT, GPTConfig

__version__ = "0.1.0"
__all__ = ["GPT", "GPTConfig", "generate", "layers", "models", "sample_logits"]
