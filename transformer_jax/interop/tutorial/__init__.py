"""The tutorial's PyTorch modules (attention, blocks, embeddings, the whole Transformer, BERT,
GPT) <-> Flax mirrors; ``tests/interop/tutorial_classes.py`` holds the tutorial's own classes.

  * :mod:`~transformer_jax.interop.tutorial.modules`: the Flax mirrors, with the tutorial's
    signatures and mask convention (no torch import);
  * :mod:`~transformer_jax.interop.tutorial.convert`: the rules, in the order they are tried,
    and the whole models; reached through :func:`transformer_jax.interop.from_torch` /
    ``to_torch_state_dict``;
  * :mod:`~transformer_jax.interop.tutorial.layers`: the converters of single layers;
  * :mod:`~transformer_jax.interop.tutorial.detect`: which module is which, by attribute names.
"""
