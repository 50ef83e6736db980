"""Frozen-dataclass configs with named presets, shared by every model family, and the
input checks of the models' entry points (token ids: see ``check_ids`` and ``checked``)."""
from __future__ import annotations

import contextvars
import dataclasses
import difflib
import functools
import math
import numbers
from typing import Any, Callable, ClassVar, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from ..errors import UserError
from ..layers.attention import ATTENTION_KINDS
from ..layers.attention_dispatch import (IMPLEMENTATIONS, choose_implementation,
                                         resolve_implementation)
from ..layers.dense import canonical_dtype
from ..layers.lora import LoraConfig
from ..layers.masks import AttentionPattern
from ..layers.stack import REMAT_POLICIES, convert_layout

C = TypeVar("C", bound="PresetConfig")


class RelationError(UserError):
    """Config fields that are each valid but disagree (``d_model`` not divisible by
    ``num_heads``, a token id outside ``vocab_size``); ``fields`` names all of them.
    ``ExperimentConfig`` reads it to tell which mistakes it can report before the task
    fixes the fields its data decides (``vocab_size``, ``image_size`` ...)."""

    def __init__(self, message: str, fields: tuple[str, ...] = ()):
        super().__init__(message)
        self.fields = tuple(fields)


def _number_rule(integer: bool, minimum, maximum, exclusive_min: bool, exclusive_max: bool) -> str:
    """``"an integer >= 1"``, ``"a number in [0, 1)"``, ``"a number > 0"`` ..."""
    kind = "an integer" if integer else "a number"
    if minimum is not None and maximum is not None:
        return (f"{kind} in {'(' if exclusive_min else '['}{minimum}, {maximum}"
                f"{')' if exclusive_max else ']'}")
    if minimum is not None:
        return f"{kind} {'>' if exclusive_min else '>='} {minimum}"
    if maximum is not None:
        return f"{kind} {'<' if exclusive_max else '<='} {maximum}"
    return kind


