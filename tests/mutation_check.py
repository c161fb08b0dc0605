"""How strong is the suite? Inject known bugs, one at a time, and check the tests catch each.

Each mutant is a one-spot edit of the package (an exact snippet replaced by a wrong one) and
the test files that should notice it. For every mutant the package is copied to a
temporary folder, the edit is applied there (the working tree is never touched), and those
tests run against the copy; the mutant is *caught* when they fail. A baseline run of the
same tests on the unmutated copy must pass first, or "caught" would mean nothing.

The list starts from bugs that once slipped past the suite (RoPE applied to queries only, a
dropped final LayerNorm, fused kernels never compared with the reference, ``<unk>``
silently dropped, an explorer crop keeping the wrong end, a run folder with missing
tensors, a classifier whose weights never train) and adds classic Transformer bugs (causal
mask flipped, padding counted in the loss, no 1/√D). Add a mutant whenever a bug escapes.

    python tests/mutation_check.py            # all mutants (a few minutes on 2 cores)
    python tests/mutation_check.py rope_q_only final_norm_dropped
    python tests/mutation_check.py --list

Prints a table and exits 1 if any mutant survived (or a baseline failed).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Mutant:
    name: str
    file: str  # relative to src/handformer
    before: str  # must occur exactly once in the file
    after: str
    tests: tuple[str, ...]  # pytest node ids or files, relative to the repository root
    why: str


MUTANTS: tuple[Mutant, ...] = (
    Mutant(
        "rope_q_only", "nn/attention.py",
        "k = self.rotary(k, positions)  # type: ignore[misc]",
        "k = k  # type: ignore[misc]",
        ("tests/nn/test_positional.py",),
        "RoPE rotates the queries but not the keys: relative positions are lost",
    ),
    Mutant(
        "final_norm_dropped", "models/decoder_lm.py",
        "self.final_norm(x)",
        "x",
        ("tests/models/test_decoder_lm.py",),
        "a pre-norm decoder without its final LayerNorm",
    ),
    Mutant(
        "tiled_output_doubled", "nn/tiled_attention.py",
        "    return _TiledAttention.apply(q, k, v, mask, bias, is_causal, scale, block)",
        "    return 2 * _TiledAttention.apply(q, k, v, mask, bias, is_causal, scale, block)",
        ("tests/nn/test_attention.py",),
        "the tiled kernel's output is wrong; only the manual kernel was ever compared",
    ),
    Mutant(
        "no_sqrt_d", "nn/attention.py",
        "scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale",
        "scale = 1.0 if scale is None else scale",
        ("tests/nn/test_attention.py",),
        "scores not scaled by 1/√D in the reference kernel",
    ),
    Mutant(
        "sdpa_drops_the_mask", "nn/attention.py",
        "        attn_mask = mask\n",
        "        attn_mask = None\n",
        ("tests/nn/test_attention.py",),
        "the fused kernel ignores padding (and end-aligned causal) masks",
    ),
    Mutant(
        "cached_key_mask_dropped", "models/decoder_lm.py",
        "mask = combine_masks(cache.key_mask[:, :end]) if cache.has_padding else None",
        "mask = None",
        ("tests/test_generate.py",),
        "cached decoding forgets that a left-padded prompt's padding must not be attended",
    ),
    Mutant(
        "step_positions_restart", "nn/kv_cache.py",
        "            positions = self.next_position[:, None].clone()  # (B, 1)",
        "            positions = torch.zeros_like(self.next_position[:, None])  # (B, 1)",
        ("tests/test_generate.py",),
        "each cached step gets position 0 instead of continuing after the prompt",
    ),
    Mutant(
        "causal_mask_flipped", "masks.py",
        "    return cols <= rows  # (T, S)",
        "    return cols >= rows  # (T, S)",
        ("tests/test_masks.py",),
        "the causal mask lets queries see the future instead of the past",
    ),
    Mutant(
        "padding_in_loss", "loss.py",
        "    count = (flat_targets != IGNORE_INDEX).sum().clamp(min=1)",
        "    count = flat_targets.numel()",
        ("tests/models/test_decoder_lm.py", "tests/doctor/test_doctor_zoo.py"),
        "padding positions count in the LM loss's average",
    ),
    Mutant(
        "unk_dropped", "tokenizers.py",
        "        ids = self.encode_array(text, unknown=unknown).tolist()",
        "        ids = [i for i in self.encode_array(text, unknown=unknown).tolist()"
        " if i != self.unk_id]",
        ("tests/test_generate.py", "tests/test_tokenizers.py"),
        "characters outside the vocabulary vanish instead of becoming <unk>",
    ),
    Mutant(
        "explore_crop_keeps_first", "explore/prompts.py",
        "        ids = ids[-room:] if keep == \"last\" else ids[:room]",
        "        ids = ids[:room]",
        ("tests/explore/test_explore_api.py",),
        "the explorer crops a long prompt to its first tokens, not its last",
    ),
    Mutant(
        "run_folder_drops_a_tensor", "runs/files.py",
        "        load_model(model, path, strict=True, device=device)",
        "        load_model(model, path, strict=False, device=device)\n"
        "        next(iter(model.parameters())).data.zero_()",
        ("tests/cli/test_cli.py", "tests/runs/test_runs.py"),
        "a run folder loads although a tensor is missing or wrong",
    ),
    Mutant(
        "only_biases_train", "train/optim.py",
        "groups = [{\"params\": decay, \"weight_decay\": weight_decay},\n",
        "groups = [\n",
        ("tests/train/test_trainer_engine.py",),
        "the optimizer drops every weight matrix: only biases and gains train",
    ),
    Mutant(
        "capture_leaves_a_wrapper", "capture.py",
        "                del module.forward",
        "                pass",
        ("tests/test_capture.py",),
        "the attention capture leaves its wrapper on the model",
    ),
    Mutant(
        "speculation_resamples_from_p", "generate/speculative.py",
        "residual = (p[:, :k] - draft_probs).clamp(min=0)  # (B, K, V)",
        "residual = p[:, :k].clone()  # (B, K, V)",
        ("tests/generate/test_speculative.py",),
        "a rejected proposal is replaced by a sample of p, not of max(0, p - q): the draft's "
        "favourites come out too often",
    ),
    Mutant(
        "truncate_keeps_positions", "nn/kv_cache.py",
        "self.next_position.copy_(kept.sum(dim=1))",
        "self.next_position.copy_(self.next_position)",
        ("tests/nn/test_kv_cache.py",),
        "a rolled-back cache keeps counting positions from the rejected tokens",
    ),
    Mutant(
        "int8_scale_dropped", "nn/quantized.py",
        "return F.linear(x, q.to(x.dtype)) * scale.to(x.dtype)  # (..., N)",
        "return F.linear(x, q.to(x.dtype))  # (..., N)",
        ("tests/nn/test_quantized.py",),
        "the int8 product forgets the per-channel scale",
    ),
    Mutant(
        "int8_streams_interleaved", "nn/quantized.py",
        "out = torch.stack(columns, dim=1).view(x.shape[0], n)",
        "out = torch.stack(columns, dim=0).view(x.shape[0], n)",
        ("tests/nn/test_quantized.py",),
        "the fused int8 kernel puts its two weight streams' outputs in the wrong rows",
    ),
)


def run_tests(src: Path, tests: tuple[str, ...], timeout: float) -> tuple[bool, float]:
    """True when the tests pass against the package in ``src``; and the seconds taken."""
    env = {**os.environ, "PYTHONPATH": str(src), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
           "-m", "not slow", *tests]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout)
        passed = proc.returncode == 0
    except subprocess.TimeoutExpired:
        passed = False  # a hang is caught too (by the suite's time budget)
    return passed, time.perf_counter() - start


def apply(mutant: Mutant, package: Path) -> None:
    path = package / mutant.file
    text = path.read_text(encoding="utf-8")
    count = text.count(mutant.before)
    if count != 1:
        raise SystemExit(f"mutant {mutant.name}: the snippet occurs {count} times in "
                         f"{mutant.file} (expected once); update the mutant to the code")
    path.write_text(text.replace(mutant.before, mutant.after), encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="mutants to run (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutants and stop")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per test run")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTANTS if not args.names or m.name in args.names]
    unknown = set(args.names) - {m.name for m in MUTANTS}
    if unknown:
        parser.error(f"unknown mutants {sorted(unknown)}; --list shows them")
    if args.list:
        for m in chosen:
            print(f"{m.name:28} {m.file:24} {m.why}")
        return 0

    failures = 0
    rows = []
    with tempfile.TemporaryDirectory(prefix="handformer-mutants-") as tmp:
        for m in chosen:
            src = Path(tmp) / m.name / "src"
            shutil.copytree(ROOT / "src", src, ignore=shutil.ignore_patterns(
                "__pycache__", "*.egg-info"))
            ok, _ = run_tests(src, m.tests, args.timeout)
            if not ok:
                rows.append((m.name, "BASELINE FAILS", 0.0, m.tests))
                failures += 1
                continue
            apply(m, src / "handformer")
            passed, seconds = run_tests(src, m.tests, args.timeout)
            verdict = "survived" if passed else "caught"
            failures += passed
            rows.append((m.name, verdict, seconds, m.tests))
            print(f"{m.name:28} {verdict:15} {seconds:6.1f} s   {' '.join(m.tests)}",
                  flush=True)
    caught = sum(r[1] == "caught" for r in rows)
    print(f"\n{caught} of {len(rows)} mutants caught")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
