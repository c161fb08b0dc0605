"""Run ``handformer.bench.tokenizer_throughput`` (see its docstring for what it measures)."""

from handformer.bench.tokenizer_throughput import main

if __name__ == "__main__":
    raise SystemExit(main())
