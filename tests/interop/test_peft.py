"""LoRA adapters <-> Hugging Face PEFT (``interop.peft``), checked against ``peft`` itself.

For each family (GPT-2, BERT, T5, ViT, CLIP, and Llama where its converter exists), one tiny
random HF base model and one PEFT adapter with non-zero random A and B (``get_peft_model``
then ``save_pretrained``), fp32 on both sides:

  * PEFT -> ours (``from_hf(base_dir, adapter=dir)``): logits, and the gradients of a loss
    (``sum(logits * W)``, W fixed random) w.r.t. the adapters only, mapped site by site
    (GPT-2's packed ``c_attn``: PEFT's grad of A is the sum of our query/key/value
    ``lora_a`` grads, B's row chunks are their ``lora_b`` grads);
  * ours -> PEFT: our random adapters -> ``to_peft`` -> ``PeftModel.from_pretrained``, which
    finds exactly the adapter keys it expects; logits;
  * merge: ``lora.merge`` + ``to_hf`` equals PEFT's ``merge_and_unload()`` state dict.

Plus the scanned layout, LoRA dropout, SEQ_CLS heads (``modules_to_save``), rank patterns,
and the errors ``load_peft`` raises.
"""
import copy
import dataclasses
import importlib.util
import json
import os
import shutil
import warnings
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util

from transformer_jax.errors import UserError
from transformer_jax.interop import from_hf, load_peft, to_hf, to_peft
from transformer_jax.interop.common import flatten_params
from transformer_jax.interop.peft import KEY_PREFIX, lora_sites, read_adapter
from transformer_jax.layers import lora as lora_lib

from .conftest import (GPT2_TINY, T5_TINY, VIT_TINY, bert_model, clip_model, gpt2_model, perturbed,
                       t5_model, torch, transformers, vit_model)
from .test_hf_gemma import gemma_model

peft = pytest.importorskip("peft")
from peft.utils import get_peft_model_state_dict  # noqa: E402

HAVE_LLAMA = importlib.util.find_spec("transformer_jax.interop.hf.llama") is not None

LOGIT_ATOL = 1e-5      # max abs, logits
GRAD_ATOL = 1e-4       # max abs, adapter gradients
RANK, ALPHA = 4, 8


# ----------------------------------------------------------------------------- families

@dataclasses.dataclass
class Family:
    name: str
    build: Callable[[], Any]            # the random HF base model (eval mode)
    targets: list[str]                  # PEFT target_modules
    inputs: Callable[[], tuple]         # numpy inputs
    hf_forward: Callable[..., Any]      # (hf model, *inputs) -> logits tensor
    our_inputs: Callable[..., tuple]    # numpy inputs -> our apply's positional args
    our_output: Callable[[Any], Any] = lambda out: out     # our apply's output -> the logits


def _ids(seed, shape, vocab):
    return np.random.default_rng(seed).integers(0, vocab, shape).astype(np.int32)


def _long(x):
    return torch.as_tensor(np.asarray(x), dtype=torch.long)


LLAMA_TINY = dict(vocab_size=61, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                  rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=None,
                  eos_token_id=None, pad_token_id=None)

