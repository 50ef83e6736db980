"""``from_hf`` on damaged ``save_pretrained`` directories: every file problem is one
UserError line that names the file and what to do (interop/hf/convert.py), never a raw traceback.

A tiny random GPT-2 is saved once (whole, sharded and bfloat16) and each test corrupts a copy:
malformed or wrong JSON in config.json and the shard index, a safetensors file cut in its
header or in its data, a shard the index names but the directory lacks.
"""
import json
import os
import shutil

import pytest

from transformer_jax.errors import UserError
from transformer_jax.interop import from_hf
from transformer_jax.interop.hf.convert import _SafetensorsDir

from .conftest import gpt2_model, torch

AGAIN = "save the model again with save_pretrained(..., safe_serialization=True) or copy it anew"


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """{"single", "sharded", "bf16"} -> a save_pretrained directory of the same tiny GPT-2."""
    root = tmp_path_factory.mktemp("hf_files")
    model = gpt2_model()
    model.save_pretrained(root / "single", safe_serialization=True)
    model.save_pretrained(root / "sharded", safe_serialization=True, max_shard_size="40KB")
    model.to(torch.bfloat16).save_pretrained(root / "bf16", safe_serialization=True)
    return root


def copy_of(saved, name, tmp_path):
    out = tmp_path / name
    shutil.copytree(saved / name, out)
    return out


def header_len(path) -> int:
    with open(path, "rb") as f:
        return int.from_bytes(f.read(8), "little")


def cut(path, size: int) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:size])


def refused(directory) -> str:
    """The message of ``from_hf(directory)``'s UserError, which must be one line."""
    with pytest.raises(UserError) as info:
        from_hf(directory)
    message = str(info.value)
    assert "\n" not in message
    return message


def test_the_intact_directories_load(saved):
    for name in ("single", "sharded", "bf16"):
        module, params = from_hf(saved / name)
        assert params["wte"]["embedding"].shape == (101, 64)


# ----------------------------------------------------------------------------- config.json

def test_malformed_config_json(saved, tmp_path):
    d = copy_of(saved, "single", tmp_path)
    (d / "config.json").write_text('{"model_type": "gpt2", "n_layer": 2,,}')
    assert refused(d) == (
        f"{d / 'config.json'}: not valid JSON (Expecting property name enclosed in double "
        "quotes: line 1 column 37 (char 36)), so not a Hugging Face config; the file is "
        f"damaged: {AGAIN}")


def test_a_config_json_that_is_no_object_or_lacks_model_type(saved, tmp_path):
    d = copy_of(saved, "single", tmp_path)
    (d / "config.json").write_text("[1, 2]")
    assert refused(d) == (f"{d / 'config.json'}: a JSON list, not the JSON object of a Hugging "
                          f"Face config; {AGAIN}")
    config = json.loads((saved / "single" / "config.json").read_text())
    del config["model_type"]
    (d / "config.json").write_text(json.dumps(config))
    assert refused(d) == (f"{d / 'config.json'}: no \"model_type\", so the model family is "
                          f"unknown; add it (one of ['bert', 'clip', 'gemma3', 'gemma3_text', 'gpt2', "
                          f"'llama', 'mistral', 'qwen2', 'qwen3', 't5', 'vit']) or {AGAIN}")
    (d / "config.json").write_text(json.dumps({**config, "model_type": "bloom"}))
    assert refused(d) == (f"{d / 'config.json'}: unsupported Hugging Face model_type 'bloom'; "
                          "supported: ['bert', 'clip', 'gemma3', 'gemma3_text', 'gpt2', 'llama', "
                          "'mistral', 'qwen2', 'qwen3', 't5', 'vit']")


def test_missing_files(saved, tmp_path):
    d = copy_of(saved, "single", tmp_path)
    os.remove(d / "model.safetensors")
    assert refused(d) == (
        f"{d}: no model.safetensors or model.safetensors.index.json (found ['config.json', "
        "'generation_config.json']); save the HF model with save_pretrained(..., "
        "safe_serialization=True)")
    os.remove(d / "config.json")
    assert refused(d) == f"{d}: no config.json; expected a directory written by save_pretrained"
    assert refused(d / "nowhere") == (
        f"{str(d / 'nowhere')!r} is not a directory; from_hf takes a live HF model or a local "
        "save_pretrained directory (no hub downloads)")


