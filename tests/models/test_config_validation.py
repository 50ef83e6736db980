"""Every field of every model family's config is validated when the config is made: its type
first (a string, or a float where an int belongs, is a UserError and never a TypeError from
a comparison), then its range, then the relations between fields (``RelationError``). Each
message names ``Config.field``, the value and what is allowed.

The numeric fields are found from ``dataclasses.fields``: each is probed with zero, a
negative, a float (int fields) and a string, and :data:`ALLOWED` says which of those probes
a field accepts. A numeric field missing from the table fails the test: a new field must be
classified here.
"""
import dataclasses
import re

import pytest

from transformer_jax.errors import UserError
from transformer_jax.models import (FAMILIES, BertConfig, GPTConfig, T5Config, TransformerConfig,
                                    ViTConfig)
from transformer_jax.models.base import RelationError

from tests.helpers import numeric_fields, probes

CONFIGS = [GPTConfig, BertConfig, T5Config, ViTConfig, TransformerConfig]

# Which probes each numeric field accepts (on top of its preset "tiny"); every other probe
# must be refused with a UserError naming the field and the value.
RATE = {"zero"}                  # dropout rates: [0, 1)
TOKEN_ID = {"zero"}              # token ids: [0, vocab_size)
COUNT: set = set()               # sizes and counts: integers >= 1
ALLOWED: dict[type, dict[str, set]] = {
    GPTConfig: {
        "vocab_size": COUNT, "max_len": COUNT, "num_layers": COUNT, "num_heads": COUNT,
        "num_kv_heads": COUNT, "head_size": COUNT, "d_model": COUNT, "mlp_dim": COUNT,
        "norm_eps": set(), "rope_base": set(), "dropout_rate": RATE, "attention_dropout_rate": RATE,
        "initializer_range": {"zero"}, "prefix_tokens": {"zero"}, "attention_window": COUNT,
    },
    BertConfig: {
        "vocab_size": COUNT, "max_len": COUNT, "type_vocab_size": COUNT, "num_layers": COUNT,
        "num_heads": COUNT, "d_model": COUNT, "mlp_dim": COUNT, "norm_eps": set(),
        "dropout_rate": RATE, "attention_dropout_rate": RATE, "classifier_dropout_rate": RATE,
        "initializer_range": {"zero"}, "pad_token_id": TOKEN_ID, "num_classes": COUNT,
        "attention_window": COUNT,
    },
    T5Config: {
        "vocab_size": COUNT, "d_model": COUNT, "num_heads": COUNT, "head_dim": COUNT,
        "mlp_dim": COUNT, "num_layers": COUNT, "num_decoder_layers": COUNT,
        "relative_attention_num_buckets": COUNT, "relative_attention_max_distance": COUNT,
        "norm_eps": set(), "dropout_rate": RATE, "pad_token_id": TOKEN_ID,
        "eos_token_id": TOKEN_ID, "decoder_start_token_id": TOKEN_ID,
        "initializer_factor": {"zero"},
    },
    ViTConfig: {
        "image_size": COUNT, "patch_size": COUNT, "num_channels": COUNT,
        "num_classes": {"zero"}, "num_layers": COUNT, "num_heads": COUNT, "d_model": COUNT,
        "mlp_dim": COUNT, "norm_eps": set(), "dropout_rate": RATE, "attention_dropout_rate": RATE,
        "initializer_range": {"zero"}, "attention_window": COUNT,
    },
    TransformerConfig: {
        "vocab_size": COUNT, "max_len": COUNT, "num_layers": COUNT, "num_decoder_layers": COUNT,
        "d_model": COUNT, "num_heads": COUNT, "mlp_dim": COUNT, "dropout_rate": RATE,
        "attention_dropout_rate": RATE, "mlp_dropout_rate": RATE, "norm_eps": set(),
        "pad_token_id": TOKEN_ID, "eos_token_id": TOKEN_ID, "decoder_start_token_id": TOKEN_ID,
    },
}


def numeric_cases():
    for cls in CONFIGS:
        for name, is_int in numeric_fields(cls).items():
            for probe, value in probes(is_int).items():
                yield pytest.param(cls, name, probe, value, id=f"{cls.__name__}.{name}={value!r}")


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_every_numeric_field_is_classified(cls):
    """A numeric field added to a config must get its row in ALLOWED (and rows of fields
    that are gone must go)."""
    assert set(numeric_fields(cls)) == set(ALLOWED[cls])


