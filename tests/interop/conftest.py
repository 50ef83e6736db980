"""Shared setup of the PyTorch / Hugging Face parity tests (imported by the test files).

The fp32 matmul precision ("highest") and the offline HF settings come from
``tests/conftest.py``. Here: torch and transformers (the package is skipped without
them), the tolerances, the tiny HF models and the helpers the four HF families share.

Every HF model is built from a tiny config with random weights (no hub access), then moved
off HF's init (zero biases, identity norms would hide a swapped mapping) by
``amplitude * N(0, 1)`` per weight, under a fixed torch seed.
"""
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformer_jax.interop.hf.bert import hf_class  # noqa: E402

# fp32 tolerances. Measured: GPT-2 logits (|logit| <= ~3) differ by <= 2e-6 and gradients by
# <= 2e-7; BERT outputs by <= 6e-7, gradients by <= 1e-7; ViT logits (|logit| ~1) by
# <= 4e-7, gradients by <= 1e-7; the torch.nn modules within RTOL/ATOL.
RTOL, ATOL = 1e-5, 1e-5
GRAD_RTOL, GRAD_ATOL = 1e-4, 1e-6
# T5 logits (|logit| <= ~20) differ by <= 1.4e-5; gradients by <= 3e-6 absolute, i.e.
# <= 1e-5 of the largest entry of their tensor (T5_GRAD_ATOL is relative to that entry).
T5_RTOL, T5_ATOL = 2e-5, 5e-5
T5_GRAD_RTOL, T5_GRAD_ATOL = 1e-4, 5e-5

GPT2_TINY = dict(n_embd=64, n_layer=2, n_head=4, vocab_size=101, n_positions=64,
                 bos_token_id=None, eos_token_id=None)
BERT_TINY = dict(vocab_size=99, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=37, max_position_embeddings=40, type_vocab_size=3, num_labels=3)
VIT_TINY = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
                image_size=16, patch_size=4, num_channels=3, num_labels=5)
#: a CLIPModel with towers of different widths, MLP widths that are not 4 D, and an
#: end-of-text id inside the vocabulary (pad 0, eos 98: the tokenizer's last id)
CLIP_TINY = dict(
    text_config=dict(vocab_size=99, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                     num_attention_heads=4, max_position_embeddings=16, pad_token_id=0,
                     bos_token_id=None, eos_token_id=98),
    vision_config=dict(hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, image_size=16, patch_size=4, num_channels=3),
    projection_dim=24)
T5_TINY = dict(vocab_size=50, d_model=32, d_kv=8, d_ff=48, num_layers=1, num_decoder_layers=2,
               num_heads=4, relative_attention_num_buckets=8, relative_attention_max_distance=20,
               dropout_rate=0.0, decoder_start_token_id=0)


# ----------------------------------------------------------------------------- models

def perturbed(build, seed: int = 0, amplitude: float = 0.1):
    """``build()`` under ``torch.manual_seed(seed)``, every weight moved off HF's init, in eval mode."""
    torch.manual_seed(seed)
    model = build()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(amplitude * torch.randn_like(p))
    return model.eval()


def gpt2_model(seed: int = 0, **overrides):
    """A random ``GPT2LMHeadModel`` (``GPT2_TINY`` with ``overrides``)."""
    config = transformers.GPT2Config(**{**GPT2_TINY, **overrides})
    return perturbed(lambda: transformers.GPT2LMHeadModel(config), seed)


def bert_model(head: str, seed: int = 0, **overrides):
    """A random HF BERT of the class for ``BertConfig.head`` ``head`` (``BERT_TINY``)."""
    config = transformers.BertConfig(**{**BERT_TINY, **overrides})
    return perturbed(lambda: hf_class(head)(config), seed)


def vit_model(seed: int = 0, cls=None, **overrides):
    """A random HF ViT, ``ViTForImageClassification`` unless ``cls`` (``VIT_TINY``)."""
    cls = cls or transformers.ViTForImageClassification
    config = transformers.ViTConfig(**{**VIT_TINY, **overrides})
    return perturbed(lambda: cls(config), seed)


def clip_model(seed: int = 0, text: dict | None = None, vision: dict | None = None, **overrides):
    """A random ``CLIPModel`` (``CLIP_TINY``, each tower's settings updated by ``text`` /
    ``vision``, the top level by ``overrides``)."""
    config = transformers.CLIPConfig(**{
        **CLIP_TINY, "text_config": {**CLIP_TINY["text_config"], **(text or {})},
        "vision_config": {**CLIP_TINY["vision_config"], **(vision or {})}, **overrides})
    return perturbed(lambda: transformers.CLIPModel(config), seed)


