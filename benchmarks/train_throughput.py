"""Run ``handformer.bench.train_throughput`` (see its docstring for what it measures)."""

from handformer.bench.train_throughput import main

if __name__ == "__main__":
    raise SystemExit(main())