def is_number(value: Any, integer: bool = False) -> bool:
    """An int (``integer``) or a finite real number (an int counts); never a bool."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral if integer else numbers.Real):
        return False
    return isinstance(value, numbers.Integral) or math.isfinite(value)


class PresetConfig:
    """Mixin for ``@dataclasses.dataclass(frozen=True)`` configs.

    Subclasses define ``PRESETS: ClassVar[dict[str, dict]]`` (field overrides per name).
    ``Config.preset("name", **overrides)`` builds one; ``to_dict``/``from_dict`` round-trip
    through JSON (checkpoints store the config this way).
    """
    PRESETS: ClassVar[dict[str, dict[str, Any]]] = {}

    @classmethod
    def preset(cls: type[C], name: str, **overrides: Any) -> C:
        if name not in cls.PRESETS:
            hint = difflib.get_close_matches(name, cls.PRESETS, n=1)
            extra = f" Did you mean {hint[0]!r}?" if hint else ""
            raise UserError(f"unknown {cls.__name__} preset {name!r}; choose one of "
                            f"{sorted(cls.PRESETS)}.{extra}")
        return cls.from_dict({**cls.PRESETS[name], **overrides})

    @classmethod
    def from_dict(cls: type[C], values: dict[str, Any]) -> C:
        cls.require_known_fields(values)
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self: C, **changes: Any) -> C:
        return type(self).from_dict({**self.to_dict(), **changes})

    # -- validation helpers for ``__post_init__`` (errors name ``Config.field``) ----------
    # Each config checks every field on its own first (type, then range: a string or a
    # float where an int belongs is a UserError, never a TypeError from a comparison), then
    # the relations between fields (RelationError). bool is not an int here; an int is a
    # number where a float belongs.
    @classmethod
    def require_known_fields(cls, values: dict[str, Any]) -> None:
        """A UserError naming the keys of ``values`` that are not fields of ``cls``."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted((k for k in values if k not in names), key=repr)
        if unknown:
            hints = {u: difflib.get_close_matches(u, names, n=1) if isinstance(u, str) else []
                     for u in unknown}
            detail = ", ".join(f"{u!r}" + (f" (did you mean {h[0]!r}?)" if h else "")
                               for u, h in hints.items())
            raise UserError(f"unknown {cls.__name__} field(s): {detail}; valid fields: {sorted(names)}")

    def _bad(self, name: str, allowed: str) -> UserError:
        return UserError(f"{type(self).__name__}.{name} must be {allowed}, got "
                         f"{getattr(self, name)!r}")

    def _require_number(self, name: str, *, integer: bool = False, minimum=None, maximum=None,
                        exclusive_min: bool = False, exclusive_max: bool = False,
                        allow_none: bool = False, hint: str = "") -> None:
        """``Config.name`` is an int (``integer``) or a finite real number, inside the bounds
        (inclusive unless ``exclusive_*``), or None with ``allow_none``."""
        value = getattr(self, name)
        if value is None and allow_none:
            return
        ok = is_number(value, integer)
        if ok and minimum is not None:
            ok = value > minimum if exclusive_min else value >= minimum
        if ok and maximum is not None:
            ok = value < maximum if exclusive_max else value <= maximum
        if not ok:
            rule = _number_rule(integer, minimum, maximum, exclusive_min, exclusive_max)
            if isinstance(value, float) and not math.isfinite(value):
                rule = rule.replace("a number", "a finite number")
            raise self._bad(name, rule + (" or None" if allow_none else "") + hint)

    def _require_positive(self, *names: str, allow_none: bool = False) -> None:
        """Integers >= 1 (counts and sizes); None too with ``allow_none`` (a default)."""
        for name in names:
            self._require_number(name, integer=True, minimum=1, allow_none=allow_none)

    def _require_bools(self, *names: str, allow_none: bool = False) -> None:
        for name in names:
            value = getattr(self, name)
            if not (isinstance(value, bool) or (allow_none and value is None)):
                raise self._bad(name, "True or False" + (" or None" if allow_none else ""))

    def _require_str(self, name: str, *, allow_none: bool = False) -> None:
        """A non-empty string (or None with ``allow_none``)."""
        value = getattr(self, name)
        if not ((isinstance(value, str) and value) or (allow_none and value is None)):
            raise self._bad(name, "a non-empty string" + (" or None" if allow_none else ""))

    def _require_choice(self, name: str, choices, hint: str = "") -> None:
        value = getattr(self, name)
        if not isinstance(value, str) or value not in choices:
            raise UserError(f"{type(self).__name__}.{name}={value!r} is unknown; choose one of "
                            f"{sorted(choices)}{hint}")

    def _require_rates(self, *names: str, allow_none: bool = False) -> None:
        """Dropout rates: numbers in [0, 1) (or None with ``allow_none``)."""
        for name in names:
            value = getattr(self, name)
            if allow_none and value is None:
                continue
            if not is_number(value) or not 0.0 <= value < 1.0:
                raise UserError(f"{type(self).__name__}.{name} must be in [0, 1)"
                                f"{' or None' if allow_none else ''}, got {value!r}")

    def _require_model_settings(self) -> None:
        """The fields every family shares: layer stack, attention implementation, dtypes,
        LoRA adapters (``lora``: its dict form, from ``config.json`` or ``--set
        lora.rank=8``, becomes a :class:`~transformer_jax.layers.lora.LoraConfig`)."""
        object.__setattr__(self, "lora", LoraConfig.from_value(self.lora))
        self._require_bools("scan_layers", "remat", "cpu_tuning")
        kind = hasattr(self, "attention")       # linear attention: attention="linear"
        self._require_relation(
            self.attention_impl != "linear", ("attention_impl", "attention")[:1 + kind],
            "is linear attention; choose it with attention='linear'" + ("" if kind else (
                f" (a field of the GPT, BERT, ViT and CLIP configs, not {type(self).__name__})")))
        self._require_choice("attention_impl", IMPLEMENTATIONS)
        self._require_choice("remat_policy", REMAT_POLICIES)
        for name in ("dtype", "param_dtype"):
            value = getattr(self, name)
            if not isinstance(value, str):
                raise self._bad(name, "a dtype name such as 'float32' or 'bfloat16'")
            try:
                dtype = canonical_dtype(value)
            except ValueError as e:
                raise UserError(f"{type(self).__name__}.{name}: {e}") from None
            if not jnp.issubdtype(dtype, jnp.floating):
                raise UserError(f"{type(self).__name__}.{name}={value!r} is not a floating-point "
                                "dtype; use e.g. 'float32' or 'bfloat16'")

    # relations: checked after every field on its own, so the values are well typed
    def _require_relation(self, ok: bool, fields: tuple[str, ...], text: str) -> None:
        """A RelationError ``Config.<fields[0]>=<value> <text>`` unless ``ok``."""
        if not ok:
            raise RelationError(f"{type(self).__name__}.{fields[0]}={getattr(self, fields[0])!r} "
                                f"{text}", fields)

    def _require_divisible(self, name: str, by: str) -> None:
        self._require_relation(getattr(self, name) % getattr(self, by) == 0, (name, by),
                               f"is not divisible by {by}={getattr(self, by)!r}")

    def _require_token_ids(self, *names: str, allow_none: bool = False) -> None:
        """Integers >= 0 (or None with ``allow_none``), then inside [0, vocab_size)."""
        for name in names:
            self._require_number(name, integer=True, minimum=0, allow_none=allow_none)
        for name in names:
            value = getattr(self, name)
            self._require_relation(value is None or value < self.vocab_size, (name, "vocab_size"),
                                   f"is outside the vocabulary [0, {self.vocab_size}) "
                                   "(vocab_size)")

