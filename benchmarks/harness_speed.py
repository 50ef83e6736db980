"""lm-evaluation-harness requests per second: ``HarnessLM`` (JAX) vs ``lm_eval --model hf`` (PyTorch).

One random-weight ``GPT2LMHeadModel`` is saved with a small GPT-2 BPE tokenizer (the test
suite's, 701 ids, trained offline on a few stdlib modules) into a temporary directory; both
backends load that directory in float32: ours with ``HarnessLM.from_dir``, the harness's own
with ``lm_eval.models.huggingface.HFLM(pretrained=DIR, dtype="float32", device="cpu")``, the
same ``--batch-size`` on both. The requests are those of two offline tasks
(``transformer_jax.data.harness_tasks``): ``stdlib_choice``'s loglikelihood requests (a
docstring line and four module names) and ``stdlib_rolling``'s loglikelihood_rolling
requests (whole docstrings, several windows each).

Timing: one warm-up call each (ours compiles there: one program per padded length), then
``--rounds`` rounds alternating the two (``common.alternate``). requests/s = requests /
median wall time of the whole call (tokenization, batching and the forwards). The answers
are checked to agree (1e-4 relative) before timing. The CPU model and vector ISA go with
the results.

Results: a table on stdout and ``benchmarks/results/harness_speed.{json,md}``.

Usage::

    python benchmarks/harness_speed.py           # the gpt2 shape (12 layers, width 768), 3 rounds
    python benchmarks/harness_speed.py --quick   # 2 layers, width 128, 1 round
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):   # run as a script: the repository on the path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import common  # noqa: E402


def build_model(root: str, quick: bool, max_len: int) -> None:
    import torch
    import transformers

    from tests.tokenizer_dirs import gpt2_dir

    gpt2_dir(root)
    config = transformers.GPT2Config.from_pretrained(root)
    shape = dict(n_layer=2, n_embd=128, n_head=4) if quick else dict(n_layer=12, n_embd=768, n_head=12)
    config.update(dict(n_positions=max_len, **shape))
    torch.manual_seed(0)
    transformers.GPT2LMHeadModel(config).save_pretrained(root)


def requests(tasks_dir: str, limit: int):
    """(loglikelihood, loglikelihood_rolling) instances of the two offline tasks."""
    import json

    from lm_eval.api.instance import Instance

    def docs(name):
        with open(os.path.join(tasks_dir, f"{name}_test.jsonl"), encoding="utf-8") as f:
            return [json.loads(line) for line in f][:limit]

    pairs = [Instance("loglikelihood", doc, (f"Docstring: {doc['text']}\nModule:", " " + c), k)
             for k, doc in enumerate(docs("stdlib_choice")) for c in doc["choices"]]
    texts = [Instance("loglikelihood_rolling", doc, (doc["text"],), k)
             for k, doc in enumerate(docs("stdlib_rolling"))]
    return pairs, texts


def run(quick: bool, rounds: int, batch_size: int, max_len: int, limit: int) -> dict:
    common.setup_process()
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    from lm_eval.models.huggingface import HFLM

    from transformer_jax.data.harness_tasks import write_stdlib_tasks
    from transformer_jax.eval_harness import HarnessLM

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = os.path.join(tmp, "gpt2")
        build_model(model_dir, quick, max_len)
        pairs, texts = requests(write_stdlib_tasks(os.path.join(tmp, "tasks")), limit)
        ours = HarnessLM.from_dir(model_dir, batch_size=batch_size)
        theirs = HFLM(pretrained=model_dir, dtype="float32", device="cpu", batch_size=batch_size)
        rows, payload = [], {"machine": common.machine_info(), "batch_size": batch_size,
                             "max_len": max_len, "quick": quick, "kinds": {}}
        for kind, instances in (("loglikelihood", pairs), ("loglikelihood_rolling", texts)):
            calls = {"ours": lambda: getattr(ours, kind)(instances),
                     "hf": lambda: getattr(theirs, kind)(instances, disable_tqdm=True)}
            a, b = calls["ours"](), calls["hf"]()      # the warm-up, and the answers checked
            first = [x[0] if isinstance(x, tuple) else x for x in a]
            second = [x[0] if isinstance(x, tuple) else x for x in b]
            worst = max(abs(u - v) / max(1.0, abs(v)) for u, v in zip(first, second))
            assert worst < 1e-4, f"{kind}: the backends disagree by {worst:.3g} (relative)"
            times = common.alternate(calls, rounds=rounds, warmup=0)
            ratio = common.round_ratios(times["hf"], times["ours"])
            ours_rps = len(instances) / common.median(times["ours"])
            hf_rps = len(instances) / common.median(times["hf"])
            payload["kinds"][kind] = {"requests": len(instances), "times": times, "ratio": ratio,
                                      "ours_rps": ours_rps, "hf_rps": hf_rps,
                                      "max_rel_diff": worst}
            rows.append([kind, len(instances), f"{ours_rps:.1f}", f"{hf_rps:.1f}",
                         f"{ratio['median']:.2f} ({ratio['q1']:.2f}-{ratio['q3']:.2f})"])
    m = payload["machine"]
    shape = "2 layers, width 128" if quick else "12 layers, width 768 (gpt2)"
    payload["markdown"] = (
        f"GPT-2 {shape}, vocab 701, max_len {max_len}, batch {batch_size}, float32; "
        f"{m['cpu']} ({m['cpu_isa']}, {m['cpu_count']} cores), {m['date']}, load "
        f"{m['load_average_1_5_15min']}.\n\n"
        + common.md_table(["request", "n", "ours req/s", "hf req/s", "ours/hf speed (median, IQR)"],
                          rows))
    return payload


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a 2-layer model, 1 round")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-len", type=int, default=256)
    p.add_argument("--limit", type=int, default=24, help="documents per task")
    args = p.parse_args(argv)
    rounds = args.rounds or (1 if args.quick else 3)
    result = run(args.quick, rounds, args.batch_size, args.max_len, args.limit)
    common.report("harness_speed", "lm-evaluation-harness: HarnessLM vs lm_eval --model hf", result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
