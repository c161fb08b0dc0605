"""Side-by-side measurements: each module prints a table and writes JSON.

Run one with ``python benchmarks/<name>.py`` (or ``python -m handformer.bench.<name>``), or
all of them with ``handformer bench``.
"""