def check_ids(name: str, ids: Any, config: Any = None, field: str = "vocab_size"):
    """Token ids as a (B, length) integer array, or a UserError naming ``name``; with a
    ``config``, also every id in [0, ``config.<field>``) (:func:`check_id_values`)."""
    given = ids
    ids = jnp.asarray(ids)
    if ids.ndim != 2:
        raise UserError(f"{name} must be (B, length) token ids; got shape {ids.shape}")
    if not jnp.issubdtype(ids.dtype, jnp.integer):
        raise UserError(f"{name} must be integer token ids; got dtype {ids.dtype}")
    if config is not None:      # host values as given: no round trip through the device
        check_id_values(name, ids if isinstance(given, jax.Array) else given, config, field)
    return ids


# ----------------------------------------------------------------------------- id ranges
#
# XLA does not fail on an id outside its table: the embedding lookup returns NaN rows (which
# attention spreads to every position) and -1 wraps to the last row. The entry points check
# their ids when the ids are concrete (``model.apply`` outside jit): on the host, a
# UserError. Traced ids (under ``jax.jit``) are checked only inside :func:`checked`, with
# ``checkify``; otherwise the compiled program is exactly the unchecked one.

#: what the ids index, by the config field that sizes the table (the error's wording)
_TABLES = {"vocab_size": "vocabulary", "type_vocab_size": "token types",
           "max_len": "positions", "num_classes": "classes"}
#: what to do about ids outside the table, by that field
ID_ADVICE = {
    "vocab_size": "token ids must come from the tokenizer the model was built for (whose ids "
                  "fit the config's vocab_size), and padding such as -1 or -100 must be "
                  "replaced by a real pad id",
    "type_vocab_size": "token type ids number the segments 0 .. type_vocab_size - 1",
    "max_len": "positions run from 0 to max_len - 1: shorten the input or use a config with "
               "a larger max_len",
    "num_classes": "labels must be class indices 0 .. num_classes - 1",
}