def untie_lm_head(model):
    """What HF does when it loads a v1.1 T5 checkpoint (lm_head != shared): a separate head."""
    model.lm_head.weight = torch.nn.Parameter(model.shared.weight.detach().clone())
    model.all_tied_weights_keys.pop("lm_head.weight", None)
    return model


def t5_model(seed: int = 0, amplitude: float = 0.1, **overrides):
    """A random ``T5ForConditionalGeneration`` (``T5_TINY``); untied when the config says so."""
    kwargs = {**T5_TINY, **overrides}

    def build():
        model = transformers.T5ForConditionalGeneration(transformers.T5Config(**kwargs))
        return untie_lm_head(model) if kwargs.get("tie_word_embeddings", True) is False else model
    return perturbed(build, seed, amplitude)


def state_dict(model) -> dict:
    """A model's state dict as a plain (mutable) dict."""
    return dict(model.state_dict())


# ----------------------------------------------------------------------------- checks

def assert_gradients_match(ours, theirs, params, *, rtol=GRAD_RTOL, atol=GRAD_ATOL,
                           atol_relative: bool = False) -> int:
    """Our gradient tree equals HF's (its ``.grad``s converted with ``from_hf_state_dict``).

    Every parameter has a gradient on both sides, none is (near) zero (a vacuous test),
    except attention key biases: a key bias shifts a softmax row uniformly, so its exact
    gradient is 0 and both sides hold rounding noise. With ``atol_relative`` the absolute
    tolerance is ``atol`` times the largest entry of HF's tensor. Returns the leaf count.
    """
    flat_ours = jax.tree_util.tree_leaves_with_path(ours)
    flat_theirs = dict(jax.tree_util.tree_leaves_with_path(theirs))
    assert len(flat_ours) == len(flat_theirs) == len(jax.tree_util.tree_leaves(params))
    for path, g in flat_ours:
        name = jax.tree_util.keystr(path)
        if "'key']['bias'" not in name:
            assert float(np.abs(np.asarray(g)).max()) > 1e-4, f"{name}: (near-)zero gradient, vacuous test"
        ref = np.asarray(flat_theirs[path])
        np.testing.assert_allclose(np.asarray(g), ref, rtol=rtol,
                                   atol=atol * np.abs(ref).max() if atol_relative else atol,
                                   err_msg=name)
    return len(flat_ours)


_WITHOUT_TORCH = """
import sys
sys.modules["torch"] = None          # any `import torch` now raises ImportError
import jax
jax.config.update("jax_default_matmul_precision", "highest")
import numpy as np
from transformer_jax.interop import from_hf
module, params = from_hf(sys.argv[1])
{body}
assert "torch" not in [m.split(".")[0] for m in sys.modules if sys.modules[m] is not None]
"""


def run_without_torch(body: str, checkpoint, *args) -> None:
    """Load ``checkpoint`` (a save_pretrained dir) with ``from_hf`` in a Python where torch
    cannot be imported, run ``body`` (``module``, ``params``, ``sys.argv[2:]`` = ``args``)
    and assert that torch was never imported."""
    code = _WITHOUT_TORCH.format(body=textwrap.dedent(body).strip())
    subprocess.run([sys.executable, "-c", code, str(checkpoint), *map(str, args)], check=True)


def lm_gradients(module, params, hf_model, ids):
    """``(our gradients, HF's .grad mapped to our params)`` of the mean next-token
    cross-entropy on ``ids`` (a decoder-only LM), after checking the two losses agree.
    HF's ``named_parameters`` lists a tied embedding/LM head once; its .grad holds both uses."""
    import optax
    from transformer_jax.interop.hf import from_hf_state_dict

    def loss_fn(p):
        logits = module.apply({"params": p}, jax.numpy.asarray(ids))
        return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], ids[:, 1:]).mean()

    jax_loss, jax_grads = jax.jit(jax.value_and_grad(loss_fn))(params)
    hf_model.zero_grad()
    logits = hf_model(torch.as_tensor(ids, dtype=torch.long)).logits
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                             torch.as_tensor(ids[:, 1:], dtype=torch.long).reshape(-1))
    loss.backward()
    np.testing.assert_allclose(float(jax_loss), loss.item(), rtol=RTOL)
    torch_grads = {name: p.grad for name, p in hf_model.named_parameters()}
    _, mapped = from_hf_state_dict(hf_model.config, torch_grads)
    hf_model.zero_grad()
    return jax_grads, mapped, torch_grads