# ----------------------------------------------------------------------------- safetensors

def test_a_safetensors_file_cut_in_its_header(saved, tmp_path):
    d = copy_of(saved, "single", tmp_path)
    path = d / "model.safetensors"
    n = header_len(path)
    cut(path, 8 + n // 2)
    assert refused(d) == (f"{path}: truncated safetensors file ({8 + n // 2} bytes; its header "
                          f"alone needs {8 + n}); {AGAIN}")
    cut(path, 5)
    assert refused(d) == (f"{path}: truncated safetensors file (5 bytes, shorter than its "
                          f"8-byte header length); {AGAIN}")


def test_a_safetensors_file_cut_in_its_data(saved, tmp_path):
    d = copy_of(saved, "single", tmp_path)
    path = d / "model.safetensors"
    size = path.stat().st_size
    cut(path, size - 100)
    assert refused(d) == (f"{path}: truncated safetensors file ({size - 100} bytes; its tensors "
                          f"need {size}); {AGAIN}")


def test_a_damaged_safetensors_header(saved, tmp_path):
    d = copy_of(saved, "single", tmp_path)
    path = d / "model.safetensors"
    data = bytearray(path.read_bytes())
    data[8] = ord("[")                      # the header's opening brace
    path.write_bytes(bytes(data))
    assert refused(d) == (f"{path}: damaged safetensors file (its header is not the JSON "
                          f"safetensors writes); {AGAIN}")


def test_a_bf16_file_cut_after_it_was_opened(saved, tmp_path):
    d = copy_of(saved, "bf16", tmp_path)
    weights = _SafetensorsDir(str(d))
    path = d / "model.safetensors"
    header = json.loads(path.read_bytes()[8: 8 + header_len(path)])
    key = max((k for k in header if k != "__metadata__"),
              key=lambda k: header[k]["data_offsets"][1])             # the last tensor
    start, end = (8 + header_len(path) + o for o in header[key]["data_offsets"])
    assert header[key]["dtype"] == "BF16"
    cut(path, end - 2)
    with pytest.raises(UserError) as info:
        weights[key]
    assert str(info.value) == (f"{path}: truncated safetensors file (tensor {key!r} needs bytes "
                               f"{start}..{end}); {AGAIN}")


# ----------------------------------------------------------------------------- sharded

def test_a_malformed_index(saved, tmp_path):
    d = copy_of(saved, "sharded", tmp_path)
    index = d / "model.safetensors.index.json"
    index.write_text('{"weight_map": ')
    assert refused(d) == (
        f"{index}: not valid JSON (Expecting value: line 1 column 16 (char 15)), so not a "
        f"safetensors index; the file is damaged: {AGAIN}")
    index.write_text('{"metadata": {"total_size": 1}}')
    assert refused(d) == (f"{index}: no \"weight_map\" object (tensor name -> shard file name) "
                          f"as save_pretrained writes; {AGAIN}")


def test_a_shard_the_index_names_is_missing_or_cut(saved, tmp_path):
    d = copy_of(saved, "sharded", tmp_path)
    index = d / "model.safetensors.index.json"
    shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    assert len(shards) > 1
    size = (d / shards[0]).stat().st_size
    cut(d / shards[0], size - 1)
    assert refused(d) == (f"{d / shards[0]}: truncated safetensors file ({size - 1} bytes; its "
                          f"tensors need {size}); {AGAIN}")
    os.remove(d / shards[-1])
    assert refused(d) == (
        f"{index} names the shard {shards[-1]!r}, which is not in {d}; copy every shard the "
        f"index names into the directory, or {AGAIN}")


def test_an_index_that_maps_a_tensor_to_the_wrong_shard(saved, tmp_path):
    d = copy_of(saved, "sharded", tmp_path)
    index = d / "model.safetensors.index.json"
    content = json.loads(index.read_text())
    shards = sorted(set(content["weight_map"].values()))
    key = next(k for k, v in sorted(content["weight_map"].items()) if v != shards[0])
    content["weight_map"][key] = shards[0]
    index.write_text(json.dumps(content))
    assert refused(d) == (
        f"{index} maps {key!r} to {d / shards[0]}, which does not contain it (the index and "
        f"the shards are from different checkpoints?); {AGAIN}")
