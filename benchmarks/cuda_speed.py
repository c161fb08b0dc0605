"""Run ``handformer.bench.cuda_speed`` (see its docstring for what it measures)."""

from handformer.bench.cuda_speed import main

if __name__ == "__main__":
    raise SystemExit(main())
