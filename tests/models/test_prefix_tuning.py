"""Prefix tuning (``GPTConfig.prefix_tokens``) against PEFT's ``PrefixTuningConfig``
(``task_type="CAUSAL_LM"``, ``prefix_projection=False``) on a random tiny HF GPT-2 and
Llama, given the same prefix tensors: logits, the prefix's gradient, greedy decoding
through our KV cache, and the adapter files of ``interop.peft.prefix``.

What PEFT + transformers do (read from their source, checked here): the prefix is a
length-P ``past_key_values``, so the real tokens are numbered from P (HF's forward: P +
arange(T) whatever the padding; given position ids and ``generate``'s real-token counts get
+ P), the prefix is visible to every query, and its keys are used as stored (not rotated
by Llama's RoPE). The model-only tests (P = 0, layouts, implementations, the decoder) run
without torch.
"""
import copy
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from transformer_jax.decode import generate
from transformer_jax.errors import UserError
from transformer_jax.interop.peft.prefix import (prefix_embeddings, prefix_from_peft,
                                                 prefix_to_peft, with_prefix_embeddings,
                                                 without_prefix)
from transformer_jax.layers.stack import convert_layout
from transformer_jax.models.base import RelationError
from transformer_jax.models.gpt import GPT, GPTConfig, init_params

P = 3
TOL = dict(rtol=1e-5, atol=1e-5)


def tiny(**overrides) -> GPTConfig:
    return GPTConfig.preset("tiny", **{"dropout_rate": 0.0, "attention_dropout_rate": 0.0,
                                       "prefix_tokens": P, **overrides})


def padded_batch(seed: int, vocab: int, t: int = 10):
    """(3, t) ids and a mask: row 0 full, row 1 right-padded, row 2 left-padded."""
    ids = np.random.default_rng(seed).integers(0, vocab, (3, t)).astype(np.int32)
    mask = np.ones((3, t), np.int32)
    mask[1, t - 3:] = 0
    mask[2, :4] = 0
    return ids, mask


def logits(module, params, ids, mask=None, positions=None) -> np.ndarray:
    return np.asarray(module.apply({"params": params}, jnp.asarray(ids), attention_mask=mask,
                                   position_ids=positions))


def recompute_greedy(module, params, ids, mask, n: int) -> np.ndarray:
    """Greedy decoding by a full forward pass per token over (B, T0 + n) (the future is
    right padding, which causality hides), positions counting real tokens as
    ``decode.generate`` does."""
    b, t0 = ids.shape
    cur = np.concatenate([ids, np.zeros((b, n), np.int32)], axis=1)
    m = np.concatenate([mask, np.zeros((b, n), np.int32)], axis=1)
    fwd = jax.jit(lambda p, x, m, pos: module.apply({"params": p}, x, attention_mask=m,
                                                    position_ids=pos))
    for i in range(n):
        pos = np.maximum(np.cumsum(m, axis=1) - 1, 0)
        cur[:, t0 + i] = np.asarray(fwd(params, cur, m, pos))[:, t0 + i - 1].argmax(-1)
        m[:, t0 + i] = 1
    return cur


def left_padded(prompts, pad: int = 0):
    t0 = max(map(len, prompts))
    ids = np.full((len(prompts), t0), pad, np.int32)
    mask = np.zeros((len(prompts), t0), np.int32)
    for i, p in enumerate(prompts):
        ids[i, t0 - len(p):], mask[i, t0 - len(p):] = p, 1
    return ids, mask


# ----------------------------------------------------------------------------- the model alone

def zeros_like_params(module):
    shapes = jax.eval_shape(lambda: init_params(module, jax.random.PRNGKey(0), seq_len=4))
    return jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)


def test_parameters_and_limits():
    for cfg, kv in ((tiny(), 4), (tiny(num_kv_heads=2), 2)):
        params = zeros_like_params(GPT(cfg))
        for i in range(cfg.num_layers):
            attn = params[f"h_{i}"]["self_attn"]
            assert attn["prefix_key"].shape == attn["prefix_value"].shape == (P, kv, 16)
    with pytest.raises(RelationError, match="prefix_tokens=128"):
        tiny(prefix_tokens=128)
    module = GPT(tiny(max_len=12))
    params = zeros_like_params(module)
    with pytest.raises(UserError, match="length 10 exceeds the model's max_len=12 less its "
                                        "prefix_tokens=3"):
        logits(module, params, np.zeros((1, 10), np.int32))
    with pytest.raises(UserError, match="length 10 exceeds"):       # the KV cache, at creation
        generate(module, params, np.zeros((1, 4), np.int32), max_new_tokens=6)
    with pytest.raises(UserError, match=r"position_ids \+ prefix_tokens\[0, 1\] = 12"):
        logits(module, params, np.zeros((1, 2), np.int32), positions=np.array([[8, 9]]))


