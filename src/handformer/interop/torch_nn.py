"""handformer's layers ↔ torch's own ``nn`` modules, weights copied both ways.

Prototype and read with handformer, ship with the modules PyTorch maintains (or bring a torch
model in to read it with handformer's tools): each pair computes the same function, which the
parity tests check in both directions.

=================================  ================================================
handformer                          torch
=================================  ================================================
``MultiHeadAttention``             ``nn.MultiheadAttention`` (batch_first)
``TransformerBlock``               ``nn.TransformerEncoderLayer`` (batch_first)
``TransformerBlock`` with cross    ``nn.TransformerDecoderLayer`` (batch_first)
``Encoder`` (its block stack)      ``nn.TransformerEncoder``
``EncoderDecoder`` (both stacks)   ``nn.Transformer`` (batch_first)
=================================  ================================================

``to_torch_*`` builds the torch module from a handformer one; ``from_torch_*`` builds the
handformer module from a torch one. The whole-model conversions move the block stacks only:
torch's modules map embeddings (B, T, C) to hidden states and own no embedding or output
head, so ``from_torch_transformer_encoder`` / ``from_torch_transformer`` take the handformer
config to build those from (freshly initialised: copy or train your own). Every result is in
eval mode, on the source's device and in its dtype.

What only one side can express is refused with a ``ValueError`` naming it: RoPE/ALiBi,
grouped-query attention, QK-norm, RMSNorm and the ``relu2``/``swiglu``/``gelu_tanh``
activations on handformer's side; separate key/value widths, ``add_bias_kv``,
``add_zero_attn``, a non-affine LayerNorm and activations other than ReLU/GELU on torch's.

Masks have opposite polarity: handformer's are True where a query may attend, torch's
``key_padding_mask`` / bool ``attn_mask`` are True where it may *not*
(``handformer.masks.to_torch_key_padding_mask`` and ``to_torch_attn_mask`` convert).

The layouts were chosen to match (the fused ``in_proj`` for Q/K/V, the FFN as two linears), so
every copy is a plain parameter-for-parameter assignment, checked for shape.

Shape legend: ``C`` model dim, ``F`` feed-forward width.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from handformer.config import ModelConfig, Seq2SeqConfig
from handformer.models.encoder import Encoder
from handformer.models.seq2seq import EncoderDecoder
from handformer.nn.attention import AttentionKind, MultiHeadAttention
from handformer.nn.block import TransformerBlock

__all__ = [
    "from_torch_decoder_layer",
    "from_torch_encoder_layer",
    "from_torch_multihead_attention",
    "from_torch_transformer",
    "from_torch_transformer_encoder",
    "to_torch_decoder_layer",
    "to_torch_encoder_layer",
    "to_torch_multihead_attention",
    "to_torch_transformer",
    "to_torch_transformer_encoder",
]

TorchLayer = nn.TransformerEncoderLayer | nn.TransformerDecoderLayer
Pairs = list[tuple[str, torch.Tensor | None, torch.Tensor | None]]  # (what, handformer, torch)


# -- copying ----------------------------------------------------------------------------------
def _copy(dst: torch.Tensor | None, src: torch.Tensor | None, what: str) -> None:
    if dst is None or src is None:
        if dst is not None or src is not None:
            raise ValueError(f"{what}: one side has a bias and the other does not")
        return
    if dst.shape != src.shape:
        raise ValueError(f"{what}: shape {tuple(src.shape)} cannot go into {tuple(dst.shape)}")
    with torch.no_grad():
        dst.copy_(src)


def _copy_pairs(pairs: Pairs, *, into_torch: bool) -> None:
    for what, ours, theirs in pairs:
        if into_torch:
            _copy(theirs, ours, what)
        else:
            _copy(ours, theirs, what)


def _like(module: nn.Module, source: nn.Module) -> Any:
    """``module`` on ``source``'s device and in its dtype, in eval mode."""
    param = next(source.parameters())
    return module.to(device=param.device, dtype=param.dtype).eval()


