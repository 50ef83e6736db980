"""CLIP parity with Hugging Face ``CLIPModel`` (PyTorch), through ``interop``.

Random HF models from ``conftest.py`` (weights moved off HF's init). Two configs for
logits, loss and gradients: the tiny one (towers of different widths, pooling at the first
end-of-text id), and one with other widths, depths, heads, patch size, image size,
channels, activation and projection width whose ``eos_token_id`` is the legacy 2
(captions pool at their largest id). HF takes NCHW ``pixel_values``; our CLIP takes NHWC.
The loss is HF's ``return_loss=True`` one (symmetric cross-entropy over the similarity
matrix), computed here with optax.
"""
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from transformer_jax.errors import UserError
from transformer_jax.interop import from_hf, hf_config, to_hf
from transformer_jax.interop.hf import from_hf_state_dict, to_hf_numpy
from transformer_jax.interop.hf.clip import clip_config_from_hf
from transformer_jax.models.base import to_config_layout
from transformer_jax.models.clip import CLIP, CLIPConfig
from transformer_jax.models.vit import ViTConfig

from .conftest import (assert_gradients_match, assert_strict_round_trip, clip_model,
                       meta_param_count, state_dict, torch, transformers)

ATOL = 1e-5          # logits, embeddings, loss and gradients, max abs (fp32)

CONFIGS = {
    "tiny": dict(),
    "other-legacy": dict(text=dict(hidden_size=24, num_attention_heads=3, num_hidden_layers=1,
                                   intermediate_size=40, hidden_act="gelu", eos_token_id=2),
                         vision=dict(hidden_size=32, num_attention_heads=2, num_hidden_layers=1,
                                     intermediate_size=50, patch_size=8, image_size=24,
                                     num_channels=1, hidden_act="gelu"),
                         projection_dim=16, logit_scale_init_value=3.0),
}


def inputs(config, seed=0, batch=3, length=10):
    """(ids, mask, NCHW pixels): tokens in [3, 98), each row's end-of-text 98 at its own
    place with pad 0 (mask 0) after it, and a 2 early on (pooled there if the legacy rule
    were not applied)."""
    rng = np.random.default_rng(seed)
    ids = rng.integers(3, 98, (batch, length))
    mask = np.ones_like(ids)
    for row in range(batch):
        end = length - 1 - 3 * row
        ids[row, 1], ids[row, end], ids[row, end + 1:], mask[row, end + 1:] = 2, 98, 0, 0
    v = config.vision_config
    pixels = rng.standard_normal((batch, v.num_channels, v.image_size, v.image_size))
    return ids, mask, pixels.astype(np.float32)


def nhwc(x):
    return np.ascontiguousarray(x.transpose(0, 2, 3, 1))


def hf_outputs(model, ids, mask, pixels):
    with torch.no_grad():
        return model(input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(mask),
                     pixel_values=torch.from_numpy(pixels))


@functools.lru_cache(maxsize=None)
def our_loss_and_grads(module):
    """Jitted ``(params, images, ids, mask) -> ((loss, outputs), (param grads, image grad))``
    of the symmetric contrastive cross-entropy."""
    def loss_fn(params, images, ids, mask):
        out = module.apply({"params": params}, ids, images, mask)
        labels = jnp.arange(ids.shape[0])
        loss = (optax.softmax_cross_entropy_with_integer_labels(out["logits_per_text"], labels).mean()
                + optax.softmax_cross_entropy_with_integer_labels(out["logits_per_image"], labels).mean()) / 2
        return loss, out
    return jax.jit(jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True))


def max_abs(a, b) -> float:
    return float(np.abs(np.asarray(a) - np.asarray(b)).max())


@pytest.fixture(scope="module")
def tiny():
    hf = clip_model()
    return hf, from_hf(hf)


# ----------------------------------------------------------------------------- parity

