"""PyTorch twins of a training run's parts: the model, the loss, AdamW's parameter groups and
the learning-rate schedule, as a PyTorch user writes them (``transformer-jax compare-torch``).

Nothing here calls this library's training code: the schedules are the ``LambdaLR`` lambdas
of the PyTorch recipes, in float64 Python; the loss is ``torch.nn.functional.cross_entropy``
with its own ``label_smoothing``; the optimizer is ``torch.optim.AdamW`` with
``clip_grad_norm_``. Only the weights come from here, through the converters (``to_hf`` and
``to_torch_state_dict``), so that both sides start from the same numbers.

torch is imported inside the functions: ``import transformer_jax`` never imports it.

Shapes: B batch, S source length, T target length, D width, V vocabulary (or classes).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Mapping

import numpy as np

from ..errors import UserError
from .common import flatten_params, unflatten_params

__all__ = ["lr_lambda", "TorchRecipe", "hf_twin", "transformer_twin", "transformer_state_dict",
           "decayed_names", "mask_like", "cross_entropy_sum", "train_step"]


# ----------------------------------------------------------------------------- schedules

def _noam_factor(d_model: int, warmup_steps: int) -> Callable[[int], float]:
    """The 2017 paper's rate, as the PyTorch tutorials write it: ``d_model ** -0.5 *
    min(s ** -0.5, s * warmup ** -1.5)`` with ``s = max(step, 1)``."""
    def factor(step: int) -> float:
        s = max(step, 1)
        return d_model ** -0.5 * min(s ** -0.5, s * warmup_steps ** -1.5)
    return factor


def lr_lambda(name: str, **kwargs: Any) -> tuple[float, Callable[[int], float]]:
    """``(base_lr, lambda)`` for ``LambdaLR(AdamW(..., lr=base_lr), lambda)``: the PyTorch twin
    of ``train.optim.make_schedule(name, **kwargs)`` (the same keyword arguments). The rate of
    update ``k`` (0-based, ``scheduler.step()`` after each ``optimizer.step()``) is
    ``base_lr * lambda(k)``."""
    if name == "noam":
        return kwargs.get("scale", 1.0), _noam_factor(kwargs["d_model"], kwargs["warmup_steps"])
    if name == "warmup_cosine":
        peak, warm, total = kwargs["peak_lr"], kwargs["warmup_steps"], kwargs["total_steps"]
        end, init = kwargs.get("end_lr", 0.0), kwargs.get("init_lr", 0.0)

        def factor(step: int) -> float:
            if step < warm:
                return (init + (peak - init) * step / warm) / peak
            t = min(step - warm, total - warm) / (total - warm)
            return (end + (peak - end) * 0.5 * (1 + math.cos(math.pi * t))) / peak
        return peak, factor
    if name == "warmup_times_cosine":
        peak, warm, total = kwargs["peak_lr"], kwargs["warmup_steps"], kwargs["total_steps"]

        def factor(step: int) -> float:
            step = min(step, total)
            ramp = 1.0 if warm == 0 else min(step / warm, 1.0)
            return ramp * 0.5 * (1 + math.cos(math.pi * step / total))
        return peak, factor
    if name == "warmup_rsqrt":
        peak, warm = kwargs["peak_lr"], kwargs["warmup_steps"]
        return peak, lambda step: step / warm if step < warm else math.sqrt(warm / step)
    if name == "constant":
        warm = kwargs.get("warmup_steps", 0)
        return kwargs["lr"], lambda step: step / warm if step < warm else 1.0
    raise UserError(f"no PyTorch LambdaLR twin for the schedule {name!r}")


# ----------------------------------------------------------------------------- the recipe

@dataclasses.dataclass(frozen=True)
class TorchRecipe:
    """How the PyTorch side trains: AdamW over ``param_groups`` (weight decay on ``decayed``
    names only), ``LambdaLR(base_lr, factor)``, ``clip_grad_norm_(clip_norm)`` (None: no
    clipping), ``accum_steps`` micro-batches whose summed losses are divided by the batch's
    whole weight, and ``cross_entropy(..., label_smoothing)``."""
    base_lr: float
    factor: Callable[[int], float]
    b1: float
    b2: float
    eps: float
    weight_decay: float
    clip_norm: float | None
    label_smoothing: float
    accum_steps: int
    decayed: frozenset

    def optimizer(self, model) -> tuple[Any, Any]:
        """``(AdamW, LambdaLR)`` over ``model``'s parameters, in two groups."""
        import torch

        named = dict(model.named_parameters())       # tied weights appear once
        unknown = sorted(self.decayed - set(named))
        if unknown:
            raise ValueError(f"decayed names that are not parameters: {unknown[:4]}")
        groups = [{"params": [p for n, p in named.items() if n in self.decayed],
                   "weight_decay": self.weight_decay},
                  {"params": [p for n, p in named.items() if n not in self.decayed],
                   "weight_decay": 0.0}]
        opt = torch.optim.AdamW([g for g in groups if g["params"]], lr=self.base_lr,
                                betas=(self.b1, self.b2), eps=self.eps)
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, self.factor)