def _attention_pairs(ours: MultiHeadAttention, theirs: nn.MultiheadAttention,
                     prefix: str) -> Pairs:
    return [
        (f"{prefix}.in_proj.weight", ours.in_proj.weight, theirs.in_proj_weight),
        (f"{prefix}.in_proj.bias", ours.in_proj.bias, theirs.in_proj_bias),
        (f"{prefix}.out_proj.weight", ours.out_proj.weight, theirs.out_proj.weight),
        (f"{prefix}.out_proj.bias", ours.out_proj.bias, theirs.out_proj.bias),
    ]


def _norm_pairs(ours: nn.Module, theirs: nn.Module, what: str) -> Pairs:
    for module, side in ((ours, "handformer"), (theirs, "torch")):
        if not isinstance(module, nn.LayerNorm):
            raise ValueError(f"{what}: torch's layers use LayerNorm; the {side} side has "
                             f"{type(module).__name__}")
        if not module.elementwise_affine:
            raise ValueError(f"{what}: a LayerNorm without weight (elementwise_affine=False) "
                             "has no handformer twin")
    if ours.eps != theirs.eps:
        raise ValueError(f"{what}: LayerNorm eps {ours.eps:g} (handformer) != {theirs.eps:g} "
                         "(torch)")
    return [(f"{what}.weight", ours.weight, theirs.weight),
            (f"{what}.bias", ours.bias, theirs.bias)]


def _block_pairs(block: TransformerBlock, layer: TorchLayer) -> Pairs:
    """Every handformer parameter of ``block`` beside its twin in ``layer``. torch's decoder
    layer orders its norms self-attention, cross-attention, FFN (``norm1``/``norm2``/
    ``norm3``); the block calls them ``norm1``, ``norm_cross``, ``norm2``."""
    pairs = _attention_pairs(block.self_attn, layer.self_attn, "self_attn")
    pairs += [
        ("ffn.fc_in.weight", block.ffn.fc_in.weight, layer.linear1.weight),
        ("ffn.fc_in.bias", block.ffn.fc_in.bias, layer.linear1.bias),
        ("ffn.fc_out.weight", block.ffn.fc_out.weight, layer.linear2.weight),
        ("ffn.fc_out.bias", block.ffn.fc_out.bias, layer.linear2.bias),
        *_norm_pairs(block.norm1, layer.norm1, "norm1"),
    ]
    if isinstance(layer, nn.TransformerDecoderLayer):
        assert block.cross_attn is not None  # checked by _settings_agree
        pairs += _attention_pairs(block.cross_attn, layer.multihead_attn, "cross_attn")
        pairs += _norm_pairs(block.norm_cross, layer.norm2, "norm_cross")
        pairs += _norm_pairs(block.norm2, layer.norm3, "norm2")
    else:
        pairs += _norm_pairs(block.norm2, layer.norm2, "norm2")
    return pairs


# -- what each side's module is, in handformer's words ---------------------------------------
def _attention_settings(mha: MultiHeadAttention, what: str) -> dict[str, Any]:
    if mha.positional != "none":
        raise ValueError(f"{what}: positional={mha.positional!r} works inside attention and "
                         "nn.MultiheadAttention has no twin; use 'learned' or 'sinusoidal'")
    if mha.n_kv_heads != mha.n_heads:
        raise ValueError(f"{what}: grouped-query attention (n_kv_heads={mha.n_kv_heads} != "
                         f"n_heads={mha.n_heads}) has no nn.MultiheadAttention twin")
    if mha.q_norm is not None:
        raise ValueError(f"{what}: QK-norm (qk_norm=True) has no nn.MultiheadAttention twin")
    return {"d_model": mha.d_model, "n_heads": mha.n_heads, "dropout": mha.dropout,
            "bias": mha.in_proj.bias is not None}


