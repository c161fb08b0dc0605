"""Run ``handformer.bench.attention_memory`` (see its docstring for what it measures)."""

from handformer.bench.attention_memory import main

if __name__ == "__main__":
    raise SystemExit(main())
