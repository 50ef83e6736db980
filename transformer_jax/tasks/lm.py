"""Language modelling: packed next-token prediction on a TFDS text dataset."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from .. import data as data_lib
from ..decode import generate
from ..errors import UserError
from ..losses import lm_loss
from .base import Task, register_task


@register_task
class LMTask(Task):
    """Decoder-only LM. Options: none (tokenizer, dataset and lengths are config fields)."""
    name = "lm"
    OPTIONS = {}
    loss_fn = staticmethod(lm_loss)
    ID_FIELDS = {"inputs": "vocab_size", "targets": "vocab_size"}

    def __init__(self, cfg, workdir, *, spec=None):
        super().__init__(cfg, workdir, spec=spec)
        self.tokenizer, self.tokenizer_spec = self._tokenizer(spec)

    def _tokenizer(self, spec):
        if spec is not None:
            return data_lib.get_tokenizer(spec["tokenizer"]), spec["tokenizer"]
        cfg = self.cfg
        if cfg.tokenizer == "sentencepiece":
            path = self.workdir / "spm.model"
            if not path.exists():
                texts = data_lib.load_texts(cfg.dataset, "train", data_dir=cfg.data_dir,
                                            max_documents=200_000)
                data_lib.train_sentencepiece(texts, cfg.sentencepiece_vocab_size, str(path))
            spec_str = f"sentencepiece:{path}"   # absolute, or gs://
        else:
            spec_str = cfg.tokenizer
        return data_lib.get_tokenizer(spec_str), spec_str

    def spec(self) -> dict:
        return {"tokenizer": self.tokenizer_spec}

    def model_overrides(self) -> dict:
        return {"vocab_size": self.tokenizer.vocab_size}

    def make_iterator(self, split, process_index, process_count, *, train: bool):
        cfg = self.cfg
        return data_lib.make_lm_iterator(
            cfg.dataset, split, tokenizer=self.tokenizer, seq_len=cfg.seq_len,
            batch_size=cfg.batch_size, seed=cfg.seed, shuffle=train, repeat=train,
            data_dir=cfg.data_dir, process_index=process_index, process_count=process_count)

    def init_args(self):
        return (jnp.zeros((1, self.cfg.seq_len), jnp.int32),)

    def sample(self, model, params, step):
        if self.cfg.sample_tokens <= 0:
            return None
        return self.generate_text(model, params, self.cfg.sample_prompt,
                                  max_new_tokens=self.cfg.sample_tokens, seed=step)

    def generate_text(self, model, params, prompt, *, max_new_tokens=128, temperature=0.8,
                      top_k=40, top_p=None, seed=0) -> str:
        tok = self.tokenizer
        ids = tok.encode(prompt) or [tok.eos_id]
        self.check_prompt_ids([ids], model.config)       # before anything is compiled
        room = model.config.max_len - len(ids)
        if room < 1:
            raise UserError(f"the prompt is {len(ids)} tokens; the model's max_len is {model.config.max_len}")
        out = generate(model, params, [ids], max_new_tokens=min(max_new_tokens, room),
                       temperature=temperature, top_k=top_k or None, top_p=top_p,
                       rng=jax.random.PRNGKey(seed), eos_id=tok.eos_id)
        return tok.decode(out[0])
