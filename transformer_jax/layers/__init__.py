"""Building blocks: pure attention/mask/position functions and the linen modules that own parameters."""
from .attention import dot_product_attention
from .attention_dispatch import IMPLEMENTATIONS, resolve_implementation
from .blocks import DecoderBlock, EncoderBlock
from .dense import Dense, Embed, canonical_dtype
from .embeddings import SinusoidalPositionalEncoding, apply_rope, rope_frequencies, sinusoidal_table
from .masks import (as_4d, causal_mask, combine_masks, key_padding_mask, padding_mask_from_ids,
                    padding_mask_from_lengths, query_key_mask, sliding_window_mask)
from .multi_head import MultiHeadAttention
from .mlp import ACTIVATIONS, FeedForward, get_activation
from .norms import LayerNorm, RMSNorm, make_norm
from .relative import relative_position_bias, relative_position_bucket
from .stack import layer_stack, stack_layers, unstack_layers

__all__ = [
    "IMPLEMENTATIONS", "MultiHeadAttention", "dot_product_attention", "DecoderBlock", "EncoderBlock",
    "Dense", "Embed", "canonical_dtype", "SinusoidalPositionalEncoding", "apply_rope",
    "rope_frequencies", "sinusoidal_table", "as_4d", "causal_mask", "combine_masks",
    "key_padding_mask", "padding_mask_from_ids", "padding_mask_from_lengths", "query_key_mask",
    "sliding_window_mask", "ACTIVATIONS", "FeedForward", "get_activation", "LayerNorm", "RMSNorm",
    "make_norm", "relative_position_bias", "relative_position_bucket", "resolve_implementation",
    "layer_stack", "stack_layers", "unstack_layers",
]
