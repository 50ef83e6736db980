"""Token ids outside their tables (models/base.py: ``check_ids``, ``check_id_values``,
``checked``): every family's entry points raise a UserError naming the first bad id, its
position, how many there are and the table when the ids are concrete; under ``jax.jit``
the program is the unchecked one unless wrapped in ``checked``, which reports the same
message through checkify. Valid ids give the outputs they gave before."""
import functools
import re
from collections.abc import Mapping

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

from tests.helpers import FP32_TOL
from transformer_jax.errors import UserError
from transformer_jax.models import (Bert, BertConfig, GPT, GPTConfig, T5, T5Config, Transformer,
                                    TransformerConfig, checked)
from transformer_jax.models import base, bert, gpt

V, B, T = 40, 2, 8
SMALL = dict(vocab_size=V, num_layers=1, d_model=32, num_heads=2)
ADVICE = ("token ids must come from the tokenizer the model was built for (whose ids fit the "
          "config's vocab_size), and padding such as -1 or -100 must be replaced by a real "
          "pad id")


def _models():
    """family -> (module, params, the id arguments by name, apply(module, params, **ids))."""
    src = np.arange(B * T, dtype=np.int32).reshape(B, T) % V
    tgt = (src[:, ::-1] + 3) % V
    out = {}
    m = GPT(GPTConfig.preset("tiny", max_len=16, **SMALL))
    out["gpt"] = (m, {"input_ids": src}, lambda m, p, input_ids: m.apply(p, input_ids))
    m = Bert(BertConfig.preset("tiny", max_len=16, head="mlm", **SMALL))
    out["bert"] = (m, {"input_ids": src}, lambda m, p, input_ids: m.apply(p, input_ids))
    for name, module in (("t5", T5(T5Config.preset("tiny", **{**SMALL, "head_dim": 16}))),
                         ("transformer", Transformer(TransformerConfig.preset(
                             "tiny", max_len=16, mlp_dim=48, **SMALL)))):
        out[name] = (module, {"input_ids": src, "decoder_input_ids": tgt},
                     lambda m, p, input_ids, decoder_input_ids: m.apply(p, input_ids,
                                                                        decoder_input_ids))
    return {k: (m, jax.tree_util.tree_map(np.asarray, m.init(jax.random.PRNGKey(0),
                                                             *ids.values())), ids, f)
            for k, (m, ids, f) in out.items()}


OWNER = {"gpt": "GPTConfig", "bert": "BertConfig", "t5": "T5Config",
         "transformer": "TransformerConfig"}
ID_ARGS = {"gpt": ("input_ids",), "bert": ("input_ids",),
           "t5": ("input_ids", "decoder_input_ids"), "transformer": ("input_ids", "decoder_input_ids")}
CASES = [(family, arg) for family, args in ID_ARGS.items() for arg in args]


@functools.cache
def _built():
    models = _models()
    assert {family: tuple(ids) for family, (_, _, ids, _) in models.items()} == ID_ARGS
    return models


class _Models(Mapping):
    """The models of ``_models()``, built on first use rather than at collection (each
    pytest-xdist worker collects every test module)."""

    def __getitem__(self, family):
        return _built()[family]

    def __iter__(self):
        return iter(ID_ARGS)

    def __len__(self):
        return len(ID_ARGS)


MODELS = _Models()


def with_bad(ids: dict, arg: str, *where_value) -> dict:
    out = {k: v.copy() for k, v in ids.items()}
    for (row, col), value in where_value:
        out[arg][row, col] = value
    return out


# ----------------------------------------------------------------------------- concrete ids

@pytest.mark.parametrize("family,arg", CASES)
def test_an_id_at_or_past_vocab_size_is_named_with_its_position_and_count(family, arg):
    module, params, ids, apply = MODELS[family]
    bad = with_bad(ids, arg, ((1, 7), V + 10), ((1, 2), V))        # [1, 2] is first (row-major)
    want = (f"{arg}[1, 2] = {V} is outside the vocabulary [0, {V}) of "
            f"{OWNER[family]}.vocab_size (bad ids in {arg}: 2 of {B * T}); {ADVICE}")
    with pytest.raises(UserError) as info:
        apply(module, params, **bad)
    assert str(info.value) == want


