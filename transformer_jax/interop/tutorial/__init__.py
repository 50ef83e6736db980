"""The tutorial's PyTorch modules: their Flax mirrors (:mod:`.modules`)."""
