"""The GPT cases of ``benchmarks/train.py``: train-step tokens/s and MFU vs HF GPT-2 (eager, torch.compile).

Kept as the short command for the GPT numbers; see ``benchmarks/train.py`` for the method.

Usage::

    python benchmarks/train_gpt.py            # default-experiment GPT and the 6L/384, V=8192 target
    python benchmarks/train_gpt.py --quick    # one small configuration
    python benchmarks/train_gpt.py --no-compile --rounds 9

Results: a markdown table on stdout and ``benchmarks/results/train_gpt.{json,md}``.
"""
from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import train  # noqa: E402


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    return train.main(["--families", "gpt", "--out", "train_gpt", *argv])


if __name__ == "__main__":
    sys.exit(main())