@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_logits_loss_and_gradients_match_hf(name):
    hf = clip_model(seed=1, **CONFIGS[name])
    module, params = from_hf(hf)
    cfg = module.config
    assert cfg.text_pooling == ("argmax" if name == "other-legacy" else "eos")
    ids, mask, pixels = inputs(hf.config)
    hf.zero_grad()
    x = torch.from_numpy(pixels).requires_grad_(True)
    theirs = hf(input_ids=torch.as_tensor(ids), attention_mask=torch.as_tensor(mask),
                pixel_values=x, return_loss=True)
    theirs.loss.backward()
    (loss, ours), (grads, image_grad) = our_loss_and_grads(module)(
        params, jnp.asarray(nhwc(pixels)), jnp.asarray(ids), jnp.asarray(mask))
    errors = {key: max_abs(ours[key], getattr(theirs, key).detach().numpy())
              for key in ("logits_per_image", "logits_per_text", "image_embeds", "text_embeds")}
    errors["loss"] = abs(float(loss) - theirs.loss.item())
    assert np.abs(theirs.logits_per_image.detach().numpy()).max() > 0.5
    _, mapped = from_hf_state_dict(hf.config, {n: p.grad for n, p in hf.named_parameters()})
    assert assert_gradients_match(grads, mapped, params, rtol=0, atol=ATOL) == len(
        list(hf.parameters()))
    errors["grads"] = max(max_abs(a, b) for a, b in zip(jax.tree_util.tree_leaves(grads),
                                                        jax.tree_util.tree_leaves(mapped)))
    errors["image grad"] = max_abs(image_grad, nhwc(x.grad.numpy()))
    print(name, {k: f"{v:.1e}" for k, v in errors.items()})
    assert max(errors.values()) <= ATOL, errors


def test_config_mapping_both_ways(tiny):
    hf, (module, _) = tiny
    cfg = module.config
    assert (cfg.text_width, cfg.text_layers, cfg.text_heads, cfg.text_mlp_features) == (32, 2, 4, 37)
    assert (cfg.vision_width, cfg.vision_layers, cfg.vision_heads, cfg.vision_mlp_features) == (48, 2, 4, 64)
    assert (cfg.vocab_size, cfg.max_len, cfg.eos_token_id, cfg.pad_token_id) == (99, 16, 98, 0)
    assert (cfg.image_size, cfg.patch_size, cfg.projection_dim) == (16, 4, 24)
    assert cfg.activation == "quick_gelu" and cfg.norm_eps == 1e-5 and cfg.text_pooling == "eos"
    back = hf_config(cfg)
    for tower in ("text_config", "vision_config"):
        ours, theirs = getattr(back, tower).to_dict(), getattr(hf.config, tower).to_dict()
        for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                    "hidden_act", "layer_norm_eps", "attention_dropout", "initializer_range"):
            assert ours[key] == theirs[key], (tower, key)
    assert (back.projection_dim, back.logit_scale_init_value) == (24, 2.6592)
    # HF's defaults are ours (a config.json leaves out what equals them)
    assert clip_config_from_hf({"model_type": "clip"}) == CLIPConfig()
    assert clip_config_from_hf(hf_config(CLIPConfig()).to_dict()) == CLIPConfig(
        vision_mlp_dim=3072, text_mlp_dim=2048)


def test_scan_layers_load_and_export(tiny):
    """Scanned: the same leaves stacked per tower (scan == unscanned numbers: test_clip.py)."""
    hf, (module, params) = tiny
    smod, sparams = from_hf(hf, scan_layers=True)
    assert smod.config == module.config.replace(scan_layers=True)
    assert sparams["text"]["layers"]["mlp"]["wi"]["kernel"].shape == (2, 32, 37)
    assert sparams["vision"]["encoderblock"]["self_attn"]["query"]["kernel"].shape == (2, 48, 4, 12)
    stacked = to_config_layout(params, smod.config)
    for (path, a), (_, b) in zip(jax.tree_util.tree_leaves_with_path(sparams),
                                 jax.tree_util.tree_leaves_with_path(stacked)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=jax.tree_util.keystr(path))
    a, b = to_hf_numpy(smod, sparams), to_hf_numpy(module, params)
    assert set(a) == set(b) == set(hf.state_dict())
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


# ----------------------------------------------------------------------------- round trips

