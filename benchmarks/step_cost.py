"""Run ``handformer.bench.step_cost`` (see its docstring for what it measures)."""

from handformer.bench.step_cost import main

if __name__ == "__main__":
    raise SystemExit(main())
