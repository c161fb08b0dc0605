"""Run ``handformer.bench.finetune`` (see its docstring for what it measures)."""

from handformer.bench.finetune import main

if __name__ == "__main__":
    raise SystemExit(main())