def _torch_attention_settings(ref: nn.MultiheadAttention, what: str) -> dict[str, Any]:
    if not ref._qkv_same_embed_dim:
        raise ValueError(f"{what}: nn.MultiheadAttention with kdim/vdim != embed_dim has "
                         "separate Q/K/V weights; handformer's in_proj fuses them")
    if ref.bias_k is not None or ref.add_zero_attn:
        raise ValueError(f"{what}: add_bias_kv / add_zero_attn have no handformer twin")
    bias = ref.in_proj_bias is not None
    if bias != (ref.out_proj.bias is not None):
        raise ValueError(f"{what}: in_proj and out_proj must both have a bias or neither")
    return {"d_model": ref.embed_dim, "n_heads": ref.num_heads, "dropout": ref.dropout,
            "bias": bias}


_TORCH_ACTIVATIONS = {"relu": "relu", "gelu": "gelu"}  # handformer name → torch's string


def _block_settings(block: TransformerBlock) -> dict[str, Any]:
    attn = _attention_settings(block.self_attn, "self-attention")
    if not isinstance(block.norm1, nn.LayerNorm):
        raise ValueError(f"norm_type: torch's layers use LayerNorm; this block has "
                         f"{type(block.norm1).__name__}")
    if block.ffn.activation not in _TORCH_ACTIVATIONS:
        raise ValueError(f"activation={block.ffn.activation!r} has no torch layer twin; "
                         f"torch's layers take {sorted(_TORCH_ACTIVATIONS)}")
    if block.cross_attn is not None:
        _attention_settings(block.cross_attn, "cross-attention")
    return {**attn, "d_ff": block.ffn.fc_in.out_features, "norm": block.norm,
            "activation": block.ffn.activation, "eps": block.norm1.eps,
            "cross": block.cross_attn is not None}


def _torch_activation(fn: Callable[..., Any] | nn.Module) -> str:
    if fn is F.relu or isinstance(fn, nn.ReLU):
        return "relu"
    if fn is F.gelu or (isinstance(fn, nn.GELU) and fn.approximate == "none"):
        return "gelu"
    # nn.GELU(approximate="tanh") included: torch's fused fast path computes the exact GELU
    # for it, so the layer itself is two different functions.
    raise ValueError(f"activation {fn!r}: only ReLU and the exact GELU have a handformer twin")


def _layer_settings(layer: TorchLayer) -> dict[str, Any]:
    attn = _torch_attention_settings(layer.self_attn, "self_attn")
    cross = isinstance(layer, nn.TransformerDecoderLayer)
    if cross:
        _torch_attention_settings(layer.multihead_attn, "multihead_attn")
    if not isinstance(layer.norm1, nn.LayerNorm):
        raise ValueError(f"norm1: expected an nn.LayerNorm; got {type(layer.norm1).__name__}")
    biases = {layer.linear1.bias is not None, layer.linear2.bias is not None,
              getattr(layer.norm1, "bias", None) is not None, attn["bias"]}
    if len(biases) > 1:
        raise ValueError("the layer's linears, norms and attention must all have biases or "
                         "none (handformer's bias= covers them together)")
    return {**attn, "d_ff": layer.linear1.out_features,
            "norm": "pre" if layer.norm_first else "post",
            "activation": _torch_activation(layer.activation), "eps": layer.norm1.eps,
            "cross": cross}


def _settings_agree(ours: dict[str, Any], theirs: dict[str, Any], what: str) -> None:
    """The settings that change what a layer computes must agree (dropout, which does not
    in eval mode, is the config's)."""
    differ = [f"{k} {ours[k]!r} (handformer) vs {theirs[k]!r} (torch)" for k in ours
              if k != "dropout" and ours[k] != theirs[k]]
    if differ:
        raise ValueError(f"{what}: " + "; ".join(differ))