@pytest.mark.parametrize("family,arg", CASES)
def test_id_minus_one_is_named_too(family, arg):
    module, params, ids, apply = MODELS[family]
    bad = with_bad(ids, arg, ((0, 3), -1))
    with pytest.raises(UserError, match=re.escape(
            f"{arg}[0, 3] = -1 is outside the vocabulary [0, {V}) of {OWNER[family]}.vocab_size "
            f"(bad ids in {arg}: 1 of {B * T}); token ids must come")):
        apply(module, params, **bad)


def test_encode_and_decode_check_their_ids():
    for family in ("t5", "transformer"):
        module, params, ids, _ = MODELS[family]
        with pytest.raises(UserError, match=r"^input_ids\[0, 0\] = 99 is outside"):
            module.apply(params, with_bad(ids, "input_ids", ((0, 0), 99))["input_ids"],
                         method="encode")
        encoded = module.apply(params, ids["input_ids"], method="encode")
        tgt = with_bad(ids, "decoder_input_ids", ((1, 4), -5))["decoder_input_ids"]
        with pytest.raises(UserError, match=r"^decoder_input_ids\[1, 4\] = -5 is outside the "
                                            rf"vocabulary \[0, {V}\) of {OWNER[family]}"):
            module.apply(params, tgt, encoded, method="decode")


def test_bert_token_types_and_gpt_positions_are_checked_against_their_tables():
    module, params, ids, _ = MODELS["bert"]
    types = np.zeros((B, T), np.int32)
    types[0, 5] = 2
    with pytest.raises(UserError) as info:
        module.apply(params, ids["input_ids"], types)
    assert str(info.value) == (
        "token_type_ids[0, 5] = 2 is outside the token types [0, 2) of "
        "BertConfig.type_vocab_size (bad ids in token_type_ids: 1 of 16); token type ids "
        "number the segments 0 .. type_vocab_size - 1")
    module, params, ids, _ = MODELS["gpt"]
    with pytest.raises(UserError, match=re.escape(
            "position_ids[0, 7] = 16 is outside the positions [0, 16) of GPTConfig.max_len "
            "(bad ids in position_ids: 1 of 8)")):
        module.apply(params, ids["input_ids"], position_ids=np.arange(9, 17)[None])


def test_float_ids_are_refused():
    module, params, ids, _ = MODELS["gpt"]
    with pytest.raises(UserError, match="input_ids must be integer token ids; got dtype float32"):
        module.apply(params, ids["input_ids"].astype(np.float32))


# ----------------------------------------------------------------------------- valid ids, jit

@pytest.mark.parametrize("family", MODELS)
def test_valid_ids_give_the_jitted_outputs(family):
    module, params, ids, apply = MODELS[family]
    eager = apply(module, params, **ids)
    jitted = jax.jit(lambda p, i: apply(module, p, **i))(params, ids)
    np.testing.assert_allclose(np.asarray(eager), np.asarray(jitted), **FP32_TOL)
    assert np.isfinite(np.asarray(eager)).all()


def _primitives(jaxpr) -> set[str]:
    """Names of the primitives of a jaxpr and of every jaxpr in its equations' params."""
    out = set()
    for eqn in jaxpr.eqns:
        out.add(eqn.primitive.name)
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                if isinstance(sub, jax.extend.core.ClosedJaxpr):
                    out |= _primitives(sub.jaxpr)
                elif isinstance(sub, jax.extend.core.Jaxpr):
                    out |= _primitives(sub)
    return out


