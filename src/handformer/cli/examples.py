"""Examples for every ``handformer`` command's ``--help``, kept in one table.

``add_examples(parser)`` walks the parser tree built by ``handformer.cli.build_parser`` and
gives each command that has an entry in ``EXAMPLES`` an ``examples:`` epilog, printed line
for line (descriptions and option help are still wrapped as usual). The tests parse every
example line with the real parser, so an example that names a removed option fails CI.
"""

from __future__ import annotations

import argparse

__all__ = ["EXAMPLES", "ExamplesHelpFormatter", "add_examples", "iter_commands"]

# Command path (as typed after ``handformer``) → example lines: "command  # comment".
EXAMPLES: dict[str, tuple[str, ...]] = {
    "": (
        "handformer train --preset tiny --max-steps 100   # a seconds-long smoke run",
        "handformer generate --run runs/default --prompt \"The \"",
        "handformer doctor --preset tiny                  # the debugging checklist",
        "handformer VERB --help                           # each command's options and examples",
    ),
    "train": (
        "handformer train                                 # built-in text, runs/default, ~3 min",
        "handformer train --preset tiny --max-steps 100   # a seconds-long smoke run",
        "handformer train --data my_text.txt --out runs/mine --precision bf16",
        "handformer train --resume runs/mine              # continue from the newest checkpoint",
        "handformer train --out runs/mine --overwrite     # start afresh; keeps others' files",
        "handformer train --tokenizer bpe --vocab-size 2000 --out runs/bpe",
        "torchrun --standalone --nproc_per_node=2 -m handformer train --preset tiny --out runs/ddp",
        "torchrun --standalone --nproc_per_node=2 -m handformer train --strategy fsdp  # sharded",
        "handformer train --data tinyshakespeare.txt --preset shakespeare-fast   # val 1.88 fast",
        "handformer train --draft-for runs/default --out runs/default-draft   # a 2-layer draft",
        "handformer train --from runs/default --data more.txt --lora 8 --out runs/default-lora",
    ),
    "generate": (
        "handformer generate --run runs/default --prompt \"The \" --temperature 0.8 --top-k 20",
        "handformer generate --run runs/default --prompt-file prompts.txt --temperature 0",
        "handformer generate --run runs/default --interactive --max-new-tokens 100",
        "handformer generate --run runs/default --top-p 0.9 --repetition-penalty 1.2 --seed 0",
        "handformer generate --run runs/medium --draft runs/medium-draft --speculate 4 "
        "--temperature 0",
        "handformer generate --run runs/default --temperature 0 --quantize int8   # int8 weights",
    ),
    "classify": (
        "handformer classify train                        # built-in balanced-brackets task",
        "handformer classify predict --run runs/classify --text \"(()())\"",
    ),
    "classify train": (
        "handformer classify train                        # built-in task: chance is 50 %",
        "handformer classify train --data reviews.csv --text-col text --label-col label",
        "handformer classify train --pooling mean --positional rope --max-steps 300",
        "handformer classify train --from runs/minilm --data rows.csv --lora 8 --lr 1e-3",
    ),
    "classify predict": (
        "handformer classify predict --run runs/classify --text \"(()())\" --text \"(()\"",
        "handformer classify predict --run runs/classify --data val.csv --confusion cm.png",
    ),
    "seq2seq": (
        "handformer seq2seq train --task reverse",
        "handformer seq2seq predict --run runs/seq2seq-reverse --text 12345",
    ),
    "seq2seq train": (
        "handformer seq2seq train --task reverse          # writes runs/seq2seq-reverse",
        "handformer seq2seq train --task sort --max-steps 2000 --out runs/sort",
    ),
    "seq2seq predict": (
        "handformer seq2seq predict --run runs/seq2seq-reverse --text 12345 --text 908172",
    ),
    "doctor": (
        "handformer doctor                                # the default preset, freshly built",
        "handformer doctor --preset tiny --pictures doctor_pics/",
        "handformer doctor --run runs/default --json",
    ),
    "serve": (
        "handformer serve --run runs/default              # then http://127.0.0.1:8000/v1",
        "handformer serve --run runs/default --kv-blocks 256 --block-size 16 --max-batch 16",
        "handformer serve --run runs/qwen --host 0.0.0.0 --api-key KEY   # chat, reachable",
    ),
    "explore": (
        "handformer explore --run runs/default            # then open http://127.0.0.1:8765",
        "handformer explore --run runs/classify --port 0 --open",
    ),
    "embed": (
        "handformer embed \"A cat sits on the mat.\" \"There is a cat lying on a rug.\"",
        "handformer embed --json \"one\" \"two\"",
    ),
    "convert": (
        "handformer convert --to hf runs/default out/hf   # pipeline('text-generation', ...)",
        "handformer convert --from hf some/gpt2-folder runs/imported",
        "handformer convert --to onnx runs/default out/lm.onnx           # ids → logits",
        "handformer convert --to onnx --with-cache runs/default out/lm-cached.onnx",
        "handformer convert --quantize int8 runs/default runs/default-int8   # int8 run folder",
        "handformer convert --merge-lora runs/default-lora runs/default-merged   # LoRA folded in",
    ),
    "bench": (
        "handformer bench --quick                         # all benchmarks, tiny sizes",
        "handformer bench --only generation --only attention",
    ),
    "experiment": (
        "handformer experiment length --quick",
    ),
    "experiment length": (
        "handformer experiment length                     # ~13 min on 2 cores",
        "handformer experiment length --quick --out runs/length-quick",
    ),
}


class ExamplesHelpFormatter(argparse.HelpFormatter):
    """The default formatter, except that an ``examples:`` block keeps its lines."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        if text.startswith("examples:"):
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)


def iter_commands(parser: argparse.ArgumentParser, path: str = ""
                  ) -> list[tuple[str, argparse.ArgumentParser]]:
    """``(path, parser)`` for the root and every sub-command, depth first (``"classify
    train"``)."""
    found = [(path, parser)]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found += iter_commands(sub, f"{path} {name}".strip())
    return found


def add_examples(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Attach ``EXAMPLES`` as epilogs to ``parser`` and its sub-commands; returns ``parser``."""
    for path, sub in iter_commands(parser):
        lines = EXAMPLES.get(path)
        if lines:
            sub.epilog = "examples:\n" + "\n".join("  " + line for line in lines)
            sub.formatter_class = ExamplesHelpFormatter
    return parser