# -- attention ----------------------------------------------------------------------------------
def to_torch_multihead_attention(mha: MultiHeadAttention) -> nn.MultiheadAttention:
    """An ``nn.MultiheadAttention`` (batch_first) with ``mha``'s weights, in eval mode. Call
    it ``ref(x, context, context)``; handformer's ``mha(x, context)``."""
    s = _attention_settings(mha, "MultiHeadAttention")
    ref = nn.MultiheadAttention(s["d_model"], s["n_heads"], dropout=s["dropout"],
                                bias=s["bias"], batch_first=True)
    _copy_pairs(_attention_pairs(mha, ref, "attention"), into_torch=True)
    return _like(ref, mha)


def from_torch_multihead_attention(ref: nn.MultiheadAttention, *,
                                   attention: AttentionKind = "manual") -> MultiHeadAttention:
    """A handformer ``MultiHeadAttention`` with ``ref``'s weights, in eval mode, running the
    ``attention`` kernel. It is batch-first whatever ``ref.batch_first`` says."""
    s = _torch_attention_settings(ref, "nn.MultiheadAttention")
    mha = MultiHeadAttention(s["d_model"], s["n_heads"], dropout=s["dropout"], bias=s["bias"],
                             attention=attention)
    _copy_pairs(_attention_pairs(mha, ref, "attention"), into_torch=False)
    return _like(mha, ref)


# -- blocks -------------------------------------------------------------------------------------
def _torch_layer(block: TransformerBlock) -> TorchLayer:
    s = _block_settings(block)
    layer_class = nn.TransformerDecoderLayer if s["cross"] else nn.TransformerEncoderLayer
    layer = layer_class(
        s["d_model"], s["n_heads"], dim_feedforward=s["d_ff"], dropout=s["dropout"],
        activation=_TORCH_ACTIVATIONS[s["activation"]], layer_norm_eps=s["eps"],
        batch_first=True, norm_first=s["norm"] == "pre", bias=s["bias"],
    )
    _copy_pairs(_block_pairs(block, layer), into_torch=True)
    return _like(layer, block)


def to_torch_encoder_layer(block: TransformerBlock) -> nn.TransformerEncoderLayer:
    """An ``nn.TransformerEncoderLayer`` (batch_first, ``norm_first`` = pre-norm) with
    ``block``'s weights, in eval mode. A block with cross-attention is a decoder layer."""
    if block.cross_attn is not None:
        raise ValueError("a block with cross-attention maps to nn.TransformerDecoderLayer, "
                         "not nn.TransformerEncoderLayer")
    return _torch_layer(block)  # type: ignore[return-value]


def to_torch_decoder_layer(block: TransformerBlock) -> nn.TransformerDecoderLayer:
    """An ``nn.TransformerDecoderLayer`` (batch_first) with ``block``'s weights (self- and
    cross-attention, FFN), in eval mode."""
    if block.cross_attn is None:
        raise ValueError("a block without cross-attention maps to nn.TransformerEncoderLayer, "
                         "not nn.TransformerDecoderLayer")
    return _torch_layer(block)  # type: ignore[return-value]


def _handformer_block(layer: TorchLayer, attention: AttentionKind) -> TransformerBlock:
    s = _layer_settings(layer)
    block = TransformerBlock(
        s["d_model"], s["n_heads"], s["d_ff"], dropout=s["dropout"], norm=s["norm"],
        activation=s["activation"], attention=attention, bias=s["bias"],
        cross_attention=s["cross"], layer_norm_eps=s["eps"],
    )
    _copy_pairs(_block_pairs(block, layer), into_torch=False)
    return _like(block, layer)


def from_torch_encoder_layer(layer: nn.TransformerEncoderLayer, *,
                             attention: AttentionKind = "manual") -> TransformerBlock:
    """A handformer ``TransformerBlock`` (pre-norm if ``layer.norm_first``) with ``layer``'s
    weights, in eval mode, running the ``attention`` kernel."""
    if not isinstance(layer, nn.TransformerEncoderLayer):
        raise ValueError(f"expected an nn.TransformerEncoderLayer; got {type(layer).__name__}")
    return _handformer_block(layer, attention)


