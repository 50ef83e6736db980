"""T5 parity with Hugging Face ``T5ForConditionalGeneration`` (PyTorch), through ``interop.hf.t5``.

The HF models and tolerances come from ``conftest.py`` (random weights moved off HF's init:
norm scales of exactly 1 would hide a swapped norm). Two architectures: v1.0 (ReLU FF,
lm_head tied to ``shared``, D^-1/2 output scaling) and v1.1 (gated tanh-GELU FF, separate
lm_head, no scaling), both with 1 encoder and 2 decoder layers (the stacks differ, and
the decoder's bias table serves several layers) and a padded encoder batch.
"""
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from transformer_jax.beam_search import beam_search, greedy_search
from transformer_jax.interop import from_hf, hf_config, to_hf
from transformer_jax.interop.common import ConversionError
from transformer_jax.interop.hf import from_hf_state_dict
from transformer_jax.interop.hf.t5 import to_hf_model
from transformer_jax.layers.relative import relative_position_bucket
from transformer_jax.models.t5 import T5, T5Config

from .conftest import (T5_ATOL, T5_GRAD_ATOL, T5_GRAD_RTOL, T5_RTOL, assert_gradients_match,
                       assert_same_leaves, run_without_torch, t5_model, torch, transformers,
                       untie_lm_head)

GATED = dict(feed_forward_proj="gated-gelu", tie_word_embeddings=False)


@pytest.fixture(scope="module", params=["relu_tied", "gated_untied"])
def pair(request):
    hf = t5_model(**(GATED if request.param == "gated_untied" else {}))
    return request.param, hf, from_hf(hf)


def inputs(seed=0, batch=3, src=11, tgt=7, vocab=50):
    rng = np.random.default_rng(seed)
    ids = rng.integers(2, vocab, (batch, src)).astype(np.int32)
    mask = np.ones((batch, src), np.int32)
    mask[1, 7:] = 0
    mask[2, 3:] = 0
    ids[mask == 0] = 0
    dec = rng.integers(0, vocab, (batch, tgt)).astype(np.int32)
    return ids, mask, dec


@functools.lru_cache(maxsize=None)
def forward(module):
    """One jitted forward per module config (equal configs share the compiled program)."""
    return jax.jit(lambda p, *args: module.apply({"params": p}, *args))


def hf_logits(model, ids, mask, dec):
    with torch.no_grad():
        return model(input_ids=torch.as_tensor(ids, dtype=torch.long),
                     attention_mask=torch.as_tensor(mask, dtype=torch.long),
                     decoder_input_ids=torch.as_tensor(dec, dtype=torch.long)).logits.numpy()


# ----------------------------------------------------------------------------- buckets

@pytest.mark.parametrize("bidirectional", [True, False])
@pytest.mark.parametrize("num_buckets,max_distance", [(32, 128), (8, 20), (16, 64), (64, 512)])
def test_relative_position_bucket_equals_hf_on_a_grid(bidirectional, num_buckets, max_distance):
    from transformers.models.t5.modeling_t5 import T5Attention

    rel = np.arange(-700, 701)
    want = T5Attention._relative_position_bucket(torch.as_tensor(rel), bidirectional, num_buckets,
                                                 max_distance).numpy()
    bucket = jax.jit(relative_position_bucket, static_argnames=("bidirectional", "num_buckets",
                                                                "max_distance"))
    got = np.asarray(bucket(jnp.asarray(rel), bidirectional=bidirectional,
                            num_buckets=num_buckets, max_distance=max_distance))
    np.testing.assert_array_equal(got, want)


# ----------------------------------------------------------------------------- forward / backward

def test_config_mapping(pair):
    name, hf, (module, _) = pair
    cfg = module.config
    assert (cfg.vocab_size, cfg.d_model, cfg.head_dim, cfg.mlp_dim, cfg.num_heads) == (50, 32, 8, 48, 4)
    assert (cfg.num_layers, cfg.decoder_layers) == (1, 2)
    assert (cfg.relative_attention_num_buckets, cfg.relative_attention_max_distance) == (8, 20)
    assert (cfg.pad_token_id, cfg.eos_token_id, cfg.decoder_start_token_id) == (0, 1, 0)
    got = (cfg.activation, cfg.gated_mlp, cfg.tie_embeddings, cfg.scales_output)
    if name == "relu_tied":
        assert got == ("relu", False, True, True)
    else:
        assert got == ("gelu_tanh", True, False, False)


