"""Run ``handformer.bench.speculative_speed`` (see its docstring for what it measures)."""

from handformer.bench.speculative_speed import main

if __name__ == "__main__":
    raise SystemExit(main())
