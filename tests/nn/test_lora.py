"""LoRA by hand (``handformer.nn.lora``): the update starts at zero, each target adapts only
its own rows, merge() equals the unmerged forward, only the adapters train, and bad requests
are refused in one line. Parity with PEFT is in tests/interop/test_interop_peft.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from handformer.models.decoder_lm import DecoderLM
from handformer.nn.lora import (
    LoRAConfig,
    LoRAError,
    LoRALinear,
    apply_lora,
    lora_layers,
    lora_state_dict,
    merge_lora,
    trainable_parameters,
)
from tests.conftest import tiny_config


def _model(**overrides: object) -> DecoderLM:
    torch.manual_seed(0)
    return DecoderLM(tiny_config(attention="manual", **overrides)).eval()


def _randomise_adapters(model: nn.Module) -> None:
    with torch.no_grad():
        for _, layer in lora_layers(model):
            for adapter in layer.adapters.values():
                adapter.lora_B.normal_(0.0, 0.2)


def test_a_fresh_adapter_leaves_the_model_exactly_as_it_was() -> None:
    model = _model()
    ids = torch.randint(0, 37, (2, 12))
    before = model(ids)
    apply_lora(model, LoRAConfig(r=4, targets=("all-linear",)))
    assert torch.equal(model(ids), before)  # B = 0: the update is exactly zero


def test_each_target_adapts_only_its_own_rows_of_the_stacked_projection() -> None:
    model = _model(n_kv_heads=2, activation="swiglu")
    attn = model.blocks[0].self_attn
    x = torch.randn(2, 5, 32)
    base = attn.in_proj(x)  # (B, T, H·D + 2·Hkv·D)
    apply_lora(model, LoRAConfig(r=2, targets=("k", "up")))
    _randomise_adapters(model)
    out = attn.in_proj(x)
    q, kv = attn.q_dim, attn.kv_dim
    assert torch.equal(out[..., :q], base[..., :q])  # q untouched
    assert not torch.allclose(out[..., q:q + kv], base[..., q:q + kv])  # k adapted
    assert torch.equal(out[..., q + kv:], base[..., q + kv:])  # v untouched
    fc_in = model.blocks[0].ffn.fc_in
    assert set(fc_in.adapters) == {"up"} and fc_in.adapters["up"].start == fc_in.out_features // 2


def test_the_update_is_scale_times_b_a() -> None:
    layer = nn.Linear(6, 9)
    x = torch.randn(4, 6)
    lora = LoRALinear(layer, {"v": (3, 9)}, r=2, scale=0.5, dropout=0.0)
    _randomise_adapters(nn.ModuleDict({"l": lora}))
    a = lora.adapters["v"]
    expected = layer(x).clone()
    expected[:, 3:] += 0.5 * x @ a.lora_A.T @ a.lora_B.T
    torch.testing.assert_close(lora(x), expected)
    assert LoRAConfig(r=8, alpha=16).scale == 2.0 and LoRAConfig(r=8).scale == 1.0


def test_merged_equals_unmerged_and_unmerge_restores_the_base() -> None:
    model = _model()
    ids = torch.randint(0, 37, (2, 12))
    original = {k: v.clone() for k, v in model.state_dict().items()}
    apply_lora(model, LoRAConfig(r=4, alpha=8, targets=("all-linear",)))
    _randomise_adapters(model)
    unmerged = model(ids)
    for _, layer in lora_layers(model):
        layer.merge()
    torch.testing.assert_close(model(ids), unmerged, rtol=0, atol=1e-5)
    for _, layer in lora_layers(model):
        layer.unmerge()
    for name, tensor in original.items():
        torch.testing.assert_close(model.state_dict()[name], tensor, rtol=0, atol=1e-6)
    plain = merge_lora(model)
    assert not lora_layers(plain)
    assert all(type(m) is not LoRALinear for m in plain.modules())
    torch.testing.assert_close(plain(ids), unmerged, rtol=0, atol=1e-5)


def test_only_the_adapters_and_the_named_head_train() -> None:
    model = _model(tie_weights=False)
    apply_lora(model, LoRAConfig(r=2, targets=("q", "v")), trainable=("lm_head",))
    names = {n for n, p in model.named_parameters() if p.requires_grad}
    assert names == {f"blocks.{i}.self_attn.in_proj.adapters.{t}.{w}" for i in range(2)
                     for t in ("q", "v") for w in ("lora_A", "lora_B")} | {"lm_head.weight"}
    # r·(K + n) per target and block, plus the head.
    assert trainable_parameters(model) == 2 * 2 * 2 * (32 + 32) + 37 * 32
    model.train()
    loss = model(torch.randint(0, 37, (2, 8))).sum()
    loss.backward()
    assert model.blocks[0].self_attn.in_proj.weight.grad is None
    assert model.blocks[0].self_attn.in_proj.adapters["q"].lora_A.grad is not None
    stored = lora_state_dict(model, trainable=("lm_head",))
    assert set(stored) == names


def test_dropout_acts_on_the_lora_path_only() -> None:
    layer = nn.Linear(8, 8)
    lora = LoRALinear(layer, {"o": (0, 8)}, r=2, scale=1.0, dropout=0.5).train()
    x = torch.randn(3, 8)
    assert torch.equal(lora(x), layer(x))  # B = 0: dropout or not, no change yet
    with torch.no_grad():
        lora.adapters["o"].lora_B.fill_(1.0)
    outs = {tuple(lora(x).flatten().tolist()) for _ in range(4)}
    assert len(outs) > 1  # dropout draws differ in training
    lora.eval()
    assert torch.equal(lora(x), lora(x))


def test_each_pair_of_a_layer_draws_its_own_dropout_as_peft_does() -> None:
    """Two pairs with the same weights give the same update without dropout, and different
    ones in training: one draw per target, not one shared by the layer."""
    layer = nn.Linear(16, 8, bias=False)
    lora = LoRALinear(layer, {"q": (0, 4), "v": (4, 8)}, r=2, scale=1.0, dropout=0.5)
    with torch.no_grad():
        layer.weight.zero_()
        for pair in lora.adapters.values():
            pair.lora_A.copy_(lora.adapters["q"].lora_A)
            pair.lora_B.fill_(1.0)
    x = torch.randn(64, 16)
    out = lora.eval()(x)
    torch.testing.assert_close(out[:, :4], out[:, 4:])
    torch.manual_seed(0)
    out = lora.train()(x)
    assert not torch.allclose(out[:, :4], out[:, 4:])


@pytest.mark.parametrize(("config", "pattern"), [
    (LoRAConfig(r=0), "rank r must be a positive integer; got 0"),
    (LoRAConfig(r=-3), "rank r must be a positive integer; got -3"),
    (LoRAConfig(r=33, targets=("q",)), r"r=33 exceeds target 'q'.*r ≤ 32"),
    (LoRAConfig(r=2, targets=("gate",)), r"\['gate'\] match no layer.*has q, k, v, qkv, o, up, "
                                         "down"),
    (LoRAConfig(r=2, targets=("q_proj",)), r"\['q_proj'\] match no layer"),
    (LoRAConfig(r=2, targets=("qkv", "q")), "qkv is the whole in_proj"),
    (LoRAConfig(r=2, dropout=1.0), "dropout must be in"),
])
def test_bad_requests_are_refused_in_one_line(config: LoRAConfig, pattern: str) -> None:
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(LoRAError, match=pattern) as err:
        apply_lora(model, config)
    assert "\n" not in str(err.value)
    assert not lora_layers(model) and all(p.requires_grad for p in model.parameters())
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())


def test_groups_skip_what_the_model_lacks_and_lora_goes_on_once() -> None:
    model = _model()  # GELU: no gate
    apply_lora(model, LoRAConfig(r=2, targets=("mlp",)))
    assert {t for _, layer in lora_layers(model) for t in layer.adapters} == {"up", "down"}
    with pytest.raises(LoRAError, match="already has LoRA"):
        apply_lora(model, LoRAConfig(r=2))