@pytest.mark.parametrize("cls, name, probe, value", list(numeric_cases()))
def test_numeric_probe(cls, name, probe, value):
    if probe in ALLOWED[cls].get(name, set()):
        cfg = cls.preset("tiny", **{name: value})
        assert getattr(cfg, name) == value
        return
    with pytest.raises(UserError) as info:
        cls.preset("tiny", **{name: value})
    message = str(info.value)
    assert f"{cls.__name__}.{name}" in message, message
    assert repr(value) in message, message
    assert not isinstance(info.value, RelationError), message   # a field on its own


@pytest.mark.parametrize("cls, name, value, message", [
    (GPTConfig, "num_layers", 0, "GPTConfig.num_layers must be an integer >= 1, got 0"),
    (GPTConfig, "num_layers", "abc", "GPTConfig.num_layers must be an integer >= 1, got 'abc'"),
    (GPTConfig, "num_layers", 1.5, "GPTConfig.num_layers must be an integer >= 1, got 1.5"),
    (GPTConfig, "num_layers", 2.0, "GPTConfig.num_layers must be an integer >= 1, got 2.0"),
    (GPTConfig, "num_heads", True, "GPTConfig.num_heads must be an integer >= 1, got True"),
    (GPTConfig, "num_kv_heads", 0, "GPTConfig.num_kv_heads must be an integer >= 1 or None, got 0"),
    (GPTConfig, "norm_eps", 0.0, "GPTConfig.norm_eps must be a number > 0, got 0.0"),
    (GPTConfig, "norm_eps", float("inf"), "GPTConfig.norm_eps must be a finite number > 0, got inf"),
    (GPTConfig, "rope_base", -1.0, "GPTConfig.rope_base must be a number > 0, got -1.0"),
    (GPTConfig, "initializer_range", float("nan"),
     "GPTConfig.initializer_range must be a finite number >= 0, got nan"),
    (GPTConfig, "dropout_rate", 1.0, "GPTConfig.dropout_rate must be in [0, 1), got 1.0"),
    (BertConfig, "classifier_dropout_rate", "x",
     "BertConfig.classifier_dropout_rate must be in [0, 1) or None, got 'x'"),
    (BertConfig, "pad_token_id", -1, "BertConfig.pad_token_id must be an integer >= 0 or None, got -1"),
    (T5Config, "relative_attention_num_buckets", 2,
     "T5Config.relative_attention_num_buckets must be an integer >= 4 and even (half of them "
     "per direction in the encoder), got 2"),
    (T5Config, "relative_attention_num_buckets", 9,
     "T5Config.relative_attention_num_buckets must be an integer >= 4 and even (half of them "
     "per direction in the encoder), got 9"),
    (T5Config, "initializer_factor", -0.5, "T5Config.initializer_factor must be a number >= 0, got -0.5"),
    (T5Config, "eos_token_id", "1", "T5Config.eos_token_id must be an integer >= 0, got '1'"),
    (ViTConfig, "num_classes", -1, "ViTConfig.num_classes must be an integer >= 0 (0 = no head), got -1"),
    (BertConfig, "attention_sparsity", "dilated:3",
     "BertConfig.attention_sparsity: attention sparsity 'dilated:3' is not understood; write "
     "'strided:STRIDE' (e.g. 'strided:128') or 'fixed:STRIDE:SUMMARY' (e.g. 'fixed:128:16')"),
    (GPTConfig, "attention_sparsity", "fixed:8:9",
     "GPTConfig.attention_sparsity: fixed attention pattern: summary must be an integer in [1, "
     "stride=8], got 9"),
])
def test_field_messages(cls, name, value, message):
    with pytest.raises(UserError) as info:
        cls.preset("tiny", **{name: value})
    assert str(info.value) == message


def test_odd_width_of_the_sinusoidal_transformer():
    with pytest.raises(UserError) as info:
        TransformerConfig.preset("tiny", d_model=65, num_heads=5)
    assert str(info.value) == ("TransformerConfig.d_model must be an even integer (sinusoidal "
                               "positions need an even d_model), got 65")


# ----------------------------------------------------------------------------- other fields