_TRACED_ID_CHECKS = contextvars.ContextVar("transformer_jax_traced_id_checks", default=False)


def id_range_message(name: str, position, value, bad, total: int, size: int, owner: str,
                     advice: str) -> str:
    """``input_ids[1, 7] = 50300 is outside the vocabulary [0, 50257) of GPTConfig.vocab_size
    (bad ids in input_ids: 2 of 16); <advice>``. ``position`` (one entry per axis),
    ``value`` and ``bad`` may be ``"{}"``: the template of the checkify message."""
    field = owner.rsplit(".", 1)[-1]
    where = f"{name}[{', '.join(map(str, position))}]" if len(position) else name
    return (f"{where} = {value} is outside the {_TABLES.get(field, 'range')} [0, {size}) of "
            f"{owner} (bad ids in {name}: {bad} of {total}); {advice}")


def _table(config: Any, field: str) -> tuple[int, str, str]:
    """(size, owner such as ``"GPTConfig.vocab_size"``, advice) of ``config.<field>``."""
    return (int(getattr(config, field)), f"{type(config).__name__}.{field}",
            ID_ADVICE.get(field, f"ids must lie in [0, {field})"))


def check_id_range(name: str, ids: Any, config: Any, field: str = "vocab_size", *,
                   advice: str | None = None) -> None:
    """On the host: a UserError when an id of ``ids`` lies outside [0, ``config.<field>``),
    naming the first such id (row-major), its position, how many there are, the table
    (``GPTConfig.vocab_size``) and what to do (``advice``, default by field). Costs a
    min and a max over ``ids`` when they are all valid."""
    ids = np.asarray(ids)
    size, owner, default = _table(config, field)
    if ids.size == 0 or (ids.min() >= 0 and ids.max() < size):
        return
    bad = (ids < 0) | (ids >= size)
    flat = int(np.argmax(bad))
    position = [int(p) for p in np.unravel_index(flat, ids.shape)]
    raise UserError(id_range_message(name, position, ids.reshape(-1)[flat].item(),
                                     int(bad.sum()), ids.size, size, owner, advice or default))


def check_special_id(name: str, value: Any, config: Any, why: str) -> None:
    """On the host: a UserError when a special id the model is fed (``pad_id``,
    ``decoder_start_id``) lies outside [0, ``config.vocab_size``); ``why`` says where it goes."""
    size, owner, _ = _table(config, "vocab_size")
    if value is not None and not 0 <= int(value) < size:
        raise UserError(f"{name}={value} is outside the vocabulary [0, {size}) of {owner}: "
                        f"{why}; pass an id the model has")


def _checkify_id_range(name: str, ids: Any, config: Any, field: str) -> None:
    """``check_id_range`` as a ``checkify.check`` on traced ids (same message)."""
    if ids.size == 0:
        return
    size, owner, advice = _table(config, field)
    bad = (ids < 0) | (ids >= size)
    flat = jnp.argmax(bad.reshape(-1))
    position = jnp.unravel_index(flat, ids.shape)
    template = id_range_message(name, ["{}"] * ids.ndim, "{}", "{}", ids.size, size, owner, advice)
    checkify.check(~jnp.any(bad), template, *position, ids.reshape(-1)[flat], jnp.sum(bad))


def check_id_values(name: str, ids: Any, config: Any, field: str = "vocab_size") -> None:
    """Ids outside [0, ``config.<field>``): concrete ids raise a UserError now
    (:func:`check_id_range`); traced ids get a ``checkify.check`` inside :func:`checked` and
    no check otherwise (plain ``jax.jit``: the compiled program stays unchecked). None: no ids."""
    if ids is None:
        return
    if not isinstance(ids, jax.core.Tracer):
        check_id_range(name, ids, config, field)
    elif _TRACED_ID_CHECKS.get():
        _checkify_id_range(name, ids, config, field)


