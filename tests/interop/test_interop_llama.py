"""Llama and Qwen3 by hand, against transformers' own classes: random-initialised
``LlamaForCausalLM`` / ``Qwen3ForCausalLM`` built from the *published* config values of small
real checkpoints (widths, heads, head_dim, RoPE θ and scaling, norm ε, tying as published;
depth and vocabulary cut so each test runs in seconds), saved as the Hub serves them, read
by ``convert --from hf``: the same logits, the same greedy text, and back again."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from handformer.cli import main
from handformer.data.corpora import builtin_text
from handformer.generate import generate
from handformer.interop.hf_folder import export_hf_folder, import_hf_folder
from handformer.interop.llama import _half_to_pairs, _pairs_to_half
from handformer.nn.positional import RopeScaling, RotaryEmbedding
from handformer.runs import load_run

transformers = pytest.importorskip(
    "transformers", reason="the 'transformers' test extra is not installed "
    "(pip install -r requirements-dev.txt)")

VOCAB = 384  # the embedding rows; the tokenizer has fewer (published models pad theirs too)

# config.json as published (rope_theta + rope_scaling, the form on the Hub), cut to
# ``num_hidden_layers`` and ``vocab_size`` below; everything else is the checkpoint's.
PUBLISHED: dict[str, dict[str, Any]] = {
    "Llama-3.2-1B": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", attention_bias=False,
        attention_dropout=0.0, head_dim=64, hidden_act="silu", hidden_size=2048,
        intermediate_size=8192, max_position_embeddings=131072, mlp_bias=False,
        num_attention_heads=32, num_hidden_layers=16, num_key_value_heads=8,
        pretraining_tp=1, rms_norm_eps=1e-05, rope_theta=500000.0,
        rope_scaling={"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                      "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        tie_word_embeddings=True, torch_dtype="bfloat16", vocab_size=128256),
    "Qwen3-0.6B": dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", attention_bias=False,
        attention_dropout=0.0, head_dim=128, hidden_act="silu", hidden_size=1024,
        intermediate_size=3072, max_position_embeddings=40960, max_window_layers=28,
        num_attention_heads=16, num_hidden_layers=28, num_key_value_heads=8,
        rms_norm_eps=1e-06, rope_scaling=None, rope_theta=1000000, sliding_window=None,
        tie_word_embeddings=True, torch_dtype="bfloat16", use_sliding_window=False,
        vocab_size=151936),
    "SmolLM2-135M": dict(
        architectures=["LlamaForCausalLM"], model_type="llama", attention_bias=False,
        attention_dropout=0.0, hidden_act="silu", hidden_size=576, intermediate_size=1536,
        max_position_embeddings=8192, mlp_bias=False, num_attention_heads=9,
        num_hidden_layers=30, num_key_value_heads=3, pretraining_tp=1, rms_norm_eps=1e-05,
        rope_scaling=None, rope_theta=100000, tie_word_embeddings=True,
        torch_dtype="bfloat16", vocab_size=49152),
    "TinyLlama-1.1B": dict(  # Llama 2 style: sentencepiece tokenizer, untied head
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu",
        hidden_size=2048, intermediate_size=5632, max_position_embeddings=2048,
        num_attention_heads=32, num_hidden_layers=22, num_key_value_heads=4,
        pretraining_tp=1, rms_norm_eps=1e-05, rope_scaling=None, rope_theta=10000.0,
        tie_word_embeddings=False, torch_dtype="float32", vocab_size=32000),
}
# How each is cut and stored: layers kept, weights' dtype, shard size (None: one file),
# the tokenizer's special tokens (bos, eos, others).
STORED: dict[str, dict[str, Any]] = {
    "Llama-3.2-1B": dict(layers=1, dtype=torch.bfloat16, shard="40MB",
                         special=["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]),
    "Qwen3-0.6B": dict(layers=2, dtype=torch.bfloat16, shard=None,
                       special=["<|endoftext|>", "<|im_end|>", "<|im_start|>"]),
    "SmolLM2-135M": dict(layers=2, dtype=torch.float32, shard="4MB",
                         special=["<|endoftext|>", "<|endoftext|>", "<|im_start|>"]),
    "TinyLlama-1.1B": dict(layers=1, dtype=torch.float32, shard=None, sentencepiece=True,
                           special=["<s>", "</s>", "<unk>"]),
}
FAST = ["Qwen3-0.6B", "SmolLM2-135M"]
SLOW = [pytest.param(n, marks=pytest.mark.slow) for n in ("Llama-3.2-1B", "TinyLlama-1.1B")]
ALL = FAST + SLOW


def _tokenizer(special: list[str], sentencepiece: bool) -> Any:
    """A small tokenizer of the family's kind: byte-level BPE (Llama 3, Qwen3, SmolLM2) or
    sentencepiece-style BPE (Llama 2, TinyLlama), with the family's special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    names = list(dict.fromkeys(special))
    text = builtin_text()[:40_000]
    if sentencepiece:
        from tokenizers.implementations import SentencePieceBPETokenizer

        sp = SentencePieceBPETokenizer()
        sp.train_from_iterator([text], vocab_size=300, special_tokens=names,
                               show_progress=False)
        return sp._tokenizer
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(
        vocab_size=300, special_tokens=names, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tok


def _hub_folder(name: str, folder: Path) -> tuple[Path, Any]:
    """A folder as the Hub serves ``name`` (published config.json, safetensors — sharded or
    not, bf16 or fp32 —, tokenizer.json) and the fp32 transformers model it holds."""
    stored = STORED[name]
    tok = _tokenizer(stored["special"], stored.get("sentencepiece", False))
    # transformers' config classes edit nested dicts in place (rope_scaling): give them a copy.
    published = {**copy.deepcopy(PUBLISHED[name]), "num_hidden_layers": stored["layers"],
                 "vocab_size": VOCAB,
                 "bos_token_id": tok.token_to_id(stored["special"][0]),
                 "eos_token_id": tok.token_to_id(stored["special"][1])}
    cls = getattr(transformers, published["architectures"][0])
    config_cls = transformers.AutoConfig.for_model(published["model_type"]).__class__
    torch.manual_seed(0)
    hf = cls(config_cls(**{k: v for k, v in published.items() if k != "architectures"}))
    hf.to(stored["dtype"]).save_pretrained(folder, max_shard_size=stored["shard"] or "10GB")
    (folder / "config.json").write_text(json.dumps(published, indent=2))  # the published form
    tok.save(str(folder / "tokenizer.json"))
    reference = cls.from_pretrained(folder, dtype=torch.float32).eval()
    reference.generation_config.eos_token_id = None  # greedy runs its full length
    reference.generation_config.pad_token_id = 0
    return folder, reference


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Any, Path]]:
    """name → (hub folder, its transformers model, the run folder ``convert --from hf``
    wrote), built on first use."""
    root = tmp_path_factory.mktemp("llama")

    class Lazy(dict):
        def __missing__(self, name: str) -> tuple[Path, Any, Path]:
            hub, hf = _hub_folder(name, root / f"{name}-hub")
            run = root / f"{name}-run"
            assert main(["convert", "--from", "hf", str(hub), str(run)]) == 0
            self[name] = (hub, hf, run)
            return self[name]

    return Lazy()


