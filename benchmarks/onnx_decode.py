"""Run ``handformer.bench.onnx_decode`` (see its docstring for what it measures)."""

from handformer.bench.onnx_decode import main

if __name__ == "__main__":
    raise SystemExit(main())