def fields_of_type(cls, annotation: str) -> list[str]:
    return [f.name for f in dataclasses.fields(cls) if str(f.type) == annotation]


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_bool_fields_must_be_bools(cls):
    names = fields_of_type(cls, "bool") + fields_of_type(cls, "bool | None")
    assert {"scan_layers", "remat", "cpu_tuning"} <= set(names)
    for name in names:
        for value in (1, "yes"):
            with pytest.raises(UserError) as info:
                cls.preset("tiny", **{name: value})
            allowed = "True or False or None" if name in fields_of_type(cls, "bool | None") \
                else "True or False"
            assert str(info.value) == f"{cls.__name__}.{name} must be {allowed}, got {value!r}"
        cls.preset("tiny", **{name: not getattr(cls.preset("tiny"), name)})


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_choice_fields_refuse_other_values_and_other_types(cls):
    names = [n for n in fields_of_type(cls, "str") if n not in ("dtype", "param_dtype")]
    assert {"activation", "attention_impl", "remat_policy"} <= set(names)
    for name in names:
        for value in ("nonsense", 3, None):
            with pytest.raises(UserError, match=rf"^{cls.__name__}\.{name}={re.escape(repr(value))} "
                                                r"is unknown; choose one of \["):
                cls.preset("tiny", **{name: value})


@pytest.mark.parametrize("cls", CONFIGS, ids=lambda c: c.__name__)
def test_dtypes(cls):
    assert cls.preset("tiny", dtype="bfloat16", param_dtype="float32").dtype == "bfloat16"
    for name in ("dtype", "param_dtype"):
        with pytest.raises(UserError) as info:
            cls.preset("tiny", **{name: "int32"})
        assert str(info.value) == (f"{cls.__name__}.{name}='int32' is not a floating-point dtype; "
                                   "use e.g. 'float32' or 'bfloat16'")
        with pytest.raises(UserError) as info:
            cls.preset("tiny", **{name: 16})
        assert str(info.value) == (f"{cls.__name__}.{name} must be a dtype name such as 'float32' "
                                   "or 'bfloat16', got 16")
        with pytest.raises(UserError, match=rf"^{cls.__name__}\.{name}: unknown dtype 'float17'"):
            cls.preset("tiny", **{name: "float17"})


# ----------------------------------------------------------------------------- relations

@pytest.mark.parametrize("make, message, fields", [
    (lambda: GPTConfig(d_model=100, num_heads=8),
     "GPTConfig.d_model=100 is not divisible by num_heads=8", ("d_model", "num_heads")),
    (lambda: GPTConfig.preset("tiny", num_heads=4, num_kv_heads=3),
     "GPTConfig.num_heads=4 is not divisible by num_kv_heads=3", ("num_heads", "num_kv_heads")),
    (lambda: GPTConfig.preset("tiny", position="rope", d_model=12, num_heads=4),
     "GPTConfig.position='rope' needs an even head_dim (head_size, or d_model / num_heads), got 3",
     ("position", "d_model", "num_heads")),
    (lambda: BertConfig.preset("tiny", d_model=30),
     "BertConfig.d_model=30 is not divisible by num_heads=4", ("d_model", "num_heads")),
    (lambda: BertConfig.preset("tiny", pad_token_id=512),
     "BertConfig.pad_token_id=512 is outside the vocabulary [0, 512) (vocab_size)",
     ("pad_token_id", "vocab_size")),
    (lambda: T5Config.preset("tiny", relative_attention_num_buckets=16,
                             relative_attention_max_distance=8),
     "T5Config.relative_attention_max_distance=8 must exceed the 8 exact buckets of the decoder "
     "(relative_attention_num_buckets // 2)",
     ("relative_attention_max_distance", "relative_attention_num_buckets")),
    (lambda: T5Config.preset("tiny", decoder_start_token_id=600),
     "T5Config.decoder_start_token_id=600 is outside the vocabulary [0, 512) (vocab_size)",
     ("decoder_start_token_id", "vocab_size")),
    (lambda: ViTConfig.preset("tiny", image_size=30),
     "ViTConfig.image_size=30 is not a multiple of patch_size=4; pick sizes whose patches tile "
     "the image", ("image_size", "patch_size")),
    (lambda: ViTConfig.preset("tiny", d_model=66),
     "ViTConfig.d_model=66 is not divisible by num_heads=4", ("d_model", "num_heads")),
    (lambda: TransformerConfig.preset("tiny", pre_norm=True, final_norm=False),
     "TransformerConfig.final_norm=False is refused: pre_norm=True needs final_norm (the "
     "residual stream is never normalised otherwise); leave final_norm=None",
     ("final_norm", "pre_norm")),
    (lambda: TransformerConfig.preset("tiny", eos_token_id=512),
     "TransformerConfig.eos_token_id=512 is outside the vocabulary [0, 512) (vocab_size)",
     ("eos_token_id", "vocab_size")),
    (lambda: GPTConfig.preset("tiny", attention_window=8, attention_sparsity="strided:4"),
     "GPTConfig.attention_window=8 and attention_sparsity='strided:4' are both set; the strided "
     "and fixed patterns have their own local part: choose one",
     ("attention_window", "attention_sparsity")),
    (lambda: GPTConfig.preset("tiny", attention="linear"),
     "GPTConfig.attention='linear' has no attention weights to drop (attention dropout 0.1); "
     "set attention_dropout_rate=0", ("attention", "attention_dropout_rate")),
    (lambda: BertConfig.preset("tiny", attention="linear", attention_window=4,
                               attention_dropout_rate=0.0),
     "BertConfig.attention='linear' has no window or sparse pattern (it never forms the "
     "weights); unset attention_window/attention_sparsity or use attention='softmax'",
     ("attention", "attention_window", "attention_sparsity")),
    (lambda: ViTConfig.preset("tiny", attention="linear", attention_impl="pallas"),
     "ViTConfig.attention='linear' runs its own implementation; attention_impl='pallas' is for "
     "softmax attention: leave it 'auto'", ("attention", "attention_impl")),
    (lambda: GPTConfig.preset("tiny", attention_impl="linear"),
     "GPTConfig.attention_impl='linear' is linear attention; choose it with attention='linear'",
     ("attention_impl", "attention")),
    (lambda: GPTConfig.preset("tiny", prefix_tokens=2, attention_sparsity="fixed:8:2"),
     "GPTConfig.prefix_tokens=2 (prefix tuning) needs full softmax attention; unset the "
     "window/sparsity or use attention='softmax'",
     ("prefix_tokens", "attention", "attention_window", "attention_sparsity")),
])
def test_relations(make, message, fields):
    with pytest.raises(RelationError) as info:
        make()
    assert str(info.value) == message
    assert info.value.fields == fields


