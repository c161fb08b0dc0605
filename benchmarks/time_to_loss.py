"""Run ``handformer.bench.time_to_loss`` (see its docstring for what it measures)."""

from handformer.bench.time_to_loss import main

if __name__ == "__main__":
    raise SystemExit(main())