# ----------------------------------------------------------------------------- models

def _check_no_dropout(model, hf_config=None) -> None:
    """The twin must not drop anything: every ``nn.Dropout`` at p=0, and the HF attention
    dropout rates (applied as functions, not modules) 0."""
    import torch

    active = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Dropout) and m.p]
    if hf_config is not None:
        active += [k for k, v in hf_config.to_dict().items()
                   if ("attn" in k or "attention" in k) and ("dropout" in k or "pdrop" in k)
                   and isinstance(v, (int, float))
                   and not isinstance(v, bool) and v]
    if active:
        raise ValueError(f"the PyTorch twin still drops out: {active[:4]}")


def hf_twin(module: Any, params: Mapping[str, Any], architecture: str):
    """The ``transformers`` model ``architecture`` (e.g. "GPT2LMHeadModel") of ``module``'s
    config, holding ``params`` (strict: every key and shape), in train mode."""
    import transformers

    from .hf import hf_config, to_hf

    config = hf_config(module.config)
    model = getattr(transformers, architecture)(config)
    model.load_state_dict(to_hf(module, params), strict=True)
    _check_no_dropout(model, config)
    return model.float().train()


def _transformer_mirrors(config: Any):
    """The ``torch.nn.TransformerEncoder``/``Decoder`` mirrors of ``models.transformer``'s stacks."""
    import jax.numpy as jnp

    from .torch_nn.modules import TorchTransformerDecoder, TorchTransformerEncoder

    stack = dict(num_heads=config.num_heads, mlp_dim=config.mlp_features,
                 activation=config.activation, pre_norm=config.pre_norm,
                 norm_eps=config.norm_eps, final_norm=config.has_final_norm,
                 final_norm_eps=config.norm_eps, batch_first=True, dtype=jnp.float32)
    return (TorchTransformerEncoder(**stack, num_layers=config.num_layers),
            TorchTransformerDecoder(**stack, num_layers=config.decoder_layers))


