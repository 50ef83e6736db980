"""Test-wide settings: fp32 parity needs full-precision matmuls on every backend."""
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