def test_logits_parity_with_encoder_padding(pair):
    _, hf, (module, params) = pair
    ids, mask, dec = inputs()
    ours = np.asarray(forward(module)(params, ids, dec, mask))
    np.testing.assert_allclose(ours, hf_logits(hf, ids, mask, dec), rtol=T5_RTOL, atol=T5_ATOL)
    # padding matters: without the mask the padded rows change
    unmasked = np.asarray(forward(module)(params, ids, dec, np.ones_like(mask)))
    assert np.abs(unmasked[2] - ours[2]).max() > 1e-2
    np.testing.assert_allclose(unmasked[0], ours[0], rtol=1e-6, atol=1e-6)


def test_scan_layers_conversion(pair):
    """``from_hf(..., scan_layers=True)`` stacks each stack's layers into one ``layers``
    module; the scanned model gives HF's logits, and ``to_hf`` writes the same tensors from
    either layout."""
    _, hf, (module, params) = pair
    smod, sparams = from_hf(hf, scan_layers=True)
    assert smod.config.scan_layers
    for stack, layers in (("encoder", 1), ("decoder", 2)):
        assert "layers" in sparams[stack] and "layers_0" not in sparams[stack]
        assert sparams[stack]["layers"]["self_attn"]["query"]["kernel"].shape == (layers, 32, 4, 8)
    ids, mask, dec = inputs()
    np.testing.assert_allclose(np.asarray(forward(smod)(sparams, ids, dec, mask)),
                               hf_logits(hf, ids, mask, dec), rtol=T5_RTOL, atol=T5_ATOL)
    a, b = to_hf(smod, sparams), to_hf(module, params)
    assert set(a) == set(b)
    for key in a:
        np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]), err_msg=key)


def test_hf5_tied_v11_model_converts():
    """HF >= 5 builds a v1.1 config as tied but unscaled: that combination converts too."""
    hf = t5_model(seed=3, feed_forward_proj="gated-gelu")
    hf.config.scale_decoder_outputs = False
    module, params = from_hf(hf)
    assert module.config.tie_embeddings and not module.config.scales_output
    assert "lm_head" not in params
    ids, mask, dec = inputs(3)
    np.testing.assert_allclose(np.asarray(forward(module)(params, ids, dec, mask)),
                               hf_logits(hf, ids, mask, dec), rtol=T5_RTOL, atol=T5_ATOL)


def test_gradient_parity(pair):
    _, hf, (module, params) = pair
    ids, mask, dec = inputs(1)
    labels = np.random.default_rng(2).integers(0, 50, dec.shape).astype(np.int32)
    weights = np.ones(dec.shape, np.float32)
    weights[0, 5:] = 0

    def loss_fn(p):
        logits = module.apply({"params": p}, ids, dec, mask)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits, labels)
        return (ce * weights).sum() / weights.sum()

    jax_loss, jax_grads = jax.jit(jax.value_and_grad(loss_fn))(params)
    hf.zero_grad()
    logits = hf(input_ids=torch.as_tensor(ids, dtype=torch.long),
                attention_mask=torch.as_tensor(mask, dtype=torch.long),
                decoder_input_ids=torch.as_tensor(dec, dtype=torch.long)).logits
    ce = torch.nn.functional.cross_entropy(logits.reshape(-1, 50),
                                           torch.as_tensor(labels, dtype=torch.long).reshape(-1),
                                           reduction="none")
    w = torch.as_tensor(weights).reshape(-1)
    loss = (ce * w).sum() / w.sum()
    loss.backward()
    np.testing.assert_allclose(float(jax_loss), loss.item(), rtol=1e-5)
    # named_parameters lists shared once (its .grad sums the encoder, decoder and tied head uses)
    torch_grads = {name: p.grad for name, p in hf.named_parameters()}
    _, mapped = from_hf_state_dict(hf.config, torch_grads, tie_embeddings=module.config.tie_embeddings)
    hf.zero_grad()
    # T5 has no biases: the key-bias exemption of assert_gradients_match never applies
    assert_gradients_match(jax_grads, mapped, params, rtol=T5_GRAD_RTOL, atol=T5_GRAD_ATOL,
                           atol_relative=True)