def test_zero_prefix_is_the_old_model():
    cfg = GPTConfig.preset("tiny", dropout_rate=0.0)
    assert cfg.prefix_tokens == 0
    old, new = GPT(cfg), GPT(dataclasses.replace(cfg, prefix_tokens=0))
    a, b = (init_params(m, jax.random.PRNGKey(1)) for m in (old, new))
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    assert not any("prefix" in jax.tree_util.keystr(k)
                   for k, _ in jax.tree_util.tree_leaves_with_path(b))
    jax.tree_util.tree_map(np.testing.assert_array_equal, a, b)
    ids, mask = padded_batch(0, cfg.vocab_size)
    np.testing.assert_array_equal(logits(old, a, ids, mask), logits(new, b, ids, mask))


def test_scanned_equals_unrolled():
    cfg = tiny()
    module, scanned = GPT(cfg), GPT(dataclasses.replace(cfg, scan_layers=True))
    params = init_params(module, jax.random.PRNGKey(2))
    assert 0.8 < np.std(prefix_embeddings(module, params)) < 1.2       # N(0, 1), as PEFT
    stacked = convert_layout(params, cfg.layer_stacks, scanned=True)
    assert stacked["h"]["self_attn"]["prefix_key"].shape == (2, P, 4, 16)
    ids, mask = padded_batch(1, cfg.vocab_size)

    def loss(m):
        def fn(p):
            out = m.apply({"params": p}, ids, attention_mask=mask)
            return jnp.sum(out[:, :, :8] ** 2), out
        return jax.value_and_grad(fn, has_aux=True)

    (_, out), g = loss(module)(params)
    (_, out_scanned), g_scanned = loss(scanned)(stacked)
    np.testing.assert_allclose(out_scanned, out, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(prefix_embeddings(scanned, g_scanned), prefix_embeddings(module, g),
                               rtol=1e-5, atol=1e-6)
    # the PEFT layout reads and writes both parameter layouts
    emb = prefix_embeddings(module, params)
    np.testing.assert_array_equal(prefix_embeddings(scanned, stacked), emb)
    again = with_prefix_embeddings(scanned, stacked, emb * 2)
    np.testing.assert_array_equal(prefix_embeddings(scanned, again), emb * 2)


def test_scanned_rope_decode_equals_full_forward():
    """The KV cache with a leading layer axis, rotary positions and grouped-query heads
    (the GPT-2 layout is checked against PEFT below)."""
    cfg = tiny(scan_layers=True, position="rope", num_kv_heads=2, norm="rmsnorm")
    module = GPT(cfg)
    params = init_params(module, jax.random.PRNGKey(3))
    rng = np.random.default_rng(4)
    prompts = [rng.integers(0, cfg.vocab_size, n).tolist() for n in (7, 3, 5)]
    ids, mask = left_padded(prompts)
    ours = np.asarray(generate(module, params, ids, prompt_mask=mask, max_new_tokens=6))
    np.testing.assert_array_equal(ours, recompute_greedy(module, params, ids, mask, 6))


def test_attention_implementations_agree():
    ids, mask = padded_batch(5, 512)
    results = {}
    for impl in ("xla", "chunked", "jax", "pallas"):
        module = GPT(tiny(attention_impl=impl))
        params = init_params(GPT(tiny()), jax.random.PRNGKey(6))
        results[impl] = logits(module, params, ids, mask)
    for impl in ("chunked", "jax", "pallas"):
        np.testing.assert_allclose(results[impl], results["xla"], rtol=2e-5, atol=2e-5,
                                   err_msg=impl)


# ----------------------------------------------------------------------------- PEFT

@pytest.fixture(scope="module")
def hf():
    """The HF GPT-2 base, our conversion of it, PEFT's prefix-tuned wrapper of it with a
    random N(0, 1) prefix, and our prefix model and parameters holding the same prefix."""
    from tests.interop.conftest import gpt2_model, torch
    peft = pytest.importorskip("peft")
    from transformer_jax.interop import from_hf

    base = gpt2_model()
    module, params = from_hf(base)
    prefixed, ours, emb = prefixed_pair(peft, torch, base, module, seed=7)
    return dict(base=base, module=module, params=params, peft=prefixed, ours=ours,
                our_params=with_prefix_embeddings(ours, params, emb), emb=emb, torch=torch)


def prefixed_pair(peft, torch, base, module, seed: int):
    """PEFT's prefix-tuned wrapper of the HF ``base`` with a random N(0, 1) prefix (torch
    seed ``seed``), in eval mode; our prefix model of ``module``'s config; the prefix
    embedding (P, L * 2 * K * H) as numpy."""
    prefixed = peft.get_peft_model(
        copy.deepcopy(base), peft.PrefixTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=P))
    torch.manual_seed(seed)
    with torch.no_grad():
        prefixed.prompt_encoder["default"].embedding.weight.normal_()
    prefixed.eval()
    ours = GPT(dataclasses.replace(module.config, prefix_tokens=P))
    emb = prefixed.prompt_encoder["default"].embedding.weight.detach().numpy().copy()
    return prefixed, ours, emb


