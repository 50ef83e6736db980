"""BERT parity with Hugging Face ``transformers`` (PyTorch), through ``interop.hf``.

The HF models and tolerances come from ``conftest.py`` (random weights moved off HF's init,
so that every mapping is exercised). The inputs carry right padding (``attention_mask``)
and three token types.
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from transformer_jax.interop import from_hf, hf_config, to_hf
from transformer_jax.interop.hf import from_hf_state_dict, to_hf_numpy
from transformer_jax.interop.hf.bert import HF_CLASSES, hf_class
from transformer_jax.models.bert import HEADS, Bert, BertConfig

from .conftest import (ATOL, BERT_TINY, RTOL, assert_gradients_match, bert_model,
                       run_without_torch, state_dict, torch, transformers)

B, T = 3, 13


@pytest.fixture(scope="module")
def models():
    """head -> (hf model, flax module, params)."""
    out = {}
    for head in HEADS:
        hf = bert_model(head)
        out[head] = (hf, *from_hf(hf))
    return out


def inputs(seed: int = 0):
    rng = np.random.default_rng(seed)
    ids = rng.integers(1, BERT_TINY["vocab_size"], (B, T)).astype(np.int32)
    types = rng.integers(0, 3, (B, T)).astype(np.int32)
    mask = (np.arange(T)[None, :] < np.array([T, 8, 3])[:, None]).astype(np.int32)
    ids[mask == 0] = 0                 # padding holds the pad id, as a tokenizer writes it
    return ids, types, mask


def hf_outputs(model, head, ids, types=None, mask=None, positions=None, grad=False):
    t = lambda x: None if x is None else torch.as_tensor(np.asarray(x), dtype=torch.long)  # noqa: E731
    with torch.set_grad_enabled(grad):
        o = model(input_ids=t(ids), token_type_ids=t(types), attention_mask=t(mask),
                  position_ids=t(positions))
    if head == "pretraining":
        return [o.prediction_logits, o.seq_relationship_logits]
    if head == "base":
        return [o.last_hidden_state, o.pooler_output]
    return [o.logits]


def our_outputs(module, params, ids, types=None, mask=None, positions=None):
    out = module.apply({"params": params}, ids, types, mask, positions)
    if isinstance(out, dict):
        return [out["mlm_logits"], out["nsp_logits"]]
    return list(out) if isinstance(out, tuple) else [out]


# ----------------------------------------------------------------------------- config

def test_config_mapping(models):
    hf, module, _ = models["pretraining"]
    cfg = module.config
    assert (cfg.vocab_size, cfg.d_model, cfg.num_layers, cfg.num_heads, cfg.mlp_dim,
            cfg.max_len, cfg.type_vocab_size) == (99, 32, 2, 4, 37, 40, 3)
    assert cfg.activation == "gelu" and cfg.norm_eps == 1e-12 and cfg.pad_token_id == 0
    assert (cfg.dropout_rate, cfg.attention_dropout_rate) == (0.1, 0.1)
    assert models["classification"][1].config.num_classes == 3
    assert {h: models[h][1].config.head for h in HEADS} == {h: h for h in HEADS}
    back = hf_config(cfg)
    for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                 "intermediate_size", "max_position_embeddings", "type_vocab_size", "hidden_act",
                 "layer_norm_eps", "hidden_dropout_prob", "attention_probs_dropout_prob",
                 "pad_token_id", "tie_word_embeddings"):
        assert getattr(back, name) == getattr(hf.config, name), name
    assert hf_config(models["classification"][1].config).num_labels == 3


# ----------------------------------------------------------------------------- forward

@pytest.mark.parametrize("head", HEADS)
def test_forward_parity_with_padding_and_token_types(models, head):
    hf, module, params = models[head]
    ids, types, mask = inputs(1)
    ours, theirs = our_outputs(module, params, ids, types, mask), hf_outputs(hf, head, ids, types, mask)
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert a.dtype == jnp.float32 and a.shape == tuple(b.shape)
        np.testing.assert_allclose(np.asarray(a), b.numpy(), rtol=RTOL, atol=ATOL)


def test_forward_parity_defaults_and_positions(models):
    """No token types / mask (HF: zeros / all ones), then explicit position ids."""
    hf, module, params = models["base"]
    ids, _, _ = inputs(2)
    for a, b in zip(our_outputs(module, params, ids), hf_outputs(hf, "base", ids)):
        np.testing.assert_allclose(np.asarray(a), b.numpy(), rtol=RTOL, atol=ATOL)
    positions = np.tile(np.arange(5, 5 + T), (B, 1))
    for a, b in zip(our_outputs(module, params, ids, positions=positions),
                    hf_outputs(hf, "base", ids, positions=positions)):
        np.testing.assert_allclose(np.asarray(a), b.numpy(), rtol=RTOL, atol=ATOL)


def test_padding_changes_nothing_at_real_positions(models):
    _, module, params = models["mlm"]
    ids, types, mask = inputs(3)
    other = np.where(mask == 1, ids, 7)          # different junk in the padded slots
    a = our_outputs(module, params, ids, types, mask)[0]
    b = our_outputs(module, params, other, types, mask)[0]
    np.testing.assert_allclose(np.asarray(a)[mask == 1], np.asarray(b)[mask == 1], rtol=1e-6, atol=1e-6)
    assert not np.allclose(np.asarray(a)[mask == 0], np.asarray(b)[mask == 0])


# ----------------------------------------------------------------------------- gradients

@pytest.mark.parametrize("head", ["pretraining", "classification"])
def test_gradient_parity(models, head):
    hf, module, params = models[head]
    ids, types, mask = inputs(4)
    rng = np.random.default_rng(5)
    mlm_labels = rng.integers(0, BERT_TINY["vocab_size"], (B, T))
    seq_labels = np.array([0, 1, 1]) if head != "classification" else np.array([2, 0, 1])
    w = mask.astype(np.float32)

    def jax_loss(p):
        out = our_outputs(module, p, ids, types, mask)
        loss = 0.0
        if head in ("pretraining", "mlm"):
            ce = optax.softmax_cross_entropy_with_integer_labels(out[0], mlm_labels)
            loss = (ce * w).sum() / w.sum()
        if head != "mlm":
            loss = loss + optax.softmax_cross_entropy_with_integer_labels(out[-1], seq_labels).mean()
        return loss

    value, grads = jax.jit(jax.value_and_grad(jax_loss))(params)

    hf.zero_grad()
    out = hf_outputs(hf, head, ids, types, mask, grad=True)
    tw = torch.as_tensor(w)
    loss = 0.0
    if head in ("pretraining", "mlm"):
        ce = torch.nn.functional.cross_entropy(out[0].reshape(-1, out[0].shape[-1]),
                                               torch.as_tensor(mlm_labels).reshape(-1), reduction="none")
        loss = (ce.reshape(B, T) * tw).sum() / tw.sum()
    if head != "mlm":
        loss = loss + torch.nn.functional.cross_entropy(out[-1], torch.as_tensor(seq_labels))
    loss.backward()
    np.testing.assert_allclose(float(value), loss.item(), rtol=RTOL)
    # named_parameters lists each tied tensor once (word embedding / decoder, the two
    # biases); its .grad holds every use, as ours does.
    _, mapped = from_hf_state_dict(hf.config, {n: p.grad for n, p in hf.named_parameters()})
    hf.zero_grad()
    assert_gradients_match(grads, mapped, params)
    # torch's padding_idx: the pad row gets no gradient through the lookup. In the MLM
    # heads the tied read-out still reaches it; in the classifier nothing does.
    pad_row = np.asarray(grads["bert"]["word_embeddings"]["embedding"][0])
    assert (np.abs(pad_row).max() == 0) == (head == "classification")


# ----------------------------------------------------------------------------- round trips

@pytest.mark.parametrize("head", HEADS)
def test_to_hf_strict_round_trip(models, head):
    hf, module, params = models[head]
    sd = to_hf(module, params)
    assert set(sd) == set(hf.state_dict())
    for key, value in hf.state_dict().items():
        torch.testing.assert_close(sd[key], value, rtol=0, atol=0, msg=key)
    fresh = hf_class(head)(hf_config(module.config)).eval()
    assert type(fresh).__name__ == HF_CLASSES[head]
    fresh.load_state_dict(sd, strict=True)
    ids, types, mask = inputs(6)
    for a, b in zip(hf_outputs(fresh, head, ids, types, mask), hf_outputs(hf, head, ids, types, mask)):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    if head in ("pretraining", "mlm"):          # tied as HF ties them
        assert sd["cls.predictions.decoder.weight"] is sd["bert.embeddings.word_embeddings.weight"]
        assert sd["cls.predictions.decoder.bias"] is sd["cls.predictions.bias"]


def test_flax_to_hf_from_fresh_init():
    """A model initialised here (not converted) goes to HF with identical outputs."""
    cfg = BertConfig.preset("tiny", vocab_size=77, max_len=24, dropout_rate=0.0,
                            attention_dropout_rate=0.0)
    module = Bert(cfg)
    shapes = jax.eval_shape(lambda: module.init(jax.random.PRNGKey(0), jnp.zeros((1, 4), jnp.int32)))
    rng = np.random.default_rng(1)     # random values everywhere (an init's biases would be 0)
    params = jax.tree_util.tree_map(lambda s: (0.2 * rng.standard_normal(s.shape)).astype(np.float32),
                                    nn.meta.unbox(shapes["params"]))
    hf = hf_class("pretraining")(hf_config(cfg)).eval()
    hf.load_state_dict(to_hf(module, params), strict=True)
    rng = np.random.default_rng(7)
    ids, types = rng.integers(1, 77, (2, 9)), rng.integers(0, 2, (2, 9))
    mask = np.array([[1] * 9, [1] * 4 + [0] * 5])
    for a, b in zip(our_outputs(module, params, ids, types, mask),
                    hf_outputs(hf, "pretraining", ids, types, mask)):
        np.testing.assert_allclose(np.asarray(a), b.numpy(), rtol=RTOL, atol=ATOL)


def test_scan_layers_conversion(models):
    hf, module, params = models["pretraining"]
    smod, sparams = from_hf(hf, scan_layers=True)
    assert smod.config.scan_layers and "layer" in sparams["bert"] and "layer_0" not in sparams["bert"]
    assert sparams["bert"]["layer"]["self_attn"]["query"]["kernel"].shape == (2, 32, 4, 8)
    ids, types, mask = inputs(8)
    for a, b in zip(our_outputs(smod, sparams, ids, types, mask), our_outputs(module, params, ids, types, mask)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=RTOL, atol=ATOL)
    a, b = to_hf_numpy(smod, sparams), to_hf_numpy(module, params)
    assert set(a) == set(b)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def test_save_pretrained_dir_without_torch(models, tmp_path):
    """``save_pretrained`` omits the tied decoder keys; the directory loads without torch."""
    hf = models["mlm"][0]
    hf.save_pretrained(tmp_path / "ckpt", safe_serialization=True)
    ids, types, mask = inputs(9)
    np.save(tmp_path / "inputs.npy", np.stack([ids, types, mask]))
    run_without_torch("""
        assert module.config.head == "mlm", module.config.head
        np.save(sys.argv[3], np.asarray(module.apply({"params": params}, *np.load(sys.argv[2]))))
    """, tmp_path / "ckpt", tmp_path / "inputs.npy", tmp_path / "out.npy")
    np.testing.assert_allclose(np.load(tmp_path / "out.npy"),
                               hf_outputs(hf, "mlm", ids, types, mask)[0].numpy(), rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("head", ["pretraining", "classification"])
def test_save_pretrained_dir_equals_live_model(models, head, tmp_path):
    hf, _, params = models[head]
    hf.save_pretrained(tmp_path / head, safe_serialization=True)
    module, loaded = from_hf(tmp_path / head)
    assert module.config.head == head
    for (path, a), (_, b) in zip(jax.tree_util.tree_leaves_with_path(loaded),
                                 jax.tree_util.tree_leaves_with_path(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))


# ----------------------------------------------------------------------------- parameter counts

@pytest.mark.parametrize("preset", ["tiny", "bert-base", "bert-large"])
def test_parameter_counts_match_hf(preset):
    cfg = BertConfig.preset(preset)
    counts = {}
    with torch.device("meta"):
        for head in HEADS:
            hf = hf_class(head)(hf_config(cfg.replace(head=head)))
            counts[head] = sum(p.numel() for p in hf.parameters())   # tied tensors once
    assert {h: cfg.num_params(head=h) for h in HEADS} == counts
    assert cfg.num_params() == counts["pretraining"]                 # the default head
    if preset == "bert-base":
        assert counts["pretraining"] == 110_106_428 and counts["base"] == 109_482_240
    if preset == "bert-large":
        assert counts["pretraining"] == 336_226_108 and counts["base"] == 335_141_888


# ----------------------------------------------------------------------------- bad input

def test_unknown_missing_and_misshapen_keys_are_named(models):
    hf = models["pretraining"][0]
    sd = state_dict(hf)
    sd["bert.encoder.layer.0.attention.self.rotary.weight"] = torch.zeros(3)
    with pytest.raises(ValueError, match=r"bert\.encoder\.layer\.0\.attention\.self\.rotary\.weight"):
        from_hf_state_dict(hf.config, sd)
    sd = state_dict(hf)
    del sd["bert.encoder.layer.1.intermediate.dense.bias"]
    with pytest.raises(ValueError, match=r"bert\.encoder\.layer\.1\.intermediate\.dense\.bias"):
        from_hf_state_dict(hf.config, sd)
    sd = state_dict(hf)
    sd["bert.encoder.layer.0.attention.self.key.weight"] = torch.zeros(32, 31)
    with pytest.raises(ValueError, match=r"key\.weight.*\(32, 31\).*\(32, 32\)"):
        from_hf_state_dict(hf.config, sd)


def test_untied_decoder_raises(models):
    hf = models["mlm"][0]
    sd = state_dict(hf)
    sd["cls.predictions.decoder.weight"] = sd["cls.predictions.decoder.weight"].clone() + 1
    with pytest.raises(ValueError, match="cls.predictions.decoder.weight.*untied"):
        from_hf_state_dict(hf.config, sd)
    with pytest.raises(ValueError, match="tie_word_embeddings=False"):
        from_hf_state_dict({**hf.config.to_dict(), "tie_word_embeddings": False}, state_dict(hf))


def test_legacy_buffers_are_checked_and_dropped(models):
    hf, _, params = models["base"]
    sd = state_dict(hf)
    sd["embeddings.position_ids"] = torch.arange(40)[None]
    sd["embeddings.token_type_ids"] = torch.zeros(1, 40, dtype=torch.long)
    _, loaded = from_hf_state_dict(hf.config, sd)
    np.testing.assert_array_equal(np.asarray(loaded["bert"]["pooler"]["kernel"]),
                                  np.asarray(params["bert"]["pooler"]["kernel"]))
    sd["embeddings.position_ids"] = torch.arange(40)[None].flip(1)
    with pytest.raises(ValueError, match=r"embeddings\.position_ids.*arange\(40\)"):
        from_hf_state_dict(hf.config, sd)


@pytest.mark.parametrize("cls_name", ["BertForTokenClassification", "BertForQuestionAnswering",
                                      "BertForNextSentencePrediction"])
def test_unsupported_heads_raise(cls_name):
    torch.manual_seed(0)
    model = getattr(transformers, cls_name)(transformers.BertConfig(**BERT_TINY))
    config = {**model.config.to_dict(), "architectures": None}     # detection by keys alone
    with pytest.raises(ValueError, match="unsupported BERT head.*BertForMaskedLM"):
        from_hf_state_dict(config, state_dict(model))
    with pytest.raises(ValueError, match=f"unsupported BERT architecture '{cls_name}'"):
        from_hf_state_dict({**config, "architectures": [cls_name]}, state_dict(model))


@pytest.mark.parametrize("option, value", [("is_decoder", True), ("add_cross_attention", True),
                                           ("position_embedding_type", "relative_key"),
                                           ("hidden_act", "mish")])
def test_unsupported_config_option_raises(models, option, value):
    hf = models["pretraining"][0]
    with pytest.raises(ValueError, match=option):
        from_hf_state_dict({**hf.config.to_dict(), option: value}, state_dict(hf))