# ----------------------------------------------------------------------------- round trips

def test_round_trip_strict_load(pair):
    name, hf, (module, params) = pair
    sd = to_hf(module, params)
    assert set(sd) == set(hf.state_dict())
    for key, value in hf.state_dict().items():
        torch.testing.assert_close(sd[key], value, rtol=0, atol=0, msg=key)
    # the aliases are one tensor, as in HF
    assert sd["encoder.embed_tokens.weight"] is sd["shared.weight"] is sd["decoder.embed_tokens.weight"]
    assert (sd["lm_head.weight"] is sd["shared.weight"]) == (name == "relu_tied")
    fresh = to_hf_model(module, params)
    assert (fresh.lm_head.weight is fresh.shared.weight) == (name == "relu_tied")
    ids, mask, dec = inputs(4)
    np.testing.assert_array_equal(hf_logits(fresh, ids, mask, dec), hf_logits(hf, ids, mask, dec))
    again = from_hf(fresh)[1]
    assert_same_leaves(params, again)


def test_save_pretrained_dir_loads_without_torch(pair, tmp_path):
    name, hf, (module, params) = pair
    hf.save_pretrained(tmp_path / "ckpt", safe_serialization=True)
    from safetensors import safe_open

    keys = set(safe_open(str(tmp_path / "ckpt" / "model.safetensors"), "np").keys())
    assert "encoder.embed_tokens.weight" not in keys and "shared.weight" in keys
    assert ("lm_head.weight" in keys) == (name == "gated_untied")
    ids, mask, dec = inputs(5)
    if name == "relu_tied":      # in process (the torch-free subprocess runs once, below)
        m, p = from_hf(tmp_path / "ckpt")
        assert m.config == module.config
        np.testing.assert_array_equal(np.asarray(forward(m)(p, ids, dec, mask)),
                                      np.asarray(forward(module)(params, ids, dec, mask)))
        return
    for n, a in (("ids", ids), ("mask", mask), ("dec", dec)):
        np.save(tmp_path / f"{n}.npy", a)
    run_without_torch("""
        ids, mask, dec = (np.load(f"{sys.argv[2]}/{n}.npy") for n in ("ids", "mask", "dec"))
        np.save(sys.argv[3], np.asarray(module.apply({"params": params}, ids, dec, mask)))
    """, tmp_path / "ckpt", tmp_path, tmp_path / "out.npy")
    np.testing.assert_allclose(np.load(tmp_path / "out.npy"), hf_logits(hf, ids, mask, dec),
                               rtol=T5_RTOL, atol=T5_ATOL)
    # an HF 4.x config.json: tie_word_embeddings=False and no scale_decoder_outputs
    cfg_path = tmp_path / "ckpt" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("scale_decoder_outputs")
    cfg["tie_word_embeddings"] = False
    cfg_path.write_text(json.dumps(cfg))
    m4, p4 = from_hf(tmp_path / "ckpt")
    assert m4.config == module.config
    np.testing.assert_array_equal(np.asarray(p4["lm_head"]["kernel"]),
                                  np.asarray(params["lm_head"]["kernel"]))


# ----------------------------------------------------------------------------- aliases, bad input

@pytest.fixture(scope="module")
def relu_hf():
    return t5_model(seed=7)


def test_alias_keys_must_agree(relu_hf):
    sd = dict(relu_hf.state_dict())
    assert {"shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight",
            "lm_head.weight"} <= set(sd)
    only_decoder = {k: v for k, v in sd.items() if k not in ("shared.weight", "encoder.embed_tokens.weight")}
    module, params = from_hf_state_dict(relu_hf.config, only_decoder)    # any one alias suffices
    np.testing.assert_array_equal(np.asarray(params["shared"]["embedding"]), sd["shared.weight"].numpy())
    bad = dict(sd, **{"encoder.embed_tokens.weight": sd["shared.weight"] + 1})
    with pytest.raises(ConversionError, match="encoder.embed_tokens.weight"):
        from_hf_state_dict(relu_hf.config, bad)


