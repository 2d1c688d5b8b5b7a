"""One-off measurements behind figures in BENCHMARKS.md, each runnable as `python benchmarks/studies/NAME.py` or
`python -m gyre.benchmarks.studies.NAME`; tests import them as modules."""

__all__: list[str] = []