def from_torch_decoder_layer(layer: nn.TransformerDecoderLayer, *,
                             attention: AttentionKind = "manual") -> TransformerBlock:
    """A handformer ``TransformerBlock`` with cross-attention and ``layer``'s weights, in eval
    mode, running the ``attention`` kernel."""
    if not isinstance(layer, nn.TransformerDecoderLayer):
        raise ValueError(f"expected an nn.TransformerDecoderLayer; got {type(layer).__name__}")
    return _handformer_block(layer, attention)


# -- whole stacks -------------------------------------------------------------------------------
def _check_torch_compatible(config: ModelConfig, what: str) -> None:
    if config.positional not in ("sinusoidal", "learned"):
        raise ValueError(f"{what}: positional={config.positional!r} works inside attention and "
                         "torch's layers have no twin; use 'learned' or 'sinusoidal'")
    if config.n_kv_heads != config.n_heads:
        raise ValueError(f"{what}: grouped-query attention (n_kv_heads={config.n_kv_heads} != "
                         f"n_heads={config.n_heads}) has no nn.MultiheadAttention twin")


def _load_stack(blocks: Iterable[nn.Module], layers: Iterable[nn.Module], what: str) -> None:
    """Copy torch's ``layers`` into handformer's ``blocks``, after checking each pair is the
    same kind of layer (the handformer side was built from the user's config)."""
    blocks, layers = list(blocks), list(layers)
    if len(blocks) != len(layers):
        raise ValueError(f"{what}: the config has n_layers={len(blocks)}; torch's stack has "
                         f"{len(layers)} layers")
    for i, (block, layer) in enumerate(zip(blocks, layers, strict=True)):
        assert isinstance(block, TransformerBlock)
        ours = _block_settings(block)
        _settings_agree(ours, _layer_settings(layer), f"{what} layer {i}")  # type: ignore[arg-type]
        _copy_pairs(_block_pairs(block, layer), into_torch=False)  # type: ignore[arg-type]


def _final_norm_pairs(ours: nn.Module, theirs: nn.Module | None, what: str) -> Pairs:
    ours_has, theirs_has = not isinstance(ours, nn.Identity), theirs is not None
    if ours_has != theirs_has:
        raise ValueError(f"{what}: the handformer stack {'has' if ours_has else 'has no'} "
                         f"final LayerNorm, torch's {'has' if theirs_has else 'has none'}")
    return [] if theirs is None else _norm_pairs(ours, theirs, what)


def to_torch_transformer_encoder(encoder: Encoder) -> nn.TransformerEncoder:
    """An ``nn.TransformerEncoder`` computing ``encoder.encode_embedded``, in eval mode.

    Its final ``norm`` is the encoder's final LayerNorm, or ``None`` when it has none."""
    _check_torch_compatible(encoder.config, "Encoder")
    layers = [to_torch_encoder_layer(block) for block in encoder.blocks]  # type: ignore[arg-type]
    ref = nn.TransformerEncoder(layers[0], num_layers=len(layers), enable_nested_tensor=False)
    ref.layers = nn.ModuleList(layers)
    if isinstance(encoder.final_norm, nn.LayerNorm):
        ref.norm = nn.LayerNorm(encoder.config.d_model, eps=encoder.final_norm.eps,
                                bias=encoder.final_norm.bias is not None)
    _copy_pairs(_final_norm_pairs(encoder.final_norm, ref.norm, "final_norm"), into_torch=True)
    return _like(ref, encoder)