def test_round_trip_strict_load(tiny):
    hf, (module, params) = tiny
    ids, mask, pixels = inputs(hf.config, seed=3)
    sd = assert_strict_round_trip(
        hf, module, params, transformers.CLIPModel,
        lambda m, x: hf_outputs(m, *x).logits_per_image.numpy(), (ids, mask, pixels))
    assert sd["logit_scale"].shape == ()


def test_export_dir_loads_in_hf_with_our_logits(tiny, tmp_path):
    """``export.write_hf``: flax -> model.safetensors + config.json (CLIPModel) ->
    ``from_pretrained`` (no missing or unexpected key) -> our logits; and back."""
    from transformer_jax.export import write_hf

    hf, (module, params) = tiny
    ids, mask, pixels = inputs(hf.config, seed=4)
    (_, ours), _ = our_loss_and_grads(module)(params, nhwc(pixels), ids, mask)   # compiled once
    write_hf(module, params, str(tmp_path))
    assert json.loads((tmp_path / "config.json").read_text())["architectures"] == ["CLIPModel"]
    loaded, info = transformers.CLIPModel.from_pretrained(tmp_path, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    theirs = hf_outputs(loaded.eval(), ids, mask, pixels)
    assert max_abs(ours["logits_per_image"], theirs.logits_per_image.numpy()) <= ATOL
    again, back = from_hf(str(tmp_path))                   # the directory, read without torch
    assert again.config == module.config
    for a, b in zip(jax.tree_util.tree_leaves(back), jax.tree_util.tree_leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_old_position_id_buffers_are_accepted(tiny):
    hf, (_, params) = tiny
    sd = state_dict(hf)
    sd["text_model.embeddings.position_ids"] = torch.arange(16)[None]
    sd["vision_model.embeddings.position_ids"] = torch.arange(17)[None]
    _, loaded = from_hf_state_dict(hf.config, sd)
    np.testing.assert_array_equal(np.asarray(loaded["vision"]["pos_embedding"]),
                                  np.asarray(params["vision"]["pos_embedding"]))
    sd["vision_model.embeddings.position_ids"] = torch.arange(1, 18)[None]
    with pytest.raises(UserError, match=r"vision_model.embeddings.position_ids.*not 0, 1"):
        from_hf_state_dict(hf.config, sd)


# ----------------------------------------------------------------------------- image size

def test_resize_on_load_matches_hf_interpolate_pos_encoding(tiny):
    hf, _ = tiny
    module, params = from_hf(hf, image_size=24)
    assert module.config.image_size == 24 and params["vision"]["pos_embedding"].shape == (37, 48)
    pixels = np.random.default_rng(5).standard_normal((2, 3, 24, 24)).astype(np.float32)
    ours = jax.jit(functools.partial(module.apply, method="encode_image"))({"params": params},
                                                                          nhwc(pixels))
    with torch.no_grad():
        theirs = hf.get_image_features(pixel_values=torch.from_numpy(pixels),
                                       interpolate_pos_encoding=True).pooler_output.numpy()
    assert max_abs(ours, theirs) <= ATOL
    with pytest.raises(UserError, match="patch_size"):
        from_hf(hf, patch_size=8)


# ----------------------------------------------------------------------------- counts

@pytest.mark.parametrize("name", ["tiny", "clip-vit-base-patch32", "clip-vit-large-patch14"])
def test_parameter_counts_match_hf(name):
    cfg = CLIPConfig.preset(name)
    assert cfg.num_params() == meta_param_count(lambda: transformers.CLIPModel(hf_config(cfg)))


# ----------------------------------------------------------------------------- bad input

def test_unknown_missing_and_misshapen_keys_raise(tiny):
    hf, _ = tiny
    sd = state_dict(hf)
    sd["vision_model.embeddings.patch_embedding.bias"] = torch.zeros(48)
    with pytest.raises(UserError, match=r"patch_embedding\.bias"):
        from_hf_state_dict(hf.config, sd)
    sd = state_dict(hf)
    del sd["text_model.encoder.layers.1.mlp.fc1.bias"]
    with pytest.raises(UserError, match=r"text_model\.encoder\.layers\.1\.mlp\.fc1\.bias"):
        from_hf_state_dict(hf.config, sd)
    sd = state_dict(hf)
    sd["text_projection.weight"] = torch.zeros(24, 33)
    with pytest.raises(UserError, match=r"text_projection\.weight.*\(24, 33\).*\(24, 32\)"):
        from_hf_state_dict(hf.config, sd)


@pytest.mark.parametrize("where, option, value, match", [
    ("text_config", "hidden_act", "gelu", r"text_config.hidden_act='gelu' but vision_config"),
    ("vision_config", "layer_norm_eps", 1e-6, r"layer_norm_eps=1e-05 but vision_config.layer_norm_eps=1e-06"),
    ("text_config", "eos_token_id", [2, 98], r"text_config.eos_token_id=\[2, 98\]"),
    ("vision_config", "image_size", [16, 32], r"vision_config.image_size=\[16, 32\]"),
    (None, "model_type", "siglip", "siglip"),
    ("both", "hidden_act", "mish", r"unsupported CLIP config option hidden_act='mish'"),
])
def test_unsupported_config_options_raise(tiny, where, option, value, match):
    hf, _ = tiny
    config = hf.config.to_dict()
    for part in ("text_config", "vision_config") if where == "both" else [where]:
        (config[part] if part else config)[option] = value
    with pytest.raises(UserError, match=match):
        from_hf_state_dict(config, state_dict(hf))


def test_pooling_maps_to_hf_eos_token_id():
    legacy = hf_config(CLIPConfig.preset("tiny", text_pooling="argmax"))
    assert legacy.text_config.eos_token_id == 2
    back = clip_config_from_hf(legacy.to_dict())
    assert (back.text_pooling, back.eos_token_id) == ("argmax", 2)
    assert hf_config(CLIPConfig.preset("tiny")).text_config.eos_token_id == 1
    with pytest.raises(UserError, match=r"eos_token_id=2 with text_pooling='eos'"):
        hf_config(CLIPConfig.preset("tiny", eos_token_id=2))


def test_options_hf_cannot_express_are_refused():
    with pytest.raises(UserError, match=r"attention_window=4"):
        hf_config(CLIPConfig.preset("tiny", attention_window=4))
    module = CLIP(CLIPConfig.preset("tiny", attention_sparsity="strided:4"))
    with pytest.raises(UserError, match=r"attention_sparsity"):
        to_hf(module, {})
    # a ViT with the CLIP vision tower's options is no HF ViT
    with pytest.raises(UserError, match=r"patch_bias=False, embedding_norm=True"):
        hf_config(ViTConfig.preset("tiny", patch_bias=False, embedding_norm=True))


# ----------------------------------------------------------------------------- fine-tuning

def test_init_from_a_clip_directory_plans_the_start(tiny, tmp_path):
    """``--init-from`` a CLIP save_pretrained directory (``train.finetune``): the family,
    its config, every weight; at another image size the vision position table is resized,
    and with another channel count the patch embedding starts fresh (a task field)."""
    from transformer_jax.models.clip import init_params, resize_params
    from transformer_jax.train import finetune

    hf, (module, params) = tiny
    hf.save_pretrained(tmp_path / "hf")
    source = finetune.load_source(tmp_path / "hf")
    assert (source.kind, source.family, source.task) == ("hf", "clip", "CLIPModel")
    assert CLIPConfig.from_dict(source.model_config) == module.config
    assert finetune.HEAD_FIELDS["clip"] == {"num_channels"}
    target = module.config.replace(image_size=24, num_channels=1, scan_layers=True)
    abstract = jax.eval_shape(lambda: init_params(CLIP(target), jax.random.PRNGKey(0)))
    start = finetune.Start.plan(source, target, abstract)
    assert start.fresh == [("vision", "embedding", "kernel")] and start.dropped == []
    _, resized = resize_params(params, module.config, 24)
    np.testing.assert_array_equal(start.loaded[("vision", "pos_embedding")],
                                  np.asarray(resized["vision"]["pos_embedding"]))
    np.testing.assert_array_equal(start.loaded[("text", "layers", "mlp", "wo", "kernel")][1],
                                  np.asarray(params["text"]["layers_1"]["mlp"]["wo"]["kernel"]))