def checked(fn: Callable, errors: Any = checkify.user_checks) -> Callable:
    """``fn`` with the models' id checks on traced ids too: ``checked(fn)(*args, **kwargs)``
    -> ``(error, fn(*args, **kwargs))``, as ``checkify.checkify``.

    Every model entry point ``fn`` calls (``model.apply``, ``method="encode"``, ...) adds a
    ``checkify.check`` per id input, so under ``jax.jit`` ``error.throw()`` raises the
    message a concrete call raises as a UserError::

        err, logits = jax.jit(checked(model.apply))(variables, input_ids)
        err.throw()   # input_ids[1, 7] = 50300 is outside the vocabulary [0, 50257) ...

    Jit the checked function, not the other way round: a function jitted before it was
    checked keeps the program it compiled without the checks. ``errors`` adds checkify's
    other error sets (e.g. ``checkify.nan_checks``); user checks are always on.
    """
    def with_id_checks(*args, **kwargs):
        token = _TRACED_ID_CHECKS.set(True)
        try:
            return fn(*args, **kwargs)
        finally:
            _TRACED_ID_CHECKS.reset(token)

    return functools.wraps(fn)(checkify.checkify(with_id_checks,
                                                 errors=errors | checkify.user_checks))


def check_decoder_inputs(decoder_input_ids, encoded, decoder_attention_mask, decode: bool,
                         config: Any = None):
    """An encoder-decoder's ``decode`` inputs: checked target ids (B, T) (in ``config``'s
    vocabulary) that match the batch of ``encoded`` (B, S, D), and no target padding mask
    while decoding from the cache."""
    decoder_input_ids = check_ids("decoder_input_ids", decoder_input_ids, config)
    if encoded.ndim != 3 or encoded.shape[0] != decoder_input_ids.shape[0]:
        raise UserError(f"encoded must be (B, S, D) with B = {decoder_input_ids.shape[0]}; "
                        f"got {tuple(encoded.shape)}")
    if decode and decoder_attention_mask is not None:
        raise UserError("decoder_attention_mask is not supported with decode=True (the cache "
                        "masks positions that are not written yet)")
    return decoder_input_ids


def check_causal_lm_mask(attention_mask, b: int, t: int, decode: bool) -> None:
    """A decoder-only model's ``attention_mask``: (B, S), and S = T unless decoding (then
    it covers the whole cache)."""
    if attention_mask is None:
        return
    shape = jnp.shape(attention_mask)
    if len(shape) != 2 or shape[0] != b:
        raise UserError(f"attention_mask must be (B, S) = ({b}, S); got {shape}")
    if not decode and shape[1] != t:
        raise UserError(f"attention_mask length {shape[1]} != input length {t}")


def running_position(module: Any, t: int, decode: bool):
    """Position of the first of ``t`` new tokens: 0, or (``decode``) the running cache
    position kept in ``module``'s ``cache`` variable ``position_index``, advanced by t."""
    if not decode:
        return 0
    index = module.variable("cache", "position_index", lambda: jnp.array(0, jnp.int32))
    if module.is_initializing():
        return 0
    start = index.value
    index.value = start + t
    return start


def check_segment_ids(name: str, segment_ids, shape: tuple[int, int], decode: bool = False):
    """Packed documents: ``segment_ids`` (B, T) int32 of the tokens of ``shape`` (B, T), or
    None; a UserError with ``decode`` (a KV cache holds one sequence per row) or a bad shape."""
    if segment_ids is None:
        return None
    if decode:
        raise UserError(f"{name} (packed documents) are for training and scoring, not for "
                        "decode=True: a KV cache holds one sequence per row; decode each "
                        "document in its own row")
    segment_ids = jnp.asarray(segment_ids)
    if tuple(segment_ids.shape) != tuple(shape) or not jnp.issubdtype(segment_ids.dtype,
                                                                      jnp.integer):
        raise UserError(f"{name} must be integers of the tokens' shape {tuple(shape)} (one "
                        f"document id per token); got {segment_ids.dtype} "
                        f"{tuple(segment_ids.shape)}")
    return segment_ids.astype(jnp.int32)


