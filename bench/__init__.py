"""The benchmarks and measurement scripts, beside the results they wrote (bench/results/). Each script's docstring
says how it runs (`python bench/NAME.py ...` or `python -m bench.NAME ...` from the repository's root) and what it
measures; docs/benchmarks.md quotes the numbers. Not part of the package. Result files written before 2026-12-06
record the scripts' earlier place, `tools/` (`python tools/NAME.py` there is `python bench/NAME.py` now).
"""
