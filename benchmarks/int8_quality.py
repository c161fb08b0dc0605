"""Run ``handformer.bench.int8_quality`` (see its docstring for what it measures)."""

from handformer.bench.int8_quality import main

if __name__ == "__main__":
    raise SystemExit(main())