FAMILIES = {
    "gpt2": Family(
        "gpt2", gpt2_model, ["c_attn", "c_proj"],
        lambda: (_ids(0, (2, 9), GPT2_TINY["vocab_size"]),),
        lambda m, ids: m(_long(ids)).logits, lambda ids: (ids,)),
    "bert": Family(
        "bert", lambda: bert_model("mlm"), ["query", "value", "attention.output.dense"],
        lambda: (_ids(1, (2, 7), 99),),
        lambda m, ids: m(input_ids=_long(ids)).logits, lambda ids: (ids,)),
    "t5": Family(
        "t5", t5_model, ["q", "v", "o", "wi"],
        lambda: (_ids(2, (2, 7), T5_TINY["vocab_size"]), _ids(3, (2, 5), T5_TINY["vocab_size"])),
        lambda m, ids, dec: m(input_ids=_long(ids), decoder_input_ids=_long(dec)).logits,
        lambda ids, dec: (ids, dec)),
    "vit": Family(
        "vit", vit_model, ["q_proj", "v_proj", "fc2"],
        lambda: (np.random.default_rng(4).normal(size=(2, VIT_TINY["num_channels"], 16, 16))
                 .astype(np.float32),),
        lambda m, px: m(torch.from_numpy(px)).logits,
        lambda px: (np.ascontiguousarray(px.transpose(0, 2, 3, 1)),)),
    # both towers' q_proj, v_proj and fc2, and one projection (a bias-free nn.Linear)
    "clip": Family(
        "clip", clip_model, ["q_proj", "v_proj", "fc2", "text_projection"],
        lambda: (np.concatenate([_ids(6, (2, 8), 98), np.full((2, 1), 98)], axis=1),
                 np.random.default_rng(7).normal(size=(2, 3, 16, 16)).astype(np.float32)),
        lambda m, ids, px: m(input_ids=_long(ids), pixel_values=torch.from_numpy(px)).logits_per_image,
        lambda ids, px: (ids, np.ascontiguousarray(px.transpose(0, 2, 3, 1))),
        lambda out: out["logits_per_image"]),
}
FAMILIES["gemma"] = Family(          # Gemma 3: q/k norms, local and global layers
    "gemma", lambda: gemma_model(seed=0),
    ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    lambda: (_ids(8, (2, 12), 101),),
    lambda m, ids: m(_long(ids)).logits, lambda ids: (ids,))
