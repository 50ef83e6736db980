"""The tiny Llama and the requests the harness's mesh and dtype tests score (in the test
process and in tests/eval/mesh_worker.py alike)."""
import jax
import numpy as np


def tiny_llama():
    """``(module, params, tokenizer)``: llama-tiny (4 heads, 2 kv heads, width 64) at random
    weights, the byte tokenizer."""
    from transformer_jax.data import get_tokenizer
    from transformer_jax.models import GPT, GPTConfig

    module = GPT(GPTConfig.preset("llama-tiny", max_len=64))
    params = module.init(jax.random.PRNGKey(0), np.zeros((1, 8), np.int32))["params"]
    return module, jax.device_get(params), get_tokenizer("byte")


PAIRS = [("def f(x):", " return x"), ("import os", "\nimport sys"), ("Hello", " world"),
         ("a", " b c d e"), ("The quick", " brown fox")]
TEXTS = ["Text wrapping and filling. " * 6, "short"]
PROMPTS = ["def main(", "import"]


def answers(lm) -> dict:
    """The harness's three requests: loglikelihoods, rolling ones and greedy texts."""
    from lm_eval.api.instance import Instance

    return {"pairs": lm.loglikelihood([Instance("loglikelihood", {}, p, k)
                                       for k, p in enumerate(PAIRS)]),
            "texts": lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (t,), k)
                                               for k, t in enumerate(TEXTS)]),
            "prompts": lm.generate_until([Instance("generate_until", {},
                                                   (p, {"until": ["\n"], "max_gen_toks": 4}), k)
                                          for k, p in enumerate(PROMPTS)])}