def test_untied_head_cannot_be_forced_tied(relu_hf):
    sd = dict(relu_hf.state_dict(), **{"lm_head.weight": relu_hf.shared.weight.detach() * 2})
    module, _ = from_hf_state_dict(relu_hf.config, sd)
    assert not module.config.tie_embeddings and module.config.scales_output
    with pytest.raises(ConversionError, match="cannot be tied"):
        from_hf_state_dict(relu_hf.config, sd, tie_embeddings=True)


def test_unused_cross_attention_bias_is_dropped_after_a_shape_check(relu_hf):
    key = "decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight"
    sd = dict(relu_hf.state_dict(), **{key: torch.zeros(8, 4)})
    from_hf_state_dict(relu_hf.config, sd)
    with pytest.raises(ConversionError, match="EncDecAttention.relative_attention_bias"):
        from_hf_state_dict(relu_hf.config, dict(sd, **{key: torch.zeros(8, 5)}))


def test_unknown_missing_and_misshapen_keys_raise(relu_hf):
    sd = dict(relu_hf.state_dict())
    with pytest.raises(ConversionError, match="unexpected key.*encoder.block.0.extra"):
        from_hf_state_dict(relu_hf.config, dict(sd, **{"encoder.block.0.extra": torch.zeros(2)}))
    missing = {k: v for k, v in sd.items() if k != "decoder.block.1.layer.2.DenseReluDense.wo.weight"}
    with pytest.raises(ConversionError, match="decoder.block.1.layer.2.DenseReluDense.wo.weight"):
        from_hf_state_dict(relu_hf.config, missing)
    key = "encoder.block.0.layer.0.SelfAttention.q.weight"
    with pytest.raises(ConversionError, match=r"q.weight.*\(32, 31\).*expected \(32, 32\)"):
        from_hf_state_dict(relu_hf.config, dict(sd, **{key: torch.zeros(32, 31)}))


@pytest.mark.parametrize("option,value,match", [
    ("feed_forward_proj", "gated-mish", "feed_forward_proj"),
    ("feed_forward_proj", "relu-gated", "feed_forward_proj"),
    ("eos_token_id", [1, 2], "eos_token_id"),
])
def test_unsupported_config_options_raise(relu_hf, option, value, match):
    config = dict(relu_hf.config.to_dict(), **{option: value})
    with pytest.raises(ValueError, match=match):
        from_hf_state_dict(config, relu_hf.state_dict())


def test_hf_config_round_trip(pair):
    _, hf, (module, _) = pair
    cfg = hf_config(module.config)
    assert isinstance(cfg, transformers.T5Config)
    for key in ("vocab_size", "d_model", "d_kv", "d_ff", "num_layers", "num_decoder_layers",
                "num_heads", "relative_attention_num_buckets", "relative_attention_max_distance",
                "feed_forward_proj", "scale_decoder_outputs", "decoder_start_token_id"):
        assert getattr(cfg, key) == getattr(hf.config, key), key


@pytest.mark.parametrize("name,count", [
    ("t5-small", 60_506_624), ("t5-base", 222_903_552), ("t5-large", 737_668_096),
    ("t5-v1_1-small", 76_961_152), ("t5-v1_1-base", 247_577_856), ("tiny", None)])
def test_parameter_counts_match_hf(name, count):
    cfg = T5Config.preset(name)
    with torch.device("meta"):
        hf = transformers.T5ForConditionalGeneration(hf_config(cfg))
        if not cfg.tie_embeddings:
            untie_lm_head(hf)
    hf_count = sum(p.numel() for p in hf.parameters())      # aliases and a tied head count once
    ids = jnp.zeros((1, 2), jnp.int32)
    shapes = jax.eval_shape(lambda: T5(cfg).init(jax.random.PRNGKey(0), ids, ids))["params"]
    ours = sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(shapes))
    assert cfg.num_params() == ours == hf_count
    if count is not None:
        assert hf_count == count


# ----------------------------------------------------------------------------- generation

_SMALL: dict = {}