def check_positions(name: str, positions, shape: tuple[int, int]):
    """Per-token ``positions`` (B, T) int32 of the tokens of ``shape`` (B, T), or None."""
    if positions is None:
        return None
    positions = jnp.asarray(positions)
    if tuple(positions.shape) != tuple(shape) or not jnp.issubdtype(positions.dtype, jnp.integer):
        raise UserError(f"{name} must be integers of the tokens' shape {tuple(shape)}; got "
                        f"{positions.dtype} {tuple(positions.shape)}")
    return positions.astype(jnp.int32)


def check_packed_decoder(segment_ids, memory_segment_ids, shape, memory_shape, decode: bool):
    """An encoder-decoder's packed documents: the targets' ``segment_ids`` (B, T) and the
    source's ``memory_segment_ids`` (B, S), both or neither, checked (not with decode)."""
    if (segment_ids is None) != (memory_segment_ids is None):
        raise UserError("packed documents need segment ids for both the source (segment_ids "
                        "of the encoder) and the targets (decoder_segment_ids), or neither")
    return (check_segment_ids("decoder_segment_ids", segment_ids, shape, decode),
            check_segment_ids("segment_ids", memory_segment_ids, memory_shape, decode))


def encode_then_decode(model: Any, input_ids, decoder_input_ids, attention_mask,
                       decoder_attention_mask, deterministic: bool, *, segment_ids=None,
                       positions=None, decoder_segment_ids=None, decoder_positions=None,
                       return_hidden: bool = False):
    """An encoder-decoder's ``__call__``: checked ids, ``model.encode``, ``model.decode``
    (packed documents: the source's and the targets' segment ids and positions;
    ``return_hidden``: the decoder's hidden states and read-out weights, not its logits)."""
    input_ids = check_ids("input_ids", input_ids)
    decoder_input_ids = check_ids("decoder_input_ids", decoder_input_ids)
    if input_ids.shape[0] != decoder_input_ids.shape[0]:
        raise UserError(f"input_ids {tuple(input_ids.shape)} and decoder_input_ids "
                        f"{tuple(decoder_input_ids.shape)} have different batch sizes")
    encoded = model.encode(input_ids, attention_mask, deterministic=deterministic,
                           segment_ids=segment_ids, positions=positions)
    return model.decode(decoder_input_ids, encoded, attention_mask, decoder_attention_mask,
                        deterministic=deterministic, segment_ids=decoder_segment_ids,
                        positions=decoder_positions, memory_segment_ids=segment_ids,
                        **({"return_hidden": True} if return_hidden else {}))


def to_config_layout(params: dict, config: Any) -> dict:
    """``params`` with every layer stack in ``config``'s layout (``scan_layers``): one
    subtree with a leading (L,) axis per stack, or one subtree per layer. For weights made
    in the other layout, e.g. by ``interop.from_torch`` (unrolled) for a scanned Transformer."""
    return convert_layout(params, config.layer_stacks, scanned=config.scan_layers)