def from_torch_transformer_encoder(ref: nn.TransformerEncoder, config: ModelConfig
                                   ) -> Encoder:
    """A handformer ``Encoder`` built from ``config`` whose blocks (and final LayerNorm) are
    ``ref``'s, in eval mode. The embeddings are ``config``'s, freshly initialised: torch's
    stack has none. ``config`` must describe ``ref``'s layers (width, heads, FFN, norm
    placement, activation, bias, eps, depth); each difference is named."""
    _check_torch_compatible(config, "the Encoder config")
    encoder = Encoder(config, final_norm=ref.norm is not None)
    _load_stack(encoder.blocks, ref.layers, "nn.TransformerEncoder")
    _copy_pairs(_final_norm_pairs(encoder.final_norm, ref.norm, "final_norm"), into_torch=False)
    return _like(encoder, ref)


def _seq2seq_settings(config: Seq2SeqConfig) -> None:
    enc, dec = config.encoder, config.decoder
    _check_torch_compatible(enc, "encoder")
    _check_torch_compatible(dec, "decoder")
    shared = ("n_heads", "d_ff", "norm", "activation", "bias")
    differ = [n for n in shared if getattr(enc, n) != getattr(dec, n)]
    if differ:
        raise ValueError(f"nn.Transformer uses one setting for both stacks; encoder and decoder "
                         f"differ in {differ}")


def to_torch_transformer(model: EncoderDecoder) -> nn.Transformer:
    """An ``nn.Transformer`` (batch_first) with ``model``'s encoder and decoder stacks, in eval
    mode. It maps embeddings to hidden states: feed it ``model.encoder.embed(src)`` and
    ``model.decoder.embed(tgt)`` and apply ``model.decoder.lm_head`` to its output."""
    _seq2seq_settings(model.config)
    enc, dec = model.config.encoder, model.config.decoder
    encoder = to_torch_transformer_encoder(model.encoder)  # refuses what torch lacks, first
    decoder_layers = [to_torch_decoder_layer(block)  # type: ignore[arg-type]
                      for block in model.decoder.blocks]
    final = model.decoder.final_norm
    with warnings.catch_warnings():  # its default encoder warns about nested tensors
        warnings.simplefilter("ignore", UserWarning)
        ref = nn.Transformer(
            enc.d_model, enc.n_heads, num_encoder_layers=enc.n_layers,
            num_decoder_layers=dec.n_layers, dim_feedforward=enc.d_ff, dropout=enc.dropout,
            activation=enc.activation, layer_norm_eps=getattr(final, "eps", 1e-5),
            batch_first=True, norm_first=enc.norm == "pre", bias=enc.bias,
        )
    # Replace the stacks after construction: nn.Transformer re-initialises every parameter
    # at the end of __init__, custom_encoder/custom_decoder included.
    ref.encoder = encoder
    ref.decoder.layers = nn.ModuleList(decoder_layers)
    _copy_pairs(_final_norm_pairs(final, ref.decoder.norm, "decoder.final_norm"),
                into_torch=True)
    return _like(ref, model)


def from_torch_transformer(ref: nn.Transformer, config: Seq2SeqConfig) -> EncoderDecoder:
    """A handformer ``EncoderDecoder`` built from ``config`` whose encoder and decoder stacks
    (final LayerNorms included) are ``ref``'s, in eval mode. The embeddings and the output
    head are ``config``'s, freshly initialised: ``nn.Transformer`` has none. ``config`` must
    describe ``ref``'s layers and depths; each difference is named."""
    _seq2seq_settings(config)
    model = EncoderDecoder(config)
    if ref.encoder.norm is None or ref.decoder.norm is None:
        raise ValueError("EncoderDecoder ends both stacks in a LayerNorm, as nn.Transformer "
                         "builds them; this one has its encoder.norm or decoder.norm removed")
    _load_stack(model.encoder.blocks, ref.encoder.layers, "nn.Transformer encoder")
    _load_stack(model.decoder.blocks, ref.decoder.layers, "nn.Transformer decoder")
    pairs = _final_norm_pairs(model.encoder.final_norm, ref.encoder.norm, "encoder.final_norm")
    pairs += _final_norm_pairs(model.decoder.final_norm, ref.decoder.norm, "decoder.final_norm")
    _copy_pairs(pairs, into_torch=False)
    return _like(model, ref)
