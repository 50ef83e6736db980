"""``python -m benchmarks [--quick] ...``: the whole suite (``benchmarks/run_all.py``)."""
import sys

from benchmarks.run_all import main

sys.exit(main())