def small_vocab(arch):
    """Vocabulary 6 (eos 1 likely), so hypotheses end at many different lengths. (HF's
    generate needs num_decoder_layers == num_layers: its cache is sized by num_layers.)"""
    if arch not in _SMALL:
        hf = t5_model(seed=0, amplitude=0.3, vocab_size=6, num_layers=2, num_decoder_layers=2,
                     **(GATED if arch == "gated_untied" else {}))
        rng = np.random.default_rng(0)
        ids = rng.integers(2, 6, (6, 9)).astype(np.int32)
        mask = np.ones_like(ids)
        mask[1, 6:] = 0
        mask[3, 2:] = 0
        _SMALL[arch] = hf, from_hf(hf), ids, mask
    return _SMALL[arch]


def hf_generate(hf, ids, mask, **kw):
    with torch.no_grad():
        return hf.generate(input_ids=torch.as_tensor(ids, dtype=torch.long),
                           attention_mask=torch.as_tensor(mask, dtype=torch.long), do_sample=False,
                           return_dict_in_generate=True, output_scores=True, **kw)


def cut(row, eos=1):
    row = [int(x) for x in row]
    return row[: row.index(eos) + 1] if eos in row else row


def test_greedy_matches_hf():
    hf, (module, params), ids, mask = small_vocab("relu_tied")
    want = hf_generate(hf, ids, mask, num_beams=1, max_new_tokens=10).sequences.numpy()[:, 1:]
    got = np.asarray(greedy_search(module, params, ids, mask, max_new_tokens=10))
    assert [cut(r) for r in got] == [cut(r) for r in want]
    # Again with the 4th token of row 0 as eos: that row stops early, then holds pad.
    eos = int(got[0, 3])
    want = hf_generate(hf, ids, mask, num_beams=1, max_new_tokens=10, eos_token_id=eos,
                       pad_token_id=0).sequences.numpy()[:, 1:]
    got = np.asarray(greedy_search(module, params, ids, mask, max_new_tokens=10, eos_id=eos))
    assert [cut(r, eos) for r in got] == [cut(r, eos) for r in want]
    assert len(cut(got[0], eos)) <= 4
    for row in got:
        assert all(t == 0 for t in row[len(cut(row, eos)):])
    # the scanned layers keep their KV caches (self and cross) stacked: the same tokens
    smod, sparams = from_hf(hf, scan_layers=True)
    got_scanned = np.asarray(greedy_search(smod, sparams, ids, mask, max_new_tokens=10, eos_id=eos))
    np.testing.assert_array_equal(got_scanned, got)


# Settings where HF's generate is well defined and deterministic: do_sample=False, one eos,
# no logits processors, and all k returned hypotheses compared (num_return_sequences=k).
@pytest.mark.parametrize("arch,num_beams,length_penalty,early_stopping", [
    ("relu_tied", 3, 1.0, False), ("relu_tied", 3, 0.0, "never"), ("relu_tied", 3, -1.0, True),
    ("relu_tied", 3, 2.0, False), ("gated_untied", 2, 1.0, "never")])
def test_beam_search_matches_hf(arch, num_beams, length_penalty, early_stopping):
    hf, (module, params), ids, mask = small_vocab(arch)
    out = hf_generate(hf, ids, mask, num_beams=num_beams, num_return_sequences=num_beams,
                      length_penalty=length_penalty, early_stopping=early_stopping,
                      max_new_tokens=10)
    b, k = ids.shape[0], num_beams
    want = out.sequences.numpy()[:, 1:].reshape(b, k, -1)
    want_scores = out.sequences_scores.numpy().reshape(b, k)
    got = beam_search(module, params, ids, mask, num_beams=k, max_new_tokens=10,
                      length_penalty=length_penalty, early_stopping=early_stopping)
    assert [[cut(r) for r in beams] for beams in np.asarray(got.beam_sequences)] == \
           [[cut(r) for r in beams] for beams in want]
    np.testing.assert_allclose(np.asarray(got.beam_scores), want_scores, rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(np.asarray(got.sequences), np.asarray(got.beam_sequences)[:, 0])
    if length_penalty <= 0:    # short hypotheses win: some finished before the limit
        lengths = {len(cut(r)) for beams in np.asarray(got.beam_sequences) for r in beams}
        assert min(lengths) < 5 and max(lengths) == 10
