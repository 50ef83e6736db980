"""Three small lm-evaluation-harness tasks built offline from the standard library's docstrings.

``write_stdlib_tasks(DIR)`` writes JSONL documents and one task YAML per task into ``DIR``;
``transformer-jax eval --tasks stdlib_choice,stdlib_rolling,stdlib_generate --include-path DIR``
then runs them without a network. One task of each kind the harness asks a model for:

* ``stdlib_choice`` (multiple_choice; acc, acc_norm): the first line of a module's docstring,
  and four module names to choose from (``loglikelihood``).
* ``stdlib_rolling`` (loglikelihood_rolling; word_perplexity, byte_perplexity,
  bits_per_byte): whole docstrings, a few longer than a small model's context.
* ``stdlib_generate`` (generate_until; exact_match): a module name; the answer is the first
  word of its docstring, generation stops at a newline or a full stop.

The documents come from the running interpreter's source files (read, never imported), so
they can differ between Python versions; both backends a comparison runs read the same files.
The docstrings are split in two: ``train`` (few-shot examples) and ``test``.
"""
from __future__ import annotations

import ast
import json
import os
import sysconfig

#: modules whose docstrings make the documents (plain files in CPython 3.10 - 3.13)
MODULES = ("textwrap", "string", "shlex", "csv", "fnmatch", "glob", "heapq", "bisect", "copy",
           "difflib", "gettext", "base64", "calendar", "configparser", "contextlib", "dataclasses",
           "decimal", "fractions", "functools", "getopt", "hashlib", "hmac", "inspect",
           "keyword", "linecache", "locale", "numbers", "operator", "optparse", "pickle",
           "pprint", "queue", "quopri", "random", "reprlib", "sched", "secrets", "selectors",
           "shutil", "socket", "statistics", "stringprep", "tempfile", "threading", "timeit",
           "tokenize", "traceback", "types", "uuid", "warnings", "weakref", "zipimport")
TASKS = ("stdlib_choice", "stdlib_rolling", "stdlib_generate")
ROLLING_CHARS = 3000      # a rolling document's longest text


def docstrings(modules=MODULES) -> dict[str, str]:
    """module name -> its docstring (modules without one left out)."""
    root = sysconfig.get_paths()["stdlib"]
    out = {}
    for name in modules:
        with open(os.path.join(root, f"{name}.py"), encoding="utf-8") as f:
            doc = ast.get_docstring(ast.parse(f.read()))
        if doc and doc.split()[0].strip(".,:"):
            out[name] = doc.strip()
    return out


def _documents(docs: dict[str, str]) -> dict[str, list[dict]]:
    names = sorted(docs)
    choice, rolling, gen = [], [], []
    for k, name in enumerate(names):
        first = " ".join(docs[name].splitlines()[0].split())
        others = [names[(k + j * 7) % len(names)] for j in (1, 2, 3)]
        answer = k % 4
        options = others[:answer] + [name] + others[answer:]
        choice.append({"text": first, "choices": options, "answer": answer})
        rolling.append({"text": docs[name][:ROLLING_CHARS]})
        gen.append({"module": name, "answer": docs[name].split()[0].strip(".,:")})
    return {"stdlib_choice": choice, "stdlib_rolling": rolling, "stdlib_generate": gen}


_YAML = {
    "stdlib_choice": """output_type: multiple_choice
doc_to_text: "Docstring: {{{{text}}}}\\nModule:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
  - metric: acc_norm
""",
    "stdlib_rolling": """output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
""",
    "stdlib_generate": """output_type: generate_until
doc_to_text: "Module {{{{module}}}}. Its docstring begins with the word:"
doc_to_target: "{{{{answer}}}}"
target_delimiter: " "
generation_kwargs:
  until: ["\\n", "."]
  max_gen_toks: 8
  do_sample: false
metric_list:
  - metric: exact_match
    ignore_case: true
    ignore_punctuation: true
""",
}


def write_stdlib_tasks(directory: str | os.PathLike) -> str:
    """Write the three tasks (JSONL + YAML) into ``directory``; returns it (``--include-path``)."""
    directory = os.path.abspath(os.fspath(directory))
    os.makedirs(directory, exist_ok=True)
    docs = _documents(docstrings())
    for task, rows in docs.items():
        split = {"train": rows[: len(rows) // 4], "test": rows[len(rows) // 4:]}
        files = {}
        for name, part in split.items():
            files[name] = os.path.join(directory, f"{task}_{name}.jsonl")
            with open(files[name], "w", encoding="utf-8") as f:
                f.writelines(json.dumps(row) + "\n" for row in part)
        head = (f"task: {task}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                f"    train: {json.dumps(files['train'])}\n    test: {json.dumps(files['test'])}\n"
                "training_split: train\ntest_split: test\nfewshot_split: train\n")
        with open(os.path.join(directory, f"{task}.yaml"), "w", encoding="utf-8") as f:
            f.write(head + _YAML[task].format() + "metadata:\n  version: 1.0\n")
    return directory


if __name__ == "__main__":   # python -m transformer_jax.data.harness_tasks DIR
    import sys

    print(write_stdlib_tasks(sys.argv[1] if len(sys.argv) > 1 else "runs/stdlib_tasks"))
