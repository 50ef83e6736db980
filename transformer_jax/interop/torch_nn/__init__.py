"""``torch.nn``'s Transformer modules (``MultiheadAttention``, ``TransformerEncoderLayer`` ...
``Transformer``) <-> Flax mirrors.

  * :mod:`~transformer_jax.interop.torch_nn.modules`: the Flax mirrors, with PyTorch's
    signatures and mask conventions (no torch import);
  * :mod:`~transformer_jax.interop.torch_nn.convert`: the converters, reached through
    :func:`transformer_jax.interop.from_torch` / ``to_torch_state_dict``, and the torch
    readers the tutorial converters share.
"""