def transformer_state_dict(module: Any, params: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """``models.transformer`` params -> :func:`transformer_twin`'s state dict."""
    from .torch import to_torch_state_dict

    config = module.config
    if config.scan_layers:
        raise UserError("model.scan_layers=True: the PyTorch twin of the Transformer loops over "
                        "its layers; compare with --set model.scan_layers=false (the same model)")
    encoder, decoder = _transformer_mirrors(config)
    out = {"embed.weight": np.asarray(params["embed"]["embedding"])}
    for name, mirror in (("encoder", encoder), ("decoder", decoder)):
        for key, value in to_torch_state_dict(mirror, params[name]).items():
            out[f"{name}.{key}"] = value
    if not config.tie_embeddings:
        out["lm_head.weight"] = np.asarray(params["lm_head"]["kernel"]).T
    return out


def _activation(name: str):
    import torch.nn.functional as F

    return {"relu": "relu", "gelu": "gelu", "silu": F.silu, "tanh": F.tanh,
            "gelu_tanh": lambda x: F.gelu(x, approximate="tanh")}[name]


def transformer_twin(module: Any, params: Mapping[str, Any]):
    """The 2017 Transformer (``models.transformer``) written with ``torch.nn`` modules: a
    shared ``nn.Embedding`` times sqrt(D) plus the sinusoidal table, ``nn.TransformerEncoder``
    and ``nn.TransformerDecoder`` (batch first, final LayerNorms where the config has them),
    and the read-out ``x @ E^T`` (or an untied ``lm_head``). Called as HF's encoder-decoders
    are: ``forward(input_ids (B, S), attention_mask (B, S) 1 = token, decoder_input_ids (B, T))
    -> .logits (B, T, V)``."""
    import types

    import torch
    from torch import nn

    config = module.config

    class Seq2Seq(nn.Module):
        def __init__(self):
            super().__init__()
            d, v = config.d_model, config.vocab_size
            self.embed = nn.Embedding(v, d)
            # the table as the PyTorch tutorials compute it, in float32 (as this library does)
            position = torch.arange(config.max_len, dtype=torch.float32)[:, None]
            inv_freq = torch.exp(torch.arange(0, d, 2, dtype=torch.float32)
                                 * (-math.log(10000.0) / d))
            table = torch.zeros(config.max_len, d)
            table[:, 0::2] = torch.sin(position * inv_freq)
            table[:, 1::2] = torch.cos(position * inv_freq)
            self.register_buffer("pe", table, persistent=False)

            def layer(cls, n):
                one = cls(d, config.num_heads, config.mlp_features, dropout=0.0,
                          activation=_activation(config.activation),
                          layer_norm_eps=config.norm_eps, batch_first=True,
                          norm_first=config.pre_norm)
                norm = nn.LayerNorm(d, eps=config.norm_eps) if config.has_final_norm else None
                return one, n, norm
            one, n, norm = layer(nn.TransformerEncoderLayer, config.num_layers)
            self.encoder = nn.TransformerEncoder(one, n, norm=norm, enable_nested_tensor=False)
            one, n, norm = layer(nn.TransformerDecoderLayer, config.decoder_layers)
            self.decoder = nn.TransformerDecoder(one, n, norm=norm)
            if not config.tie_embeddings:
                self.lm_head = nn.Linear(d, v, bias=False)

        def _embed(self, ids):
            return self.embed(ids) * math.sqrt(config.d_model) + self.pe[: ids.shape[1]]

        def forward(self, input_ids, attention_mask, decoder_input_ids):
            padding = attention_mask == 0
            causal = nn.Transformer.generate_square_subsequent_mask(decoder_input_ids.shape[1],
                                                                    dtype=self.pe.dtype)
            memory = self.encoder(self._embed(input_ids), src_key_padding_mask=padding)
            x = self.decoder(self._embed(decoder_input_ids), memory, tgt_mask=causal,
                             tgt_is_causal=True, memory_key_padding_mask=padding)
            logits = x @ self.embed.weight.T if config.tie_embeddings else self.lm_head(x)
            return types.SimpleNamespace(logits=logits)

    model = Seq2Seq()
    state = {k: torch.from_numpy(np.array(v, np.float32))        # a writable copy
             for k, v in transformer_state_dict(module, params).items()}
    model.load_state_dict(state, strict=True)
    _check_no_dropout(model)
    return model.train()


# ----------------------------------------------------------------------------- weight decay

def decayed_names(model, state_dict: Mapping[str, np.ndarray]) -> frozenset:
    """The parameter names of ``model`` whose tensor in ``state_dict`` is all ones: the JAX
    decay mask (1.0 where decayed, 0.0 elsewhere) converted like the weights. A tensor that
    mixes both would take decay on part of it, which AdamW's groups cannot express."""
    decayed = set()
    for name, param in model.named_parameters():
        if name not in state_dict:
            raise ValueError(f"no decay mask for the parameter {name!r}")
        mask = np.asarray(state_dict[name])
        if mask.shape != tuple(param.shape):
            raise ValueError(f"decay mask {name!r} is {mask.shape}, the parameter "
                             f"{tuple(param.shape)}")
        if np.all(mask == 1.0):
            decayed.add(name)
        elif not np.all(mask == 0.0):
            raise ValueError(f"{name!r} is decayed in part only: no AdamW group expresses that")
    return frozenset(decayed)


def mask_like(params: Mapping[str, Any], decay: Mapping[str, Any]) -> dict[str, Any]:
    """The params tree with each leaf replaced by ones (decayed) or zeros (not)."""
    flat, flags = flatten_params(params), flatten_params(decay)
    return unflatten_params({path: np.full(np.shape(leaf), float(bool(flags[path])), np.float32)
                             for path, leaf in flat.items()})


# ----------------------------------------------------------------------------- the step

def cross_entropy_sum(logits, targets, weights, smoothing: float):
    """``(sum of weights x cross_entropy(logits, targets, label_smoothing), weight sum)``:
    logits (..., V) float32 (or float64: computed in it); targets (...) int, anything where
    the weight is 0."""
    import torch
    import torch.nn.functional as F

    dtype = torch.promote_types(logits.dtype, torch.float32)      # float32, or float64
    targets = torch.where(weights != 0, targets, torch.zeros_like(targets))
    per_token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).to(dtype),
                                targets.reshape(-1).long(), reduction="none",
                                label_smoothing=smoothing)
    w = weights.reshape(-1).to(dtype)
    return torch.sum(torch.where(w != 0, per_token * w, torch.zeros_like(per_token))), w.sum()