class EfficientAttentionConfig:
    """The efficient-attention fields the GPT, BERT and ViT configs share:

      ``attention``          "softmax" (exact attention, ``attention_impl`` chooses the
                             kernel) or "linear" (Katharopoulos et al. 2020; O(T), its
                             decode cache a constant-size state: ``layers.linear_attention``);
      ``attention_window``   W: each token attends to the W nearest tokens (causal: the W
                             most recent, itself included; Mistral's ``sliding_window``);
      ``attention_sparsity`` "strided:L" or "fixed:L:C", Child et al. (2019)'s patterns
                             (``layers.masks.AttentionPattern``).

    The block paths ("chunked", "pallas") skip what a window or pattern excludes, and
    decoding with a window keeps a ring of W cache slots. Call
    ``_require_attention_options`` from ``__post_init__`` after the model settings.
    """

    @property
    def attention_pattern(self) -> AttentionPattern | None:
        if self.attention_window is not None:
            return AttentionPattern("window", self.attention_window)
        if self.attention_sparsity is not None:
            return AttentionPattern.parse(self.attention_sparsity)
        return None

    def attention_reach(self, seq_len: int) -> float:
        """Keys one query's attention works over (FLOP counts): T, or the window, or the
        pattern's keys per row; linear attention's per-token work is a head-dim-sized
        state, so its reach is the head dim."""
        if self.attention == "linear":
            return self.head_dim
        pattern = self.attention_pattern
        if pattern is None:
            return seq_len
        if pattern.kind == "window":
            return min(seq_len, pattern.size)
        strided = seq_len / pattern.size if pattern.kind == "strided" else (
            seq_len * pattern.summary / pattern.size)
        return min(seq_len, pattern.size + strided)

    def _require_attention_options(self) -> None:
        name = type(self).__name__
        self._require_choice("attention", ATTENTION_KINDS)
        self._require_number("attention_window", integer=True, minimum=1, allow_none=True)
        if self.attention_sparsity is not None:
            try:
                AttentionPattern.parse(self.attention_sparsity)
            except UserError as e:
                raise UserError(f"{name}.attention_sparsity: {e}") from None
        self._require_relation(
            self.attention_window is None or self.attention_sparsity is None,
            ("attention_window", "attention_sparsity"),
            f"and attention_sparsity={self.attention_sparsity!r} are both set; the strided and "
            "fixed patterns have their own local part: choose one")
        linear = self.attention == "linear"
        self._require_relation(
            not linear or (self.attention_window is None and self.attention_sparsity is None),
            ("attention", "attention_window", "attention_sparsity"),
            "has no window or sparse pattern (it never forms the weights); unset "
            "attention_window/attention_sparsity or use attention='softmax'")
        self._require_relation(
            not linear or self.attention_impl == "auto",
            ("attention", "attention_impl"),
            f"runs its own implementation; attention_impl={self.attention_impl!r} is for "
            "softmax attention: leave it 'auto'")
        rate = getattr(self, "attention_dropout_rate", getattr(self, "dropout_rate", 0.0))
        self._require_relation(
            not linear or rate == 0, ("attention", "attention_dropout_rate"),
            f"has no attention weights to drop (attention dropout {rate}); set "
            "attention_dropout_rate=0")
        prefix = getattr(self, "prefix_tokens", 0)
        self._require_relation(
            not prefix or (not linear and self.attention_pattern is None),
            ("prefix_tokens", "attention", "attention_window", "attention_sparsity"),
            "(prefix tuning) needs full softmax attention; unset the window/sparsity or "
            "use attention='softmax'")


def attention_plan(config: Any, seq_len: int, platform: str,
                   tpu_generation: int | None = None) -> dict[str, str]:
    """What ``config.attention_impl`` (or linear attention) runs on ``platform`` ("cpu", "gpu", "tpu"; a TPU of
    ``tpu_generation``, e.g. 3 for a v3, when known) for sequences of ``seq_len`` (a ViT's
    own patch count instead), in training (with its attention dropout) and at eval:
    ``{"attention_impl", "platform", "train", "eval", "why"}``; ``platform`` names the TPU
    generation (``"tpu v3"``) when it is known, ``why`` the reason for the eval choice. A
    config's ``ATTENTION_BIAS`` (T5's relative positions) and prefix tuning's (T, P + S)
    mask are what the splash kernel cannot express."""
    rate = getattr(config, "attention_dropout_rate", getattr(config, "dropout_rate", 0.0))
    seq_len = getattr(config, "seq_len", seq_len)
    shape = dict(dtype=config.dtype, head_dim=config.head_dim, q_len=seq_len, kv_len=seq_len,
                 pattern=getattr(config, "attention_pattern", None),
                 tpu_generation=tpu_generation if platform == "tpu" else None,
                 bias=getattr(config, "ATTENTION_BIAS", None),
                 mask="general" if getattr(config, "prefix_tokens", 0) else "keys")
    impl = config.attention_impl
    where = f"tpu v{tpu_generation}" if platform == "tpu" and tpu_generation else platform
    if getattr(config, "attention", "softmax") == "linear":
        return {"attention_impl": impl, "platform": where, "train": "linear", "eval": "linear",
                "why": "linear attention"}
    train = resolve_implementation(impl, platform, dropout=rate > 0, **shape)
    name, why = choose_implementation(impl, platform, **shape)
    return {"attention_impl": impl, "platform": where, "train": train, "eval": name,
            "why": why}


