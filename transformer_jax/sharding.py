"""Logical axis names and the one table that maps them to mesh axes.

Every parameter is created with logical axis names (``nn.with_logical_partitioning``) and
the blocks constrain their activations with ``nn.with_logical_constraint``. Without a
mesh and rules in scope these annotations cost nothing; with them, the same model code is
data-, FSDP- or tensor-parallel. Mesh axes: ``data``, ``fsdp``, ``tensor``.

Parameter axes:  vocab, embed, mlp, heads, kv_heads, head_dim, norm, layers (scan)
Activation axes: act_batch, act_length, act_embed, act_mlp, act_heads, act_head_dim
(distinct names, so an activation's embed axis can stay unsharded while the weights'
embed axis is FSDP-sharded).
"""
from __future__ import annotations

# (logical axis, mesh axis or axes or None). The first matching rule wins.
LOGICAL_AXIS_RULES: tuple[tuple[str, str | tuple[str, ...] | None], ...] = (
    ("act_batch", ("data", "fsdp")),
    ("act_length", None),
    ("act_embed", None),
    ("act_mlp", "tensor"),
    ("act_heads", "tensor"),
    ("act_head_dim", None),
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("norm", None),
    ("layers", None),
)