if HAVE_LLAMA:
    FAMILIES["llama"] = Family(
        "llama", lambda: perturbed(lambda: transformers.LlamaForCausalLM(
            transformers.LlamaConfig(**LLAMA_TINY))),
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "down_proj"],
        lambda: (_ids(5, (2, 9), LLAMA_TINY["vocab_size"]),),
        lambda m, ids: m(_long(ids)).logits, lambda ids: (ids,))
    # Qwen 2.5 (q/k/v projections with biases) and Qwen 3 (q/k norms, head size 16 != D / N)
    for _name, _cls, _extra in (
            ("qwen2", "Qwen2", dict(tie_word_embeddings=True)),
            ("qwen3", "Qwen3", dict(head_dim=16, rope_parameters={
                "rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 4}))):
        FAMILIES[_name] = Family(
            _name, lambda c=_cls, e=_extra: perturbed(lambda: getattr(
                transformers, f"{c}ForCausalLM")(getattr(transformers, f"{c}Config")(
                    **{**LLAMA_TINY, **e}))),
            ["q_proj", "k_proj", "v_proj", "o_proj", "up_proj"],
            lambda: (_ids(8, (2, 9), LLAMA_TINY["vocab_size"]),),
            lambda m, ids: m(_long(ids)).logits, lambda ids: (ids,))


def randomize_lora(peft_model, seed=0, scale=0.1):
    """Every LoRA tensor of a PEFT model to ``scale * N(0, 1)`` (B non-zero)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if ".lora_" in name:
                p.copy_(scale * torch.randn(p.shape, generator=gen))
    return peft_model


def peft_model_for(base, targets, **kwargs):
    """``get_peft_model`` on a copy of ``base`` (PEFT edits the model in place)."""
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=targets,
                             init_lora_weights=False, **kwargs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return randomize_lora(peft.get_peft_model(copy.deepcopy(base), config)).eval()


def peft_from_pretrained(base, adapter_dir):
    """``PeftModel.from_pretrained`` on a copy of ``base``, asserting that every adapter key
    it expects is in the file and nothing else is (no missing, no unexpected keys)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = peft.PeftModel.from_pretrained(copy.deepcopy(base), adapter_dir).eval()
    assert not [w for w in caught if "missing" in str(w.message).lower()
                or "unexpected" in str(w.message).lower()], [str(w.message) for w in caught]
    _, saved = read_adapter(adapter_dir)
    assert sorted(get_peft_model_state_dict(model)) == sorted(saved)
    return model


def max_abs(a, b) -> float:
    a, b = np.asarray(a), np.asarray(b)
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.abs(a - b).max())


def split_adapters(params):
    flat = traverse_util.flatten_dict(params)
    adapters = {k: v for k, v in flat.items() if k[-1] in lora_lib.ADAPTER_NAMES}
    frozen = {k: v for k, v in flat.items() if k[-1] not in lora_lib.ADAPTER_NAMES}
    return adapters, frozen


def our_forward(module, output=lambda out: out):
    """Jitted ``(adapters, frozen, w, *inputs) -> (grads, logits)``: the logits (``output``
    of what apply returns) and the gradient of ``sum(logits * w)`` w.r.t. the adapters only
    (one compile per module)."""
    def loss(adapters, frozen, w, *args):
        params = traverse_util.unflatten_dict({**frozen, **adapters})
        logits = output(module.apply({"params": params}, *args))
        return jnp.sum(logits * w), logits
    return jax.jit(jax.grad(loss, has_aux=True))


def loss_weights(shape, seed=7):
    return np.random.default_rng(seed).normal(size=shape).astype(np.float32)


def random_adapters(adapters, seed):
    """New random values for every adapter leaf (each lora_a its own: packed sites differ)."""
    rng = np.random.default_rng(seed)
    return {k: jnp.asarray(0.1 * rng.normal(size=v.shape), v.dtype) for k, v in adapters.items()}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("peft")


# ----------------------------------------------------------------------------- parity

@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_parity(name, workdir):
    """One test per family (its setup is built once, whichever xdist worker runs it)."""
    spec = FAMILIES[name]
    base = spec.build()
    base_dir = str(workdir / f"{name}_base")
    base.save_pretrained(base_dir)
    inputs = spec.inputs()
    model = peft_model_for(base, spec.targets)
    adapter_dir = str(workdir / f"{name}_adapter")
    model.save_pretrained(adapter_dir)
    out = spec.hf_forward(model, *inputs)
    w = loss_weights(tuple(out.shape))
    (out * torch.from_numpy(w)).sum().backward()
    hf_logits = out.detach().numpy()
    hf_grads = {n.replace(".default", ""): p.grad.numpy()
                for n, p in model.named_parameters() if ".lora_" in n}
    with torch.no_grad():
        plain = spec.hf_forward(base, *inputs).numpy()
    assert max_abs(plain, hf_logits) > 1e-2                  # the adapter changes the outputs

    # PEFT -> ours: config, logits, gradients w.r.t. the adapters
    module, params = from_hf(base_dir, adapter=adapter_dir)
    lora = module.config.lora
    assert (lora.rank, lora.alpha, lora.dropout, lora.use_rslora) == (RANK, ALPHA, 0.0, False)
    sites = lora_sites(module.config)
    adapted = {p[:-1] for p in flatten_params(params) if p[-1] == "lora_a"}
    assert adapted == {path for site in sites for path in site.paths
                       if any(site.module == t or site.module.endswith("." + t)
                              for t in spec.targets)}
    assert all(lora.matches("/".join(p)) for p in adapted)
    adapters, frozen = split_adapters(params)
    args = tuple(jnp.asarray(x) for x in spec.our_inputs(*inputs))
    forward = our_forward(module, spec.our_output)
    grads, logits = forward(adapters, frozen, jnp.asarray(w), *args)
    err_logits = max_abs(logits, hf_logits)
    worst, checked = 0.0, 0
    for site in sites:
        key = f"{KEY_PREFIX}{site.module}"
        if key + ".lora_A.weight" not in hf_grads:
            continue
        # a packed site (c_attn) shares A: its grad is the sum of our lora_a grads
        ga = sum(np.asarray(grads[p + ("lora_a",)]).reshape(-1, RANK).T for p in site.paths)
        gb = np.concatenate([np.asarray(grads[p + ("lora_b",)]).reshape(RANK, -1).T
                             for p in site.paths])
        ref_a, ref_b = hf_grads[key + ".lora_A.weight"], hf_grads[key + ".lora_B.weight"]
        assert np.abs(ref_a).max() > 1e-3 and np.abs(ref_b).max() > 1e-3, key   # not vacuous
        worst = max(worst, max_abs(ga, ref_a), max_abs(gb, ref_b))
        checked += 1
    assert checked * 2 == len(hf_grads)

    # merge: lora.merge + to_hf == PEFT's merge_and_unload
    merged = lora_lib.merge(params, lora)
    assert not any(p[-1] in lora_lib.ADAPTER_NAMES for p in flatten_params(merged))
    ours_sd = {k: v.numpy() for k, v in to_hf(module, merged).items()}
    theirs_sd = {k: v.numpy() for k, v in model.merge_and_unload().state_dict().items()}
    assert set(ours_sd) == set(theirs_sd)
    err_merge = max(max_abs(ours_sd[k], theirs_sd[k]) for k in ours_sd)

    # ours -> PEFT: other random adapters (each lora_a its own)
    adapters2 = random_adapters(adapters, seed=11)
    out_dir = str(workdir / f"{name}_ours")
    to_peft(module, traverse_util.unflatten_dict({**frozen, **adapters2}), out_dir,
            base_model_name_or_path=base_dir)
    assert read_adapter(out_dir)[0]["base_model_name_or_path"] == base_dir
    reloaded = peft_from_pretrained(base, out_dir)
    with torch.no_grad():
        theirs = spec.hf_forward(reloaded, *inputs).numpy()
    _, ours = forward(adapters2, frozen, jnp.asarray(w), *args)
    assert max_abs(ours, hf_logits) > 1e-2                   # not the loaded adapter
    err_back = max_abs(ours, theirs)
    print(f"{name}: PEFT->ours logits {err_logits:.2e}, adapter grads {worst:.2e} "
          f"({checked} sites, max |grad| {max(np.abs(g).max() for g in hf_grads.values()):.2g}); "
          f"merge {err_merge:.2e}; ours->PEFT logits {err_back:.2e}")
    assert err_logits <= LOGIT_ATOL
    assert worst <= GRAD_ATOL
    assert err_merge <= 1e-5
    assert err_back <= LOGIT_ATOL


# ----------------------------------------------------------------------------- GPT-2 specifics

class Setup:
    """What a module-scoped fixture shares with its tests."""


@pytest.fixture(scope="module")
def gpt2(workdir):
    """A GPT-2 base, a PEFT adapter on c_attn and c_fc with lora_dropout 0.1, and the
    adapted module (model dropout off, so that only LoRA's dropout acts in training)."""
    spec = FAMILIES["gpt2"]
    s = Setup()
    s.base = spec.build()
    s.base_dir = str(workdir / "gpt2_only_base")
    s.base.save_pretrained(s.base_dir)
    model = peft_model_for(s.base, ["c_attn", "c_fc"], lora_dropout=0.1)
    s.adapter_dir = str(workdir / "gpt2_only_adapter")
    model.save_pretrained(s.adapter_dir)
    s.ids = spec.inputs()[0]
    with torch.no_grad():
        s.hf_logits = spec.hf_forward(model, s.ids).numpy()
        s.plain = spec.hf_forward(s.base, s.ids).numpy()
    s.overrides = dict(dropout_rate=0.0, attention_dropout_rate=0.0)
    s.module, s.params = from_hf(s.base_dir, adapter=s.adapter_dir, **s.overrides)
    s.adapters, s.frozen = split_adapters(s.params)
    s.w = jnp.asarray(loss_weights(s.hf_logits.shape))
    s.forward = our_forward(s.module)
    return s


def test_gpt2_packed_c_attn_round_trip(gpt2, workdir):
    """PEFT's rank-r c_attn loads as one shared lora_a on query/key/value, and goes back
    as the same rank-r tensors (no rank pattern)."""
    h0 = gpt2.params["h_0"]["self_attn"]
    np.testing.assert_array_equal(h0["query"]["lora_a"], h0["key"]["lora_a"])
    np.testing.assert_array_equal(h0["query"]["lora_a"], h0["value"]["lora_a"])
    out = str(workdir / "gpt2_round_trip")
    to_peft(gpt2.module, gpt2.params, out)
    config, tensors = read_adapter(out)
    original_config, original = read_adapter(gpt2.adapter_dir)
    assert sorted(tensors) == sorted(original)
    for k in tensors:
        np.testing.assert_array_equal(tensors[k], original[k])
    assert (config["r"], config["lora_alpha"], config["rank_pattern"], config["fan_in_fan_out"],
            config["task_type"], config["lora_dropout"]) == (RANK, ALPHA, {}, True, "CAUSAL_LM", 0.1)
    assert sorted(config["target_modules"]) == sorted(original_config["target_modules"])


def test_gpt2_partial_targets_write_rank_patterns(gpt2, workdir):
    """Our own config (query and value only, each its own lora_a; plus mlp/wo): c_attn is
    written at rank 2r (A stacked, B block-diagonal with a zero key block) through
    rank_pattern/alpha_pattern; PEFT reproduces our logits; reloading pads mlp/wo."""
    module, params = from_hf(gpt2.base_dir, lora=dict(rank=RANK, alpha=ALPHA,
                                                       targets="attn/(query|value)|mlp/wo"),
                             **gpt2.overrides)
    adapters, frozen = split_adapters(params)
    assert {k[-2] for k in adapters} == {"query", "value", "wo"}
    assert all(not np.asarray(v).any() for k, v in adapters.items() if k[-1] == "lora_b")
    params = traverse_util.unflatten_dict({**frozen, **random_adapters(adapters, seed=3)})
    out = str(workdir / "gpt2_partial")
    to_peft(module, params, out)
    config, tensors = read_adapter(out)
    assert config["target_modules"] == ["c_attn", "mlp.c_proj"]
    assert config["r"] == 2 * RANK and config["lora_alpha"] == 2 * ALPHA
    assert config["rank_pattern"] == {"c_proj": RANK} and config["alpha_pattern"] == {"c_proj": ALPHA}
    b = tensors[KEY_PREFIX + "transformer.h.0.attn.c_attn.lora_B.weight"]
    d = GPT2_TINY["n_embd"]
    assert b.shape == (3 * d, 2 * RANK) and not b[d:2 * d].any()       # key rows: zero
    assert not b[:d, RANK:].any() and not b[2 * d:, :RANK].any()       # block-diagonal
    model = peft_from_pretrained(gpt2.base, out)
    with torch.no_grad():
        theirs = FAMILIES["gpt2"].hf_forward(model, gpt2.ids).numpy()
    ids = jnp.asarray(gpt2.ids)
    ours = np.asarray(jax.jit(module.apply)({"params": params}, ids))
    assert max_abs(ours, gpt2.plain) > 1e-2
    assert max_abs(ours, theirs) <= LOGIT_ATOL
    # loading it back: rank 2r, mlp/wo zero-padded with its scale folded into B
    module2, params2 = load_peft(module, params, out)
    assert module2.config.lora.rank == 2 * RANK and module2.config.lora.alpha == 2 * ALPHA
    assert module2.config.lora.scaling == module.config.lora.scaling
    wo = params2["h_0"]["mlp"]["wo"]
    assert wo["lora_a"].shape[-1] == 2 * RANK and not np.asarray(wo["lora_b"])[RANK:].any()
    again = np.asarray(jax.jit(module2.apply)({"params": params2}, ids))
    assert max_abs(again, ours) <= LOGIT_ATOL


def test_gpt2_scanned_equals_unrolled(gpt2, workdir):
    scanned, p_scanned = from_hf(gpt2.base_dir, adapter=gpt2.adapter_dir, scan_layers=True,
                                 **gpt2.overrides)
    assert p_scanned["h"]["self_attn"]["query"]["lora_a"].shape[0] == GPT2_TINY["n_layer"]
    ids = jnp.asarray(gpt2.ids)
    a_s, f_s = split_adapters(p_scanned)
    g_u, l_u = gpt2.forward(gpt2.adapters, gpt2.frozen, gpt2.w, ids)
    g_s, l_s = our_forward(scanned)(a_s, f_s, gpt2.w, ids)
    assert max_abs(l_u, gpt2.hf_logits) <= LOGIT_ATOL
    assert max_abs(l_s, l_u) <= 1e-6
    for k, v in g_u.items():
        layer = int(k[0].split("_")[1])
        assert max_abs(g_s[("h",) + k[1:]][layer], v) <= 1e-5, k
    # to_peft of the scanned params writes the same adapter
    to_peft(scanned, p_scanned, str(workdir / "gpt2_scanned"))
    _, t_s = read_adapter(str(workdir / "gpt2_scanned"))
    _, t_o = read_adapter(gpt2.adapter_dir)
    assert sorted(t_s) == sorted(t_o) and all(np.array_equal(t_s[k], t_o[k]) for k in t_s)


def test_lora_dropout_train_vs_eval(gpt2):
    """lora_dropout 0.1 from adapter_config.json: on in training (outputs change, per rng),
    off in eval (equal to dropout 0, bit for bit)."""
    module, params, ids = gpt2.module, gpt2.params, jnp.asarray(gpt2.ids)
    assert module.config.lora.dropout == 0.1
    no_dropout = module.clone(config=module.config.replace(
        lora=dataclasses.replace(module.config.lora, dropout=0.0)))
    _, eval_out = gpt2.forward(gpt2.adapters, gpt2.frozen, gpt2.w, ids)
    np.testing.assert_array_equal(
        eval_out, jax.jit(no_dropout.apply)({"params": params}, ids))
    train = jax.jit(lambda p, rng: module.apply({"params": p}, ids, deterministic=False,
                                                rngs={"dropout": rng}))
    train0, train0_again, train1 = (np.asarray(train(params, jax.random.PRNGKey(i)))
                                    for i in (0, 0, 1))
    np.testing.assert_array_equal(train0, train0_again)
    assert max_abs(train0, eval_out) > 1e-3
    assert max_abs(train0, train1) > 1e-3
    # with B = 0 the dropout has nothing to act on
    zero_b = traverse_util.unflatten_dict({**gpt2.frozen, **{
        k: (jnp.zeros_like(v) if k[-1] == "lora_b" else v) for k, v in gpt2.adapters.items()}})
    np.testing.assert_allclose(train(zero_b, jax.random.PRNGKey(0)), gpt2.plain, atol=LOGIT_ATOL)


# ----------------------------------------------------------------------------- SEQ_CLS

def test_bert_classification_modules_to_save(workdir):
    """SEQ_CLS: PEFT saves the classifier whole (modules_to_save); both directions carry it."""
    base = bert_model("classification")
    base_dir = str(workdir / "bert_cls_base")
    base.save_pretrained(base_dir)
    model = peft_model_for(base, ["query", "value"], task_type="SEQ_CLS")
    with torch.no_grad():
        for p in model.base_model.model.classifier.modules_to_save.parameters():
            p.add_(0.5)
    model.save_pretrained(str(workdir / "bert_cls_adapter"))
    config, tensors = read_adapter(str(workdir / "bert_cls_adapter"))
    assert KEY_PREFIX + "classifier.weight" in tensors and config["task_type"] == "SEQ_CLS"
    ids = _ids(9, (2, 7), 99)
    with torch.no_grad():
        ref = model(input_ids=_long(ids)).logits.numpy()
    module, params = from_hf(base_dir, adapter=str(workdir / "bert_cls_adapter"))
    ours = np.asarray(module.apply({"params": params}, jnp.asarray(ids)))
    assert max_abs(ours, ref) <= LOGIT_ATOL
    out = str(workdir / "bert_cls_ours")
    to_peft(module, params, out)
    written, tensors = read_adapter(out)
    assert written["task_type"] == "SEQ_CLS" and written["modules_to_save"] == ["classifier"]
    back = peft_from_pretrained(base, out)
    with torch.no_grad():
        assert max_abs(back(input_ids=_long(ids)).logits.numpy(), ours) <= LOGIT_ATOL


def test_vit_adapter_with_transformers4_names(workdir):
    """An adapter saved under transformers 4 (``encoder.layer.{i}.attention.attention.query``
    ...) loads as the same adapter under the current names (``layers.{i}.attention.q_proj``)."""
    from safetensors.numpy import save_file

    base = vit_model()
    base_dir = str(workdir / "vit_names_base")
    base.save_pretrained(base_dir)
    current = str(workdir / "vit_names_current")
    peft_model_for(base, ["q_proj", "v_proj", "fc2"]).save_pretrained(current)
    legacy = _edited_copy(current, str(workdir / "vit_names_legacy"),
                          config={"target_modules": ["query", "value", "output.dense"]})
    renames = (("vit.layers.", "vit.encoder.layer."), ("attention.q_proj", "attention.attention.query"),
               ("attention.v_proj", "attention.attention.value"), ("mlp.fc2", "output.dense"))
    _, tensors = read_adapter(current)
    renamed = {}
    for key, value in tensors.items():
        for old, new in renames:
            key = key.replace(old, new)
        renamed[key] = value
    assert KEY_PREFIX + "vit.encoder.layer.0.attention.attention.query.lora_A.weight" in renamed
    save_file(renamed, os.path.join(legacy, "adapter_model.safetensors"))
    _, p_current = from_hf(base_dir, adapter=current)
    module, p_legacy = from_hf(base_dir, adapter=legacy)
    assert {p[-2] for p in flatten_params(p_legacy) if p[-1] == "lora_a"} == {"query", "value", "wo"}
    flat_c, flat_l = flatten_params(p_current), flatten_params(p_legacy)
    assert set(flat_c) == set(flat_l)
    for k in flat_c:
        np.testing.assert_array_equal(flat_c[k], flat_l[k], err_msg=str(k))


def test_adapter_of_the_headless_model(gpt2, gpt2_base, workdir):
    """An adapter saved from ``GPT2Model`` (``h.0.attn.c_attn``, no ``transformer.``) loads
    into the ``GPT2LMHeadModel`` conversion: names match up to the leading prefix."""
    out = str(workdir / "gpt2_headless")
    peft_model_for(gpt2.base.transformer, ["c_attn"]).save_pretrained(out)
    _, tensors = read_adapter(out)
    a = tensors[KEY_PREFIX + "h.1.attn.c_attn.lora_A.weight"]
    b = tensors[KEY_PREFIX + "h.1.attn.c_attn.lora_B.weight"]
    module, params = load_peft(*gpt2_base, out)
    attn = params["h_1"]["self_attn"]
    d = GPT2_TINY["n_embd"]
    for j, name in enumerate(("query", "key", "value")):
        np.testing.assert_array_equal(attn[name]["lora_a"], a.T)
        np.testing.assert_array_equal(np.asarray(attn[name]["lora_b"]).reshape(RANK, d),
                                      b[j * d:(j + 1) * d].T)


# ----------------------------------------------------------------------------- errors

def _edited_copy(src, dst, *, config=None, tensors=None, drop=()):
    """A copy of adapter dir ``src`` with config fields / tensors replaced, files dropped."""
    from safetensors.numpy import save_file

    shutil.copytree(src, dst)
    if config is not None:
        path = os.path.join(dst, "adapter_config.json")
        with open(path) as f:
            current = json.load(f)
        with open(path, "w") as f:
            json.dump({**current, **config}, f)
    if tensors is not None:
        _, current = read_adapter(src)
        current.update(tensors)
        save_file({k: v for k, v in current.items() if v is not None},
                  os.path.join(dst, "adapter_model.safetensors"))
    for name in drop:
        os.remove(os.path.join(dst, name))
    return dst


@pytest.fixture(scope="module")
def gpt2_base(gpt2):
    return from_hf(gpt2.base_dir)


def test_error_not_lora(gpt2, gpt2_base, workdir):
    bad = _edited_copy(gpt2.adapter_dir, str(workdir / "e_ia3"), config={"peft_type": "IA3"})
    with pytest.raises(UserError, match="peft_type 'IA3'.*LoRA adapters only"):
        load_peft(*gpt2_base, bad)
    bad = _edited_copy(gpt2.adapter_dir, str(workdir / "e_dora"), config={"use_dora": True})
    with pytest.raises(UserError, match="use_dora=True .DoRA"):
        load_peft(*gpt2_base, bad)


def test_error_unmappable_target_modules(gpt2, gpt2_base, workdir):
    """The tied lm_head of GPT-2 is no Dense of ours; the embedding gets embedding LoRA."""
    for targets, match in ((["lm_head"], r"no LoRA-capable Dense.*\['lm_head'\].*target_modules"),
                           (["wte"], r"lora_embedding_A/B.*transformer\.wte")):
        model = peft_model_for(gpt2.base, targets)
        out = str(workdir / f"e_{targets[0]}")
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")      # PEFT: saving the embedding layers too
            model.save_pretrained(out)
        with pytest.raises(UserError, match=match):
            load_peft(*gpt2_base, out)


def test_error_shape_mismatch(gpt2, gpt2_base, workdir):
    key = KEY_PREFIX + "transformer.h.0.mlp.c_fc.lora_A.weight"
    bad = _edited_copy(gpt2.adapter_dir, str(workdir / "e_shape"),
                       tensors={key: np.zeros((RANK, 7), np.float32)})
    with pytest.raises(UserError, match=r"shape mismatch at transformer\.h\.0\.mlp\.c_fc"):
        load_peft(*gpt2_base, bad)
    bad = _edited_copy(gpt2.adapter_dir, str(workdir / "e_rank"), config={"r": 8})
    with pytest.raises(UserError, match="shape mismatch.*r=8"):
        load_peft(*gpt2_base, bad)


def test_error_modules_to_save_unmappable(gpt2, gpt2_base, workdir):
    bad = _edited_copy(gpt2.adapter_dir, str(workdir / "e_save"),
                       config={"modules_to_save": ["score"]},
                       tensors={KEY_PREFIX + "score.weight": np.zeros((3, 64), np.float32)})
    with pytest.raises(UserError, match=r"modules_to_save=\['score'\].*\['score\.weight'\]"):
        load_peft(*gpt2_base, bad)


def test_error_missing_files(gpt2, gpt2_base, workdir):
    empty = workdir / "e_empty"
    empty.mkdir()
    with pytest.raises(UserError, match="no adapter_config.json"):
        load_peft(*gpt2_base, str(empty))
    no_weights = _edited_copy(gpt2.adapter_dir, str(workdir / "e_noweights"),
                              drop=("adapter_model.safetensors",))
    with pytest.raises(UserError, match="no adapter_model.safetensors"):
        load_peft(*gpt2_base, no_weights)
    open(os.path.join(no_weights, "adapter_model.bin"), "wb").close()
    with pytest.raises(UserError, match="adapter_model.bin.*safe_serialization=True"):
        from_hf(gpt2.base_dir, adapter=no_weights)
    with pytest.raises(UserError, match="is not a directory"):
        load_peft(*gpt2_base, str(workdir / "nowhere"))


def test_to_peft_refuses_without_adapters(gpt2_base, workdir):
    module, params = gpt2_base
    with pytest.raises(UserError, match="lora is None"):
        to_peft(module, params, str(workdir / "e_out"))
    with_lora = module.clone(config=module.config.replace(lora=dict(rank=2)))
    with pytest.raises(UserError, match="no LoRA adapters"):
        to_peft(with_lora, params, str(workdir / "e_out"))