def describe_attention_plan(plan: dict[str, str], config: Any) -> str:
    """One line for the start of a run, e.g. ``attention: auto -> splash (tpu v5e: MaxText's
    kernel: no bias, a mask splash expresses)``; the reason only for ``auto``."""
    if plan["train"] == "linear":
        return f"attention: linear ({plan['platform']})"
    head = f"attention: {plan['attention_impl']} -> "
    why = f": {plan['why']}" if plan.get("why") and plan["attention_impl"] == "auto" else ""
    if plan["train"] == plan["eval"]:
        return head + f"{plan['train']} ({plan['platform']}{why})"
    rate = getattr(config, "attention_dropout_rate", getattr(config, "dropout_rate", 0.0))
    return (head + f"{plan['train']} while training ({plan['platform']}: attention dropout "
            f"{rate} needs it; set it to 0 for {plan['eval']}), {plan['eval']} at eval{why}")


class EncoderDecoderConfig:
    """What the encoder-decoder configs (T5, Transformer) share: their two layer stacks and
    their training FLOPs, PaLM convention.

    Needs ``_layer_params() -> (encoder layer, decoder layer)`` weight counts and the fields
    ``num_layers``, ``decoder_layers``, ``vocab_size``, ``d_model``, ``num_heads``, ``head_dim``.
    """

    @property
    def decoder_layers(self) -> int:
        return self.num_layers if self.num_decoder_layers is None else self.num_decoder_layers

    @property
    def layer_stacks(self) -> tuple[tuple[tuple[str, ...], str, int], ...]:
        """(parent path, name, count) of each layer stack: ``{encoder,decoder}/layers_{i}``,
        scanned ``{encoder,decoder}/layers``."""
        return ((("encoder",), "layers", self.num_layers),
                (("decoder",), "layers", self.decoder_layers))

    def flops_per_example(self, src_len: int, tgt_len: int, *,
                          frozen_base: bool = False) -> float:
        """Training FLOPs of one (source, target) pair: 6 per matmul weight per token (the
        encoder's weights x S, the decoder's and the V D read-out x T; 4 with ``frozen_base``)
        + 12 N H per attention logit per layer (L_enc S^2 + L_dec (T^2 + T S)). Embedding
        lookups, position terms and norms' elementwise work are not counted."""
        enc, dec = self._layer_params()
        s, t = src_len, tgt_len
        weights = self.num_layers * enc * s + self.decoder_layers * dec * t
        weights += self.vocab_size * self.d_model * t
        width = self.num_heads * self.head_dim
        attn = width * (self.num_layers * s * s + self.decoder_layers * (t * t + t * s))
        return (4.0 if frozen_base else 6.0) * weights + 12.0 * attn

    def flops_per_token(self, seq_len: int, *, frozen_base: bool = False) -> float:
        """``flops_per_example(seq_len, seq_len)`` per token of the pair (2 seq_len tokens)."""
        return self.flops_per_example(seq_len, seq_len, frozen_base=frozen_base) / (2 * seq_len)
