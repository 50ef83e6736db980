"""The benchmark suite: ``python -m benchmarks`` (see ``benchmarks/run_all.py``)."""
