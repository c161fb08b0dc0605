"""Run ``handformer.bench.race`` (see its docstring): whole ``handformer train`` commands
against a nanoGPT checkout's own ``train.py``, alternating, medians.

    python benchmarks/race_nanogpt.py --nanogpt ~/src/nanoGPT \\
        --data ../shared/data/tinyshakespeare.txt
"""

from handformer.bench.race import main

if __name__ == "__main__":
    raise SystemExit(main())
