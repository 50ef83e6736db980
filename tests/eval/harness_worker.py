"""One process of the two-process harness test (tests/eval/test_harness.py): started twice,
with ``ADDRESS PROCESS_ID MODEL_DIR REQUESTS_JSON``. Process 0 scores the requests (and
generates) through :class:`HarnessLM` and prints the answers as one JSON line; process 1
follows it."""
import json
import sys

import jax

from transformer_jax.train import distributed


def main(address: str, process_id: int, model_dir: str, requests_json: str) -> None:
    distributed.initialize(address, 2, process_id)
    from lm_eval.api.instance import Instance

    from transformer_jax.eval_harness import HarnessLM

    lm = HarnessLM.from_dir(model_dir, batch_size=3)
    assert jax.device_count() == 2 * jax.local_device_count()
    if jax.process_index() != 0:
        lm.follow()
        return
    requests = json.loads(requests_json)
    pairs = [Instance("loglikelihood", {}, tuple(r), k) for k, r in enumerate(requests["pairs"])]
    texts = [Instance("loglikelihood_rolling", {}, (t,), k) for k, t in enumerate(requests["texts"])]
    prompts = [Instance("generate_until", {}, (p, {"until": ["\n"], "max_gen_toks": 5}), k)
               for k, p in enumerate(requests["prompts"])]
    try:
        out = {"pairs": lm.loglikelihood(pairs), "texts": lm.loglikelihood_rolling(texts),
               "prompts": lm.generate_until(prompts), "forwards": lm.forwards}
    finally:
        lm.stop_followers()
    print(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4])
