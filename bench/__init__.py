"""The benchmarks and measurement scripts, beside the results they wrote (bench/results/). Each script's docstring
says how it runs (`python bench/NAME.py ...` or `python -m bench.NAME ...` from the repository's root) and what it
measures; docs/benchmarks.md and docs/design.md quote the numbers. Not part of the package. Result files written
before 2026-12-06 record the scripts' earlier place, `tools/` (`python tools/bench.py` is now `python bench/bench.py`).
"""