def test_relations_come_after_every_field_on_its_own():
    """A bad field is reported as itself even when a relation is broken too, and a relation
    is never evaluated on a value of the wrong type."""
    with pytest.raises(UserError) as info:
        GPTConfig.preset("tiny", d_model=100, num_heads=8, dropout_rate=2.0)
    assert str(info.value) == "GPTConfig.dropout_rate must be in [0, 1), got 2.0"
    with pytest.raises(UserError) as info:
        T5Config.preset("tiny", relative_attention_num_buckets="32")
    assert not isinstance(info.value, RelationError)


def test_limits_that_are_allowed():
    assert GPTConfig.preset("tiny", position="rope", d_model=64, num_heads=4).head_dim == 16
    assert GPTConfig.preset("tiny", num_kv_heads=1).num_kv_heads == 1
    assert GPTConfig.preset("tiny", norm_eps=1).norm_eps == 1          # an int where a float belongs
    assert BertConfig.preset("tiny", pad_token_id=None, classifier_dropout_rate=None).pad_token_id is None
    assert BertConfig.preset("tiny", pad_token_id=511).pad_token_id == 511
    assert T5Config.preset("tiny", relative_attention_num_buckets=4,
                           relative_attention_max_distance=3).relative_attention_num_buckets == 4
    assert T5Config.preset("tiny", scale_decoder_output=None, mlp_dim=None).mlp_features == 256
    assert ViTConfig.preset("tiny", image_size=4, patch_size=4).num_patches == 1
    assert TransformerConfig.preset("tiny", pre_norm=True, final_norm=None).has_final_norm


# ----------------------------------------------------------------------------- presets

@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_every_preset_still_constructs_and_round_trips(family):
    cls = FAMILIES[family][0]
    assert cls.PRESETS
    for name in cls.PRESETS:
        cfg = cls.preset(name)
        assert cls.from_dict(cfg.to_dict()) == cfg


def test_unknown_field_names():
    with pytest.raises(UserError) as info:
        GPTConfig.require_known_fields({"num_layer": 1, "d_model": 8})
    assert str(info.value).startswith("unknown GPTConfig field(s): 'num_layer' (did you mean "
                                      "'num_layers'?); valid fields: [")
    with pytest.raises(UserError, match=r"unknown ViTConfig field\(s\): 3; valid fields"):
        ViTConfig.from_dict({3: 1})