@pytest.mark.parametrize("family", MODELS)
def test_the_jitted_program_is_the_unchecked_one(family, monkeypatch):
    """Traced ids outside ``checked``: the jaxpr equals the one with every id check removed
    (no checkify op), so jitted code compiles exactly as without the checks."""
    module, params, ids, apply = MODELS[family]
    fn = lambda p, i: apply(module, p, **i)  # noqa: E731
    default = jax.make_jaxpr(fn)(params, ids)
    assert "check" not in _primitives(default.jaxpr)
    # checked: the traced checks become checkify's error outputs (code, position, value...)
    assert len(jax.make_jaxpr(checked(fn))(params, ids).out_avals) > len(default.out_avals)
    for mod in (base, bert, gpt):
        monkeypatch.setattr(mod, "check_id_values", lambda *a, **k: None)
    monkeypatch.setattr(gpt, "check_ids", lambda name, ids, *a, **k: ids)   # GPT had none
    assert str(jax.make_jaxpr(fn)(params, ids)) == str(default)


def test_jit_does_not_check_ids_by_default():
    """What ``checked`` is for: plain jit runs a bad id, and every position of its row
    (causal attention reads position 0) has NaN logits."""
    module, params, ids, apply = MODELS["gpt"]
    bad = with_bad(ids, "input_ids", ((0, 0), V + 1))
    logits = np.asarray(jax.jit(lambda p, i: apply(module, p, **i))(params, bad))
    assert np.isnan(logits[0]).all() and np.isfinite(logits[1]).all()


# ----------------------------------------------------------------------------- checked (checkify)

@pytest.mark.parametrize("family,arg", CASES)
def test_checked_reports_the_same_message_under_jit(family, arg):
    module, params, ids, apply = MODELS[family]
    run = jax.jit(checked(lambda p, i: apply(module, p, **i)))
    err, out = run(params, ids)
    assert err.get() is None
    np.testing.assert_array_equal(np.asarray(out), np.asarray(jax.jit(
        lambda p, i: apply(module, p, **i))(params, ids)))
    err, _ = run(params, with_bad(ids, arg, ((1, 7), V + 10), ((1, 2), -1)))
    want = (f"{arg}[1, 2] = -1 is outside the vocabulary [0, {V}) of "
            f"{OWNER[family]}.vocab_size (bad ids in {arg}: 2 of {B * T}); {ADVICE}")
    assert err.get().startswith(want)
    with pytest.raises(checkify.JaxRuntimeError, match=re.escape(want)):
        err.throw()


def test_checked_wraps_apply_and_methods_as_documented():
    module, params, ids, _ = MODELS["gpt"]
    bad = with_bad(ids, "input_ids", ((1, 6), 1000))
    err, logits = jax.jit(checked(module.apply))(params, bad["input_ids"])
    assert logits.shape == (B, T, V)
    with pytest.raises(checkify.JaxRuntimeError, match=r"input_ids\[1, 6\] = 1000 is outside"):
        err.throw()
    module, params, ids, _ = MODELS["t5"]
    encode = jax.jit(checked(lambda p, i: module.apply(p, i, method="encode")))
    err, _ = encode(params, with_bad(ids, "input_ids", ((0, 1), 41))["input_ids"])
    assert err.get().startswith("input_ids[0, 1] = 41 is outside the vocabulary [0, 40) of "
                                "T5Config.vocab_size (bad ids in input_ids: 1 of 16)")
    # the flag that turns the checks on is only set while ``checked`` traces
    assert base._TRACED_ID_CHECKS.get() is False


def test_checked_concrete_ids_closed_over_raise_at_trace_time():
    """Ids that are constants of the traced function are concrete: a UserError at once."""
    module, params, ids, _ = MODELS["gpt"]
    bad = jnp.asarray(with_bad(ids, "input_ids", ((0, 0), -2))["input_ids"])
    with pytest.raises(UserError, match=r"input_ids\[0, 0\] = -2"):
        jax.jit(lambda p: module.apply(p, bad))(params)