def hf_generate(model, ids, mask, max_new_tokens, eos_id=None, pad_id=0):
    """HF greedy ``generate`` on (B, T) ids and their mask, as numpy (prompt + new tokens)."""
    with torch.no_grad():
        return model.generate(torch.as_tensor(ids, dtype=torch.long),
                              attention_mask=torch.as_tensor(mask, dtype=torch.long),
                              do_sample=False, num_beams=1, max_new_tokens=max_new_tokens,
                              eos_token_id=eos_id, pad_token_id=pad_id).numpy()


def assert_left_padded_greedy_matches_hf(hf_model, module, params, prompts, new_tokens, pad=0):
    """Prompts of different lengths, left-padded: our greedy ``generate`` gives HF's tokens,
    and its list-of-prompts form (padding internally) each prompt + the same new tokens."""
    from transformer_jax.decode import generate

    t0 = max(len(p) for p in prompts)
    ids = np.full((len(prompts), t0), pad, np.int32)
    mask = np.zeros((len(prompts), t0), np.int32)
    for i, p in enumerate(prompts):
        ids[i, t0 - len(p):], mask[i, t0 - len(p):] = p, 1
    theirs = hf_generate(hf_model, ids, mask, new_tokens, pad_id=pad)
    ours = np.asarray(generate(module, params, ids, prompt_mask=mask, max_new_tokens=new_tokens,
                               pad_id=pad))
    np.testing.assert_array_equal(ours, theirs)
    ragged = generate(module, params, prompts, max_new_tokens=new_tokens, pad_id=pad)
    for i, p in enumerate(prompts):
        assert ragged[i] == p + theirs[i, t0:].tolist()


def assert_aligned_greedy_matches_hf(hf_model, module, params, ids, new_tokens):
    """Prompts of one length (B, T0): our greedy ``generate`` gives HF's tokens, and those
    are not one token repeated (a check with some power)."""
    from transformer_jax.decode import generate

    ours = np.asarray(generate(module, params, ids, max_new_tokens=new_tokens))
    theirs = hf_generate(hf_model, ids, np.ones_like(ids), new_tokens)
    assert ours.shape == theirs.shape == (ids.shape[0], ids.shape[1] + new_tokens)
    assert len(set(theirs[:, ids.shape[1]:].ravel().tolist())) > 3
    np.testing.assert_array_equal(ours, theirs)


def assert_strict_round_trip(hf_model, module, params, hf_cls, logits, inputs):
    """``to_hf`` holds HF's keys exactly, every tensor bit-identical; a fresh ``hf_cls``
    (from ``hf_config``) loads it strictly and gives HF's logits (``logits(model, inputs)``)."""
    from transformer_jax.interop import hf_config, to_hf

    sd = to_hf(module, params)
    assert set(sd) == set(hf_model.state_dict())
    fresh = hf_cls(hf_config(module.config)).eval()
    fresh.load_state_dict(sd, strict=True)
    np.testing.assert_array_equal(logits(fresh, inputs), logits(hf_model, inputs))
    for key, value in hf_model.state_dict().items():
        torch.testing.assert_close(sd[key], value, rtol=0, atol=0, msg=key)
    return sd


def meta_param_count(build) -> int:
    """Parameters of the HF model ``build()`` makes on the meta device (no memory; a tied
    or aliased tensor counts once)."""
    with torch.device("meta"):
        return sum(p.numel() for p in build().parameters())


def abstract_param_count(init) -> int:
    """Parameters of the variables ``init()`` would make, traced abstractly (no memory)."""
    import flax.linen as nn

    shapes = jax.eval_shape(init)["params"]
    return sum(int(np.prod(x.shape)) for x in jax.tree_util.tree_leaves(nn.meta.unbox(shapes)))


def assert_same_leaves(got, want) -> None:
    """Every leaf of the params tree ``got`` equals (bit for bit) the leaf at its path in
    ``want``."""
    for path, leaf in jax.tree_util.tree_leaves_with_path(got):
        ref = want
        for k in path:
            ref = ref[k.key]
        np.testing.assert_array_equal(np.asarray(leaf), np.asarray(ref))
