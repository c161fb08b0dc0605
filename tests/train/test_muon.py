"""Muon beside AdamW: which parameters each trains, parity with torch's two optimizers
stepped by hand, the one schedule scaling both, exact resume with Muon's momentum in the
checkpoint, the split in the run folder, the refusal under FSDP, and the WSD schedule."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
import torch

from handformer.config import TrainConfig
from handformer.models.decoder_lm import DecoderLM
from handformer.train.checkpoint import list_checkpoints, read_trainer_state
from handformer.train.optim import (
    SplitOptimizer,
    build_optimizer,
    lr_at,
    parameter_split,
    set_lr,
)
from handformer.train.state import flatten_optimizer, restore_optimizer
from tests.train.helpers import make_trainer, model_config, train_config, weights

MUON = dict(optimizer="muon", muon_lr=0.02, lr=3e-3)


def test_muon_trains_the_blocks_matrices_and_adamw_everything_else() -> None:
    model = DecoderLM(model_config(tie_weights=False, positional="learned"))
    split = parameter_split(model, train_config(**MUON))
    assert split["muon"] and all(n.startswith("blocks.") for n in split["muon"])
    assert {n.rsplit(".", 2)[-2] for n in split["muon"]} == {"in_proj", "out_proj", "fc_in",
                                                             "fc_out"}
    named = dict(model.named_parameters())
    assert all(named[n].dim() == 2 for n in split["muon"])
    for name in ("embed.token.weight", "lm_head.weight", "embed.positions.table.weight",
                 "final_norm.weight", "blocks.0.norm1.weight", "blocks.0.ffn.fc_in.bias"):
        assert name in split["adamw"], name
    assert sorted(split["adamw"] + split["muon"]) == sorted(named)  # every parameter, once
    assert parameter_split(model, train_config())["muon"] == []


def test_one_step_equals_torch_muon_and_adamw_stepped_by_hand() -> None:
    cfg = train_config(**MUON, weight_decay=0.1)
    torch.manual_seed(0)
    ours = DecoderLM(model_config())
    theirs = DecoderLM(model_config())
    theirs.load_state_dict(ours.state_dict())
    opt = build_optimizer(ours, cfg)
    assert isinstance(opt, SplitOptimizer)
    hidden = [p for n, p in theirs.named_parameters()
              if n.startswith("blocks.") and p.dim() == 2]
    rest_decay = [p for n, p in theirs.named_parameters()
                  if not n.startswith("blocks.") and p.dim() == 2 and "positions" not in n]
    rest_plain = [p for n, p in theirs.named_parameters()
                  if not (p.dim() == 2 and (n.startswith("blocks.") or "positions" not in n))]
    muon = torch.optim.Muon(hidden, lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True,
                            adjust_lr_fn="match_rms_adamw")
    adamw = torch.optim.AdamW([{"params": rest_decay, "weight_decay": 0.1},
                               {"params": rest_plain, "weight_decay": 0.0}], lr=3e-3,
                              betas=cfg.betas, fused=True)
    ids = torch.randint(0, model_config().vocab_size, (4, 16))
    for step in range(3):
        scale = lr_at(step, cfg) / cfg.lr
        set_lr(opt, step, cfg)
        for g in muon.param_groups:
            g["lr"] = 0.02 * scale
        for g in adamw.param_groups:
            g["lr"] = 3e-3 * scale
        for model in (ours, theirs):
            model.zero_grad()
            model(ids).logsumexp(-1).mean().backward()
        opt.step()
        muon.step()
        adamw.step()
        for (name, a), b in zip(ours.state_dict().items(), theirs.state_dict().values(),
                                strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    assert {g["lr"] for g in opt.optimizers[1].param_groups} == {0.02 * scale}


def test_split_optimizer_state_round_trips_through_the_checkpoint_format() -> None:
    cfg = train_config(**MUON)
    trainer = make_trainer(cfg)
    trainer.fit(stop_at=3)
    saved = flatten_optimizer(trainer.optimizer)  # type: ignore[arg-type]
    assert any(k.endswith("momentum_buffer") for k in saved.tensors)
    assert any(k.endswith("exp_avg_sq") for k in saved.tensors)
    fresh = make_trainer(cfg, model_seed=5)
    restore_optimizer(fresh.optimizer, saved)  # type: ignore[arg-type]
    a, b = trainer.optimizer.state_dict(), fresh.optimizer.state_dict()
    assert a["param_groups"] == b["param_groups"]
    assert a["state"].keys() == b["state"].keys()
    for pid, entry in a["state"].items():
        for key, value in entry.items():
            assert torch.equal(value, b["state"][pid][key]), (pid, key)


def test_pause_and_resume_with_muon_equals_the_straight_run(tmp_path: Path) -> None:
    cfg = train_config(**MUON, max_steps=10, checkpoint_interval=4, schedule="wsd",
                       decay_fraction=0.5, embed_lr=1e-2)
    straight = make_trainer(cfg)
    losses = straight.fit().train_losses
    first = make_trainer(cfg, ckpt_dir=tmp_path)
    head = first.fit(stop_at=4).train_losses
    state = read_trainer_state(list_checkpoints(tmp_path)[-1].path)
    assert any(k.endswith("momentum_buffer") for k in state.tensors)
    second = make_trainer(cfg, model_seed=9, ckpt_dir=tmp_path)
    second.resume(list_checkpoints(tmp_path)[-1].path)
    assert head + second.fit().train_losses == losses
    for k, v in weights(straight.model).items():
        assert torch.equal(v, weights(second.model)[k]), k
    # Muon really trained differently from AdamW alone.
    assert make_trainer(train_config(max_steps=10)).fit().train_losses != losses


def test_embed_lr_gives_the_embedding_its_own_rate() -> None:
    cfg = train_config(lr=1e-3, embed_lr=5e-3, warmup_steps=0, schedule="constant")
    opt = build_optimizer(DecoderLM(model_config()), cfg)
    set_lr(opt, 0, cfg)
    rates = sorted({g["lr"] for g in opt.param_groups})
    assert rates == [1e-3, 5e-3]


def test_muon_is_refused_under_fsdp_and_bad_values_are_named() -> None:
    with pytest.raises(ValueError, match="fsdp"):
        TrainConfig(optimizer="muon", strategy="fsdp")
    with pytest.raises(ValueError, match="optimizer"):
        TrainConfig(optimizer="sgd")
    with pytest.raises(ValueError, match="muon_lr_adjust"):
        TrainConfig(muon_lr_adjust="moonshot")
    with pytest.raises(ValueError, match="muon_momentum"):
        TrainConfig(muon_momentum=1.0)
    with pytest.raises(ValueError, match="decay_fraction"):
        TrainConfig(decay_fraction=0.0)
    restored = TrainConfig.from_dict(json.loads(TrainConfig(**MUON).to_json()))
    assert restored.optimizer == "muon" and restored.muon_lr == 0.02


def test_wsd_holds_the_rate_then_decays_linearly_over_the_last_fraction() -> None:
    cfg = TrainConfig(lr=1e-3, min_lr=1e-4, warmup_steps=10, max_steps=110, schedule="wsd",
                      decay_fraction=0.5)
    assert lr_at(0, cfg) == pytest.approx(1e-3 / 11)
    assert lr_at(10, cfg) == lr_at(54, cfg) == lr_at(55, cfg) == pytest.approx(1e-3)
    assert lr_at(55 + 11, cfg) == pytest.approx(1e-3 - 9e-4 * 0.2)
    assert lr_at(110, cfg) == pytest.approx(1e-4)
    assert lr_at(500, cfg) == pytest.approx(1e-4)
    lrs = [lr_at(s, cfg) for s in range(10, 111)]
    assert all(a >= b for a, b in itertools.pairwise(lrs))  # never rises after warm-up


def test_sequence_warmup_grows_the_window_and_resumes_exactly(tmp_path: Path) -> None:
    cfg = train_config(max_steps=10, seq_warmup_steps=6, seq_warmup_start=8,
                       checkpoint_interval=3)
    from handformer.train.optim import window_at

    widths = [window_at(s, cfg) for s in range(10)]
    assert widths[0] == 8 and widths[6:] == [cfg.block_size] * 4
    assert widths == sorted(widths) and all(w % 8 == 0 for w in widths)
    seen: list[int] = []

    def forward(model: torch.nn.Module, batch) -> torch.Tensor:  # type: ignore[no-untyped-def]
        if model.training:
            seen.append(batch.ids.shape[1])
        return model(batch.ids, padding_mask=batch.padding_mask)

    straight = make_trainer(cfg, forward_fn=forward)
    losses = straight.fit().train_losses
    assert seen == widths
    first = make_trainer(cfg, ckpt_dir=tmp_path)
    head = first.fit(stop_at=3).train_losses
    second = make_trainer(cfg, model_seed=4, ckpt_dir=tmp_path)
    second.resume(list_checkpoints(tmp_path)[-1].path)
    assert head + second.fit().train_losses == losses
    with pytest.raises(ValueError, match="seq_warmup_start"):
        TrainConfig(seq_warmup_start=0)


def test_first_tokens_needs_per_token_targets() -> None:
    from handformer.data import Batch

    lm = Batch(torch.arange(12).view(2, 6), torch.arange(12).view(2, 6),
               torch.ones(2, 6, dtype=torch.bool))
    short = lm.first_tokens(4)
    assert short.ids.shape == short.targets.shape == short.padding_mask.shape == (2, 4)
    with pytest.raises(ValueError, match="per-token targets"):
        Batch(torch.zeros(2, 6, dtype=torch.long), torch.zeros(2, dtype=torch.long)) \
            .first_tokens(4)


def test_muon_settings_reach_torchs_optimizer() -> None:
    cfg = train_config(**MUON, muon_ns_steps=3, muon_momentum=0.9,
                       muon_lr_adjust="original")
    opt = build_optimizer(DecoderLM(model_config()), cfg)
    assert isinstance(opt, SplitOptimizer)
    group = opt.optimizers[1].param_groups[0]
    assert (group["ns_steps"], group["momentum"], group["adjust_lr_fn"], group["lr"]) == \
        (3, 0.9, "original", 0.02)
    with pytest.raises(ValueError, match="muon_ns_steps"):
        TrainConfig(muon_ns_steps=0)


def test_batch_warmup_grows_the_batch_over_the_same_draws_and_resumes_exactly(
        tmp_path: Path) -> None:
    from handformer.train.optim import batch_rows_at

    cfg = train_config(batch_size=8, max_steps=10, batch_warmup_steps=6, batch_warmup_start=2,
                       checkpoint_interval=3)
    rows = [batch_rows_at(s, cfg) for s in range(10)]
    assert rows[0] == 2 and rows[6:] == [8] * 4 and rows == sorted(rows)
    assert rows[:6] == [2, 3, 4, 5, 6, 7]
    # Multiples of the rank count while growing, never below the start.
    assert [batch_rows_at(s, cfg, multiple=4) for s in range(7)] == [2, 2, 4, 4, 4, 4, 8]
    seen: list[torch.Tensor] = []

    def forward(model: torch.nn.Module, batch) -> torch.Tensor:  # type: ignore[no-untyped-def]
        if model.training:
            seen.append(batch.ids.clone())
        return model(batch.ids, padding_mask=batch.padding_mask)

    straight = make_trainer(cfg, forward_fn=forward)
    losses = straight.fit().train_losses
    assert [s.shape[0] for s in seen] == rows
    # The full batch is drawn every step: the warm-up trains on its first rows, so a seed's
    # data does not depend on the warm-up.
    full: list[torch.Tensor] = []
    plain = train_config(batch_size=8, max_steps=10)
    make_trainer(plain, forward_fn=lambda m, b: (full.append(b.ids.clone()) if m.training
                                                 else None) or m(b.ids)).fit()
    assert all(torch.equal(s, f[:s.shape[0]]) for s, f in zip(seen, full, strict=True))
    first = make_trainer(cfg, ckpt_dir=tmp_path)
    head = first.fit(stop_at=4).train_losses
    second = make_trainer(cfg, model_seed=4, ckpt_dir=tmp_path)
    second.resume(list_checkpoints(tmp_path)[-1].path)
    assert head + second.fit().train_losses == losses
    assert all(torch.equal(a, b) for a, b in zip(weights(second.model).values(),
                                                  weights(straight.model).values(), strict=True))
    restored = TrainConfig.from_dict(json.loads(cfg.to_json()))
    assert (restored.batch_warmup_steps, restored.batch_warmup_start) == (6, 2)
    with pytest.raises(ValueError, match="batch_warmup_start"):
        TrainConfig(batch_size=8, batch_warmup_steps=5, batch_warmup_start=9)
    with pytest.raises(ValueError, match="batch_warmup_start"):
        TrainConfig(batch_warmup_start=0)
    with pytest.raises(ValueError, match="batch_warmup_steps"):
        TrainConfig(batch_warmup_steps=-1)


def test_first_rows_keeps_whole_examples() -> None:
    from handformer.data import Batch

    lm = Batch(torch.arange(12).view(3, 4), torch.arange(12).view(3, 4),
               torch.ones(3, 4, dtype=torch.bool))
    two = lm.first_rows(2)
    assert two.ids.shape == two.targets.shape == two.padding_mask.shape == (2, 4)
    labels = Batch(torch.zeros(3, 4, dtype=torch.long), torch.tensor([0, 1, 2])).first_rows(1)
    assert labels.targets.tolist() == [0] and labels.padding_mask is None
    with pytest.raises(ValueError, match="first_rows"):
        lm.first_rows(4)