def train_step(model, optimizer, scheduler, recipe: TorchRecipe,
               forward: Callable[[Any, dict], tuple[Any, Any, Any]],
               batch: Mapping[str, np.ndarray]) -> dict[str, float]:
    """One update on ``batch`` (numpy, the whole batch): ``accum_steps`` micro-batches, each
    ``forward(model, micro_batch) -> (logits, targets, weights)``; the summed loss divided
    by the batch's weight; clipping; AdamW; the schedule. Returns ``loss``, ``grad_norm``
    (before clipping) and ``lr`` (the rate this update used)."""
    import torch

    lr = optimizer.param_groups[0]["lr"]
    optimizer.zero_grad(set_to_none=True)
    size = len(next(iter(batch.values())))
    micro = size // recipe.accum_steps
    total = max(float(np.sum(batch["weights"], dtype=np.float64)), 1.0)
    loss = 0.0
    for i in range(recipe.accum_steps):
        part = {k: torch.from_numpy(np.ascontiguousarray(v[i * micro:(i + 1) * micro]))
                for k, v in batch.items()}
        logits, targets, weights = forward(model, part)
        loss_sum, _ = cross_entropy_sum(logits, targets, weights, recipe.label_smoothing)
        (loss_sum / total).backward()
        loss += float(loss_sum.detach())
    params = list(model.parameters())
    for p in params:            # as in JAX, a parameter the loss does not reach gets zeros
        if p.grad is None:      # (and its weight decay), not a skipped update
            p.grad = torch.zeros_like(p)
    if recipe.clip_norm is None:
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad)
                                                     for p in params]))
    else:
        norm = torch.nn.utils.clip_grad_norm_(params, recipe.clip_norm)
    optimizer.step()
    scheduler.step()
    return {"loss": loss / total, "grad_norm": float(norm), "lr": float(lr)}