def _ids(n: int = 2, t: int = 24) -> torch.Tensor:
    return torch.randint(3, 300, (n, t), generator=torch.Generator().manual_seed(1))


def _close(ours: torch.Tensor, theirs: torch.Tensor, rel: float = 1e-5) -> None:
    """Within ``rel`` of the logits' scale, everywhere."""
    scale = theirs.abs().max().item()
    assert (ours - theirs).abs().max().item() <= rel * scale, (
        (ours - theirs).abs().max().item(), scale)


@pytest.mark.parametrize("name", ALL)
def test_logits_match_transformers(folders: dict[str, Any], name: str) -> None:
    _, hf, run = folders[name]
    loaded = load_run(run, kind="lm")
    cfg, published = loaded.model.config, PUBLISHED[name]
    assert cfg.head_dim == published.get("head_dim", published["hidden_size"]
                                        // published["num_attention_heads"])
    assert cfg.qk_norm == (published["model_type"] == "qwen3")
    assert cfg.tie_weights == published["tie_word_embeddings"]
    assert cfg.layer_norm_eps == published["rms_norm_eps"]
    assert cfg.rope_base == published["rope_theta"]
    assert cfg.rope_scaling == ("llama3" if published["rope_scaling"] else "none")
    ids = _ids()
    with torch.no_grad():
        _close(loaded.model(ids), hf(ids).logits)


@pytest.mark.parametrize("name", ALL)
def test_greedy_text_and_the_kv_cache_match_transformers_generate(
        folders: dict[str, Any], name: str) -> None:
    _, hf, run = folders[name]
    model = load_run(run, kind="lm").model
    prompt = _ids(1, 8)
    with torch.no_grad():
        theirs = hf.generate(prompt, max_new_tokens=16, do_sample=False)
    cached = generate(model, prompt, 16, temperature=0)
    uncached = generate(model, prompt, 16, temperature=0, use_cache=False)
    assert torch.equal(cached, theirs)
    assert torch.equal(uncached, cached)


@pytest.mark.parametrize("name", ALL)
def test_back_to_hf_gives_the_same_class_and_logits(folders: dict[str, Any], name: str,
                                                    tmp_path: Path) -> None:
    _, hf, run = folders[name]
    out, family = export_hf_folder(run, tmp_path / "out")
    assert family == PUBLISHED[name]["model_type"]
    back = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(back) is type(hf)
    ids = _ids()
    with torch.no_grad():
        _close(back(ids).logits, hf(ids).logits, rel=1e-6)
    written = json.loads((out / "config.json").read_text())
    for key in ("head_dim", "rope_theta", "rms_norm_eps", "num_key_value_heads",
                "tie_word_embeddings", "rope_scaling"):
        assert written[key] == PUBLISHED[name].get(key, written[key]), key
    theirs = transformers.AutoTokenizer.from_pretrained(out)
    text = "Return the value of x."
    assert theirs(text)["input_ids"] == load_run(run, kind="lm").tokenizer.encode(text)


def test_special_ids_come_from_the_folder_s_config(folders: dict[str, Any]) -> None:
    hub, _, run = folders["Qwen3-0.6B"]
    tok = load_run(run, kind="lm").tokenizer
    published = json.loads((hub / "config.json").read_text())
    assert (tok.bos_id, tok.eos_id) == (published["bos_token_id"], published["eos_token_id"])
    assert tok.backend.id_to_token(tok.eos_id) == "<|im_end|>"  # not found by any name list


def test_a_transformers_5_config_with_rope_parameters_reads_the_same(
        folders: dict[str, Any], tmp_path: Path) -> None:
    hub, hf, _ = folders["Qwen3-0.6B"]
    hf.save_pretrained(tmp_path / "v5")  # transformers' own config.json form
    (tmp_path / "v5" / "tokenizer.json").write_bytes((hub / "tokenizer.json").read_bytes())
    assert "rope_parameters" in json.loads((tmp_path / "v5" / "config.json").read_text())
    run = import_hf_folder(tmp_path / "v5", tmp_path / "run")
    with torch.no_grad():
        _close(load_run(run, kind="lm").model(_ids()), hf(_ids()).logits)


@pytest.mark.parametrize("positions", [[0, 1, 2, 3], [0, 2047, 8191, 8192], [30000, 100000]])
def test_llama3_scaled_rope_rotates_as_transformers_does_far_out(positions: list[int]) -> None:
    """The scaled frequencies only show far from the start: compare the rotation itself, at
    positions across Llama 3's 8192-token pre-training window and far past it."""
    from transformers.models.llama.modeling_llama import (
        LlamaRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    published = copy.deepcopy(PUBLISHED["Llama-3.2-1B"])
    config = transformers.LlamaConfig(**{k: v for k, v in published.items()
                                         if k != "architectures"})
    rotary = LlamaRotaryEmbedding(config)
    pos = torch.tensor([positions])
    q = torch.randn(1, 2, len(positions), 64, dtype=torch.float64).float()  # (B, H, T, D)
    cos, sin = rotary(q, pos)
    theirs, _ = apply_rotary_pos_emb(q, q, cos, sin)
    ours = RotaryEmbedding(64, 500000.0, RopeScaling("llama3", 32.0, 1.0, 4.0, 8192))
    rows = _half_to_pairs(q.transpose(0, 3).reshape(64, -1), 1, 64)  # our pair order
    ours_q = ours(rows.reshape(64, 2, len(positions), 1).transpose(0, 3), pos[0])
    back = _pairs_to_half(ours_q.transpose(0, 3).reshape(64, -1), 1, 64)
    torch.testing.assert_close(back.reshape(64, 2, len(positions), 1).transpose(0, 3), theirs,
                               rtol=1e-5, atol=1e-4)


def test_pairs_permutation_is_its_own_inverse() -> None:
    w = torch.arange(3 * 8 * 2).reshape(3 * 8, 2)
    assert torch.equal(_pairs_to_half(_half_to_pairs(w, 3, 8), 3, 8), w)
    # HF row i of a head lands on our row 2i, row i + D/2 on 2i + 1.
    assert _half_to_pairs(torch.arange(8)[:, None], 1, 8).flatten().tolist() == \
        [0, 4, 1, 5, 2, 6, 3, 7]


# -- refusals: one line, the destination untouched ------------------------------------------
def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _refused(capsys: pytest.CaptureFixture[str], hub: Path, run: Path, pattern: str) -> None:
    capsys.readouterr()
    assert main(["convert", "--from", "hf", str(hub), str(run)]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and __import__("re").search(pattern, err), err
    assert not run.exists()


def test_bad_hub_folders_are_refused_in_one_line(folders: dict[str, Any], tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    hub = folders["SmolLM2-135M"][0]
    assert (hub / "model.safetensors.index.json").is_file()  # stored sharded

    def edit(name: str, change: Any) -> Path:
        folder = _copy(hub, tmp_path / name)
        change(folder)
        return folder

    def config(**fields: Any) -> Any:
        def change(folder: Path) -> None:
            data = json.loads((folder / "config.json").read_text())
            (folder / "config.json").write_text(json.dumps({**data, **fields}))
        return change

    shards = sorted(p.name for p in hub.glob("model-*.safetensors"))
    cases = {
        "family": (config(model_type="phi3"), r"model_type='phi3' is not supported.*gpt2.*"
                                               r"llama.*qwen3"),
        "missing-shard": (lambda f: (f / shards[0]).unlink(), rf"names the shard {shards[0]}"),
        "bad-shard": (lambda f: (f / shards[0]).write_bytes(b"not safetensors"),
                      rf"{shards[0]}: cannot read the weights"),
        "escaping-index": (lambda f: (f / "model.safetensors.index.json").write_text(
            json.dumps({"weight_map": {"model.norm.weight": "../elsewhere.safetensors"}})),
            r"not a file name inside"),
        "tokenizer-too-big": (config(vocab_size=200), r"has 300 tokens but .* vocab_size=200"),
        "rope-kind": (config(rope_scaling={"rope_type": "yarn", "factor": 4.0}),
                      r"rope_scaling type 'yarn' \(implemented: 'linear', 'llama3'\)"),
        "bias": (config(attention_bias=True), r"attention_bias=True"),
        "act": (config(hidden_act="gelu"), r"hidden_act='gelu'"),
        "shape": (config(intermediate_size=1000), r"shape .* config\.json makes it"),
        "lacks": (lambda f: config()(f) or (f / "config.json").write_text(json.dumps(
            {k: v for k, v in json.loads((f / "config.json").read_text()).items()
             if k != "hidden_size"})), r"lacks 'hidden_size'"),
    }
    for name, (change, pattern) in cases.items():
        _refused(capsys, edit(name, change), tmp_path / f"{name}-run", pattern)


def test_a_run_no_family_expresses_is_refused_naming_the_closest(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = tmp_path / "t.txt"
    text.write_text(builtin_text()[:20_000])
    run = tmp_path / "run"
    assert main(["train", "--preset", "tiny", "--max-steps", "2", "--data", str(text),
                 "--out", str(run), "--no-progress", "--no-plot", "--positional", "alibi"]) == 0
    capsys.readouterr()
    assert main(["convert", "--to", "hf", str(run), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip()
    assert "maps onto no Hugging Face family (gpt2, llama, qwen3); closest is gpt2" in err
    assert "positional='alibi' (gpt2 needs 'learned')" in err and len(err.splitlines()) == 1
    assert not (tmp_path / "out").exists()