def peft_logits(hf, model, ids, mask=None, positions=None) -> np.ndarray:
    torch = hf["torch"]

    def as_t(x):
        return None if x is None else torch.as_tensor(np.asarray(x), dtype=torch.long)

    with torch.no_grad():
        return model(input_ids=as_t(ids), attention_mask=as_t(mask),
                     position_ids=as_t(positions)).logits.numpy()


def peft_generate(hf, model, ids, mask, n: int) -> np.ndarray:
    """PEFT's greedy ``generate``. PEFT 0.21 looks for the cache under ``past_key_values``;
    transformers 5 passes it as ``cache`` (and prefers it when both are given), so PEFT
    would inject its prefix cache where the model never reads it and generate without the
    prefix. Renaming the key for PEFT restores its intended behaviour (prefix cache at the
    prefill, positions P + real-token count)."""
    torch = hf["torch"]
    inner = model.base_model_prepare_inputs_for_generation

    def prepare(*args, **kwargs):
        out = inner(*args, **kwargs)
        if "cache" in out and "past_key_values" not in out:
            out["past_key_values"] = out.pop("cache")
        return out

    model.base_model_prepare_inputs_for_generation = prepare
    try:
        with torch.no_grad():
            return model.generate(input_ids=torch.as_tensor(ids, dtype=torch.long),
                                  attention_mask=torch.as_tensor(mask, dtype=torch.long),
                                  max_new_tokens=n, do_sample=False, pad_token_id=0).numpy()
    finally:
        model.base_model_prepare_inputs_for_generation = inner


@pytest.mark.parametrize("positions", ["default", "given"])
def test_logits_match_peft(hf, positions):
    ids, mask = padded_batch(8, 101)
    pos = None if positions == "default" else np.maximum(np.cumsum(mask, axis=1) - 1, 0)
    ours = logits(hf["ours"], hf["our_params"], ids, mask, pos)
    theirs = peft_logits(hf, hf["peft"], ids, mask, pos)
    # every row, padding too: the prefix leaves no query without keys
    np.testing.assert_allclose(ours, theirs, **TOL)


def test_zero_prefix_matches_the_hf_base(hf):
    ids, mask = padded_batch(9, 101)
    zero = GPT(dataclasses.replace(hf["module"].config, prefix_tokens=0))
    valid = mask.astype(bool)
    np.testing.assert_allclose(logits(zero, hf["params"], ids, mask)[valid],
                               peft_logits(hf, hf["base"], ids, mask)[valid], **TOL)


def test_prefix_gradient_matches_peft(hf):
    torch = hf["torch"]
    ids, mask = padded_batch(10, 101)
    labels = np.random.default_rng(11).integers(0, 101, ids.shape)
    valid = mask.astype(bool)

    def loss_fn(p):
        out = hf["ours"].apply({"params": p}, ids, attention_mask=mask)
        nll = -jnp.take_along_axis(jax.nn.log_softmax(out), labels[..., None], -1)[..., 0]
        return jnp.sum(nll * valid) / valid.sum()

    loss, grads = jax.value_and_grad(loss_fn)(hf["our_params"])
    model, weight = hf["peft"], hf["peft"].prompt_encoder["default"].embedding.weight
    weight.grad = None
    out = model(input_ids=torch.as_tensor(ids, dtype=torch.long),
                attention_mask=torch.as_tensor(mask)).logits
    ref = torch.nn.functional.cross_entropy(out[torch.as_tensor(valid)],
                                            torch.as_tensor(labels[valid], dtype=torch.long))
    ref.backward()
    np.testing.assert_allclose(float(loss), ref.item(), rtol=1e-6)
    theirs = weight.grad.numpy()
    weight.grad = None
    assert np.abs(theirs).max() > 1e-3
    np.testing.assert_allclose(prefix_embeddings(hf["ours"], grads), theirs, rtol=1e-4,
                               atol=1e-4 * np.abs(theirs).max())


def test_greedy_generate_matches_peft(hf):
    rng = np.random.default_rng(12)
    prompts = [rng.integers(0, 101, n).tolist() for n in (8, 3, 6)]
    ids, mask = left_padded(prompts)
    n = 8
    ours = np.asarray(generate(hf["ours"], hf["our_params"], ids, prompt_mask=mask,
                               max_new_tokens=n))
    np.testing.assert_array_equal(ours, peft_generate(hf, hf["peft"], ids, mask, n))
    np.testing.assert_array_equal(ours, recompute_greedy(hf["ours"], hf["our_params"], ids,
                                                         mask, n))


def test_adapter_files(hf, tmp_path):
    peft = pytest.importorskip("peft")
    ours, emb = hf["ours"], hf["emb"]
    # PEFT's files -> our parameters (onto the converted base, which has no prefix)
    hf["peft"].save_pretrained(tmp_path / "theirs")
    loaded = prefix_from_peft(ours, hf["params"], str(tmp_path / "theirs"))
    np.testing.assert_array_equal(prefix_embeddings(ours, loaded), emb)
    # our parameters -> files that PEFT loads; the round trip is exact
    prefix_to_peft(ours, hf["our_params"], str(tmp_path / "ours"))
    np.testing.assert_array_equal(
        prefix_embeddings(ours, prefix_from_peft(ours, hf["params"], str(tmp_path / "ours"))), emb)
    reloaded = peft.PeftModel.from_pretrained(copy.deepcopy(hf["base"]), str(tmp_path / "ours"))
    ids, mask = padded_batch(13, 101)
    np.testing.assert_allclose(logits(ours, loaded, ids, mask),
                               peft_logits(hf, reloaded.eval(), ids, mask), **TOL)
    # the scanned layout writes the same files
    scanned = GPT(dataclasses.replace(ours.config, scan_layers=True))
    prefix_to_peft(scanned, convert_layout(hf["our_params"], ours.config.layer_stacks,
                                           scanned=True), str(tmp_path / "scanned"))
    assert ((tmp_path / "scanned" / "adapter_model.safetensors").read_bytes()
            == (tmp_path / "ours" / "adapter_model.safetensors").read_bytes())
    with pytest.raises(UserError, match="num_virtual_tokens=3 \\(the model: 5\\)"):
        prefix_from_peft(GPT(dataclasses.replace(ours.config, prefix_tokens=5)), hf["params"],
                         str(tmp_path / "ours"))
    with pytest.raises(UserError, match="prefix_tokens > 0"):
        prefix_to_peft(hf["module"], hf["params"], str(tmp_path / "none"))
    with pytest.raises(UserError, match="needs a model with prefix_tokens=3"):
        prefix_from_peft(hf["module"], hf["params"], str(tmp_path / "ours"))
    # the base goes back to HF without the prefix
    from transformer_jax.interop import to_hf
    base = hf["base"].state_dict()
    for key, value in to_hf(hf["module"], without_prefix(loaded)).items():
        np.testing.assert_array_equal(value.numpy(), base[key].numpy(), err_msg=key)


def test_llama_rope_gqa_matches_peft(hf):
    """RoPE and grouped-query heads: PEFT provisions K = num_key_value_heads prefix heads,
    uses the prefix keys unrotated and rotates the real tokens at P + position."""
    peft = pytest.importorskip("peft")
    from tests.interop.conftest import perturbed, transformers
    from transformer_jax.interop import from_hf

    torch = hf["torch"]
    config = transformers.LlamaConfig(
        vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    base = perturbed(lambda: transformers.LlamaForCausalLM(config))
    module, params = from_hf(base)
    model, ours, emb = prefixed_pair(peft, torch, base, module, seed=14)
    assert emb.shape == (P, 2 * 2 * 2 * 16)
    our_params = with_prefix_embeddings(ours, params, emb)
    ids, mask = padded_batch(15, 97)
    np.testing.assert_allclose(logits(ours, our_params, ids, mask),
                               peft_logits(hf, model, ids, mask), **TOL)
    prompts = [ids[0, :7].tolist(), ids[1, :4].tolist()]
    ids, mask = left_padded(prompts)
    np.testing.assert_array_equal(
        np.asarray(generate(ours, our_params, ids, prompt_mask=mask, max_new_tokens=6)),
        peft_generate(hf, model, ids, mask, 6))
