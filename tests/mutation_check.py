"""How strong is the suite? Inject known bugs, one at a time, and check the tests catch each.

Each mutant is a one-spot edit of the package (an exact snippet replaced by a wrong one) and
the test files that should notice it. For every mutant the package is copied to a
temporary folder, the edit is applied there (the working tree is never touched), and those
tests run against the copy; the mutant is *caught* when they fail. A baseline run of the
same tests on an unmutated copy must pass first, or "caught" would mean nothing (once per
distinct set of tests: many mutants share theirs).

The list starts from bugs that once slipped past the suite (RoPE applied to queries only, a
dropped final LayerNorm, fused kernels never compared with the reference, ``<unk>``
silently dropped, an explorer crop keeping the wrong end, a run folder with missing
tensors, a classifier whose weights never train) and adds classic Transformer bugs (causal
mask flipped, padding counted in the loss, no 1/√D). Add a mutant whenever a bug escapes.

The second half pins levers to their exact meaning (``tests/test_levers_model.py``,
``tests/train/test_levers_train.py``): ALiBi slopes reversed across the heads, query head h
reading kv head h % Hkv, an epsilon or a base that never arrives, QK-norm after RoPE, clipping
before unscaling, a schedule one step ahead, Muon taking the embedding, ... — and the doctor's
thresholds (``tests/doctor/test_doctor_smallest.py``): each check loosened just enough that
the smallest break it claims to catch would pass.

    python tests/mutation_check.py            # all mutants, one at a time (what CI runs)
    python tests/mutation_check.py --jobs 2   # two at a time, one per core
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
from concurrent.futures import ThreadPoolExecutor
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
        "final_norm_dropped", "models/trunk.py",
        "        return self.final_norm(x)  # (B, T, C)",
        "        return x  # (B, T, C)",
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
        "            positions = self._next_position[:, None].clone()  # (B, 1)",
        "            positions = torch.zeros_like(self._next_position[:, None])  # (B, 1)",
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
        "self._next_position.copy_(kept.sum(dim=1))",
        "self._next_position.copy_(self._next_position)",
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
        "int8_native_bias_dropped", "nn/int8_kernel.c",
        "y[(m0 + i) * n_len + n + j] = bias != NULL ? out + bias[n + j] : out;",
        "y[(m0 + i) * n_len + n + j] = out;",
        ("tests/nn/test_int8_native.py",),
        "the C int8 loop forgets the layer's bias",
    ),
    Mutant(
        "int8_native_odd_sums_dropped", "nn/int8_kernel.c",
        "SUM(U == 2 ? ADD(acc[i][j][0], acc[i][j][1]) : acc[i][j][0])",
        "SUM(acc[i][j][0])",
        ("tests/nn/test_int8_native.py",),
        "the C int8 loop's tiles drop their second (odd-vector) sums",
    ),
    Mutant(
        "int8_native_row_odd_sums_dropped", "nn/int8_kernel.c",
        "dot += SUM(ADD(a0, a1));",
        "dot += SUM(a0);",
        ("tests/nn/test_int8_native.py",),
        "the C int8 loop's one-row path (decoding) drops its second (odd-vector) sums",
    ),
    Mutant(
        "int8_native_row_bias_dropped", "nn/int8_kernel.c",
        "y[n] = bias != NULL ? out + bias[n] : out;",
        "y[n] = out;",
        ("tests/nn/test_int8_native.py",),
        "the C int8 loop's one-row path (decoding) forgets the layer's bias",
    ),
    Mutant(
        "decode_gqa_head_wrong", "nn/decode_attention.c",
        "k + (h / group) * head_stride, d_len) * scale;",
        "k + (h % (h_len / group)) * head_stride, d_len) * scale;",
        ("tests/nn/test_decode_attention.py",),
        "the C decoding attention gives query head h the key/value head h mod Hkv, not h / G",
    ),
    Mutant(
        "decode_avx512_fold_reordered", "nn/decode_attention.c",
        "    __m128 c = _mm_add_ps(b, _mm_movehl_ps(b, b));\n"
        "    return _mm_cvtss_f32(c) + _mm_cvtss_f32(_mm_shuffle_ps(c, c, 1));\n}\n\n/* acc[d]",
        "    return (_mm_cvtss_f32(b) + _mm_cvtss_f32(_mm_shuffle_ps(b, b, 1)))\n"
        "           + (_mm_cvtss_f32(_mm_shuffle_ps(b, b, 2))\n"
        "              + _mm_cvtss_f32(_mm_shuffle_ps(b, b, 3)));\n}\n\n/* acc[d]",
        ("tests/nn/test_decode_attention.py",),
        "the C decoding attention's AVX-512 path folds its lanes in another order than the "
        "others (right to within rounding, but no longer the same bits on every CPU)",
    ),
    Mutant(
        "decode_packed_key_start_unstrided", "nn/decode_attention.py",
        "base = [start * k.stride(2) for _, _, start, _ in spans]",
        "base = [start for _, _, start, _ in spans]",
        ("tests/nn/test_decode_attention.py",),
        "a packed batch's segments read their keys from the wrong place in the gathered copy",
    ),
    Mutant(
        "decode_block_residual_dropped", "nn/decode_block.c",
        "for (int64_t i = 0; i < c; i++) y[i] = x1[i] + y[i];",
        "for (int64_t i = 0; i < c; i++) y[i] = y[i];",
        ("tests/nn/test_decode_block.py",),
        "the block kernel returns the feed-forward's output without the residual stream",
    ),
    Mutant(
        "decode_block_own_key_left_out", "nn/decode_block.c",
        "k0, v0, t + 1, row, d,",
        "k0, v0, t > 0 ? t : 1, row, d,",
        ("tests/nn/test_decode_block.py",),
        "the block kernel writes the token's key and value but attends only to the earlier ones",
    ),
    Mutant(
        "decode_block_blind_to_hooks", "nn/decode_block.py",
        "    return bool(module._forward_hooks or module._forward_pre_hooks\n",
        "    return False and bool(module._forward_hooks or module._forward_pre_hooks\n",
        ("tests/nn/test_decode_block.py",),
        "the block kernel runs even where a hook or an attention capture watches a module, "
        "which then misses those steps",
    ),
    Mutant(
        "decode_stack_blind_to_block_hooks", "nn/decode_block.py",
        "        own = block.training or _watched(block)  # its own forward: dropout, hooks\n",
        "        own = block.training  # its own forward: dropout, hooks\n",
        ("tests/nn/test_decode_block.py",),
        "the stack kernel runs every block in one call even where a hook watches a block "
        "itself, which then misses those steps",
    ),
    Mutant(
        "decode_token_position_left_at_zero", "nn/decode_block.py",
        "start, ids.data_ptr(), start, ctypes.byref(self.ends),",
        "start, ids.data_ptr(), 0, ctypes.byref(self.ends),",
        ("tests/nn/test_decode_block.py",),
        "the whole-token kernel adds the first position's vector to every token, so a cached "
        "decoding step forgets where it is",
    ),
    Mutant(
        "greedy_token_takes_the_last_of_a_tie", "nn/decode_block.c",
        "        if (a > best) {",
        "        if (a >= best) {",
        ("tests/nn/test_decode_block.py",),
        "greedy decoding's kernel picks the last of equal logits where torch's argmax (the "
        "modules' path) picks the first",
    ),
    Mutant(
        "greedy_token_picks_plus_inf", "nn/decode_block.c",
        "        bad |= isnan(a) || a == INFINITY;",
        "        bad |= isnan(a);",
        ("tests/nn/test_decode_block.py",),
        "greedy decoding's kernel picks a +inf logit where sampling refuses logits that hold one",
    ),
    Mutant(
        "greedy_token_position_left_at_zero", "nn/decode_block.py",
        "code = self.fn(*self.args, start, at - 8, start, *self.where, at)",
        "code = self.fn(*self.args, start, at - 8, 0, *self.where, at)",
        ("tests/nn/test_decode_block.py",),
        "greedy decoding's one-call token adds the first position's vector to every token",
    ),
    Mutant(
        "greedy_token_blind_to_model_hooks", "nn/decode_block.py",
        "or not tokens.is_cpu or not tokens.is_contiguous() or _watched(model)):",
        "or not tokens.is_cpu or not tokens.is_contiguous()):",
        ("tests/nn/test_decode_block.py",),
        "greedy decoding runs its tokens in one C call even where a hook watches the model, "
        "which then misses those steps",
    ),
    Mutant(
        "generate_greedy_kernel_for_any_model", "generate/plain.py",
        "and batch_size == 1 and type(model).forward is DecoderLM.forward)",
        "and batch_size == 1)",
        ("tests/nn/test_decode_block.py",),
        "generate's greedy kernel stands in for the call of a model whose forward is its own "
        "(a subclass), whose logits it then never sees",
    ),
    Mutant(
        "generate_keeps_the_checks_after_any_on_token", "generate/plain.py",
        "                    if not on_token_keeps_model:\n                        hold.forget()",
        "                    if False:\n                        hold.forget()",
        ("tests/nn/test_decode_block.py",),
        "generate trusts every on_token callback to leave the model alone, so a hook or a "
        "weight it adds between tokens is skipped by the held token kernel",
    ),
    Mutant(
        "speculative_keeps_the_checks_after_any_on_token", "generate/speculative.py",
        "                if on_token is not None and not on_token_keeps_model:\n"
        "                    hold.forget()",
        "                if False:\n                    hold.forget()",
        ("tests/generate/test_speculative.py",),
        "speculative decoding trusts every on_token callback to leave both models alone, so "
        "an int8 draft changed between steps is run as it was first checked",
    ),
    Mutant(
        "int8_weights_left_in_small_pages", "models/quantize.py",
        "    _pack_int8_weights(target)\n    return target\n",
        "    return target\n",
        ("tests/nn/test_huge_pages.py",),
        "quantize_int8 leaves each int8 weight where torch put it, in 4 KiB pages, so a "
        "decoding step's stream pays a page walk every 4 KiB",
    ),
    Mutant(
        "kv_cache_left_in_small_pages", "nn/kv_cache.py",
        "        buffers = (huge_pages.zeros([shape] * n_layers, dtype)\n",
        "        buffers = (None\n",
        ("tests/nn/test_huge_pages.py",),
        "a CPU DecoderCache takes each layer's buffer from torch, in 4 KiB pages, so a "
        "decoding step's cache reads pay a page walk every 4 KiB",
    ),
    Mutant(
        "decode_mixed_step_one_repeated", "nn/attention.py",
        "            done += 1\n            continue\n",
        "            continue\n",
        ("tests/serve/test_paged.py",),
        "in a step mixing prefill chunks with decoding requests, every decoding request gets "
        "the first one's attention",
    ),
    Mutant(
        "int8_streams_interleaved", "nn/quantized.py",
        "out = torch.stack(columns, dim=1).view(x.shape[0], n)",
        "out = torch.stack(columns, dim=0).view(x.shape[0], n)",
        ("tests/nn/test_quantized.py",),
        "the fused int8 kernel puts its two weight streams' outputs in the wrong rows",
    ),
    Mutant(
        "alibi_slopes_reversed", "nn/attention.py",
        'self.register_buffer("alibi_slopes", alibi_slopes(n_heads), persistent=False)',
        'self.register_buffer("alibi_slopes", alibi_slopes(n_heads).flip(0), persistent=False)',
        ("tests/test_levers_model.py",),
        "ALiBi slopes assigned to the heads in reversed order (alibi_slopes() itself is right)",
    ),
    Mutant(
        "gqa_query_head_h_mod_hkv", "nn/attention.py",
        "        k = k.repeat_interleave(groups, dim=1)  # (B, H, S, D)\n"
        "        v = v.repeat_interleave(groups, dim=1)  # (B, H, S, Dv)\n",
        "        k = k.repeat(1, groups, 1, 1)  # (B, H, S, D)\n"
        "        v = v.repeat(1, groups, 1, 1)  # (B, H, S, Dv)\n",
        ("tests/test_levers_model.py",),
        "grouped-query attention: query head h reads kv head h % Hkv instead of h // G",
    ),
    Mutant(
        "rope_base_ignored", "nn/attention.py",
        "RotaryEmbedding(self.head_dim, rope_base, rope_scaling)",
        "RotaryEmbedding(self.head_dim, scaling=rope_scaling)",
        ("tests/test_levers_model.py",),
        "rope_base never reaches the rotary embedding (every model rotates with base 10000)",
    ),
    Mutant(
        "qk_norm_after_rope_on_keys", "nn/attention.py",
        "            if self.k_norm is not None:\n"
        "                k = self.k_norm(k)\n"
        "            if rotate_keys:\n"
        "                k = self.rotary(k, positions)  # type: ignore[misc]\n",
        "            if rotate_keys:\n"
        "                k = self.rotary(k, positions)  # type: ignore[misc]\n"
        "            if self.k_norm is not None:\n"
        "                k = self.k_norm(k)\n",
        ("tests/test_levers_model.py",),
        "QK-norm applied to the keys after RoPE instead of before (the gains do not commute)",
    ),
    Mutant(
        "layernorm_eps_ignored", "nn/norm.py",
        "return nn.LayerNorm(dim, eps=eps, bias=bias)",
        "return nn.LayerNorm(dim, bias=bias)",
        ("tests/test_levers_model.py",),
        "layer_norm_eps is dropped: every LayerNorm uses torch's default 1e-5",
    ),
    Mutant(
        "rmsnorm_eps_ignored", "nn/norm.py",
        "return RMSNorm(dim, eps=eps)",
        "return RMSNorm(dim)",
        ("tests/test_levers_model.py",),
        "layer_norm_eps is dropped for RMSNorm blocks",
    ),
    Mutant(
        "softcap_without_division", "models/trunk.py",
        "cap * torch.tanh(logits / cap)  # (B, T, V)",
        "cap * torch.tanh(logits)  # (B, T, V)",
        ("tests/test_levers_model.py",),
        "soft-capping computes cap·tanh(x) instead of cap·tanh(x / cap)",
    ),
    Mutant(
        "sinusoidal_scale_dropped", "models/embedding.py",
        'self.scale = math.sqrt(c.d_model) if c.positional == "sinusoidal" else 1.0',
        "self.scale = 1.0",
        ("tests/test_levers_model.py",),
        "token vectors not scaled by √C under sinusoidal positions",
    ),
    Mutant(
        "embedding_dropout_dropped", "models/embedding.py",
        "return apply_dropout(self.dropout, x), positions",
        "return x, positions",
        ("tests/test_levers_model.py",),
        "dropout never applied to the embedding output",
    ),
    Mutant(
        "swiglu_gate_on_the_wrong_half", "nn/feedforward.py",
        "return F.silu(gate) * up",
        "return gate * F.silu(up)",
        ("tests/test_levers_model.py",),
        "SwiGLU gates with the second half of fc_in (a checkpoint's gate/up order swapped)",
    ),
    Mutant(
        "gelu_always_tanh", "nn/feedforward.py",
        'approximate="tanh" if self.activation == "gelu_tanh" else "none"',
        'approximate="tanh"',
        ("tests/test_levers_model.py",),
        "activation gelu runs GELU's tanh approximation (they differ by up to 5e-4)",
    ),
    Mutant(
        "residual_init_not_scaled_by_depth", "nn/init.py",
        "residual_std = 0.02 / math.sqrt(2 * n_layers)",
        "residual_std = 0.02",
        ("tests/test_levers_model.py",),
        "out_proj / fc_out start at std 0.02 instead of 0.02/√(2L)",
    ),
    Mutant(
        "clip_before_unscale", "train/trainer.py",
        "            scaler.unscale_(self.optimizer)  # clip and report the true gradient norm",
        "            pass  # clip and report the true gradient norm",
        ("tests/train/test_levers_train.py",),
        "under a GradScaler the gradients are clipped while still scaled (unscaled in step)",
    ),
    Mutant(
        "accumulation_plain_mean", "train/trainer.py",
        "weights = [c * world / max(total, 1) for c in counts]",
        "weights = [world / len(counts) for c in counts]",
        ("tests/train/test_levers_train.py",),
        "micro-batches averaged equally instead of by their share of target tokens",
    ),
    Mutant(
        "schedule_decay_off_by_one", "train/optim.py",
        "progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)",
        "progress = min(1.0, (step - cfg.warmup_steps + 1) / decay_steps)",
        ("tests/train/test_levers_train.py",),
        "cosine / linear decay one step ahead of the schedule",
    ),
    Mutant(
        "muon_takes_every_matrix", "train/optim.py",
        "hidden = [p for n, p in _unique_params(model) if is_hidden_matrix(n, p)]",
        "hidden = [p for n, p in _unique_params(model) if p.dim() == 2]",
        ("tests/train/test_levers_train.py",),
        "Muon also trains the embedding and the head (the recorded split still says not)",
    ),
    Mutant(
        "positions_decayed", "train/optim.py",
        "elif param.dim() >= 2 and not _is_position_table(name):",
        "elif param.dim() >= 2:",
        ("tests/train/test_levers_train.py",),
        "weight decay pulls the learned position table toward zero",
    ),
    Mutant(
        "betas_ignored", "train/optim.py",
        "adamw = torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, fused=fused)",
        "adamw = torch.optim.AdamW(groups, lr=cfg.lr, fused=fused)",
        ("tests/train/test_levers_train.py",),
        "TrainConfig.betas never reaches AdamW (torch's default 0.9, 0.999)",
    ),
    Mutant(
        "untied_head_misses_embed_lr", "train/optim.py",
        'return name.endswith("token.weight") or name.startswith("lm_head.")',
        'return name.endswith("token.weight")',
        ("tests/train/test_levers_train.py",),
        "embed_lr applies to the token embedding but not to an untied head",
    ),
    Mutant(
        "muon_momentum_ignored", "train/optim.py",
        "momentum=cfg.muon_momentum, nesterov=True,",
        "momentum=0.95, nesterov=True,",
        ("tests/train/test_levers_train.py",),
        "muon_momentum never reaches Muon",
    ),
    Mutant(
        "muon_ns_steps_ignored", "train/optim.py",
        "ns_steps=cfg.muon_ns_steps, adjust_lr_fn=cfg.muon_lr_adjust)",
        "ns_steps=5, adjust_lr_fn=cfg.muon_lr_adjust)",
        ("tests/train/test_levers_train.py",),
        "muon_ns_steps never reaches Muon (always five Newton–Schulz iterations)",
    ),
    Mutant(
        "window_warmup_not_rounded", "train/optim.py",
        "min(cfg.block_size, int(grown) // 8 * 8))",
        "min(cfg.block_size, int(grown)))",
        ("tests/train/test_levers_train.py",),
        "the warm-up window grows token by token instead of in multiples of 8",
    ),
    Mutant(
        "causality_probe_three_cuts", "doctor/checks_masks.py",
        "        return list(range(last + 1))",
        "        return sorted({0, t_len // 2, last})",
        ("tests/doctor/test_doctor_smallest.py",),
        "the causality probe cuts at three positions only: a one-pair leak in between passes",
    ),
    Mutant(
        "causality_probe_ignores_weights", "doctor/checks_masks.py",
        "    if leaks[worst_t] <= tol and future:",
        "    if False:",
        ("tests/doctor/test_doctor_smallest.py",),
        "attention weight on a future key is not a failure unless a logit moved",
    ),
    Mutant(
        "pad_key_threshold_loose", "doctor/checks_masks.py",
        "if worst_pad > 1e-6 or worst_sum > 1e-4:",
        "if worst_pad > 1e-3 or worst_sum > 1e-4:",
        ("tests/doctor/test_doctor_smallest.py",),
        "the pad-key check lets real queries put 1e-5 of their attention on padding",
    ),
    Mutant(
        "scale_tolerance_loose", "doctor/checks_attention.py",
        "abs(f[0] / f[2] - 1.0) > 0.05}",
        "abs(f[0] / f[2] - 1.0) > 0.1}",
        ("tests/doctor/test_doctor_smallest.py",),
        "the scale check lets a score scale 6% off 1/√D pass",
    ),
    Mutant(
        "update_ratio_fail_threshold", "doctor/checks_grads.py",
        "    if finite[top] >= 1.0:",
        "    if finite[top] >= 1.5:",
        ("tests/doctor/test_doctor_smallest.py",),
        "an update as large as the weights is only a warning",
    ),
    Mutant(
        "first_loss_band_loose", "doctor/checks_loss.py",
        "    if abs(gap) <= 0.25:",
        "    if abs(gap) <= 0.5:",
        ("tests/doctor/test_doctor_smallest.py",),
        "a first loss 0.3 nats above ln V passes as uniform",
    ),
    Mutant(
        "targets_threshold_loose", "doctor/checks_loss.py",
        '    if frac["next"] >= 0.99:',
        '    if frac["next"] >= 0.98:',
        ("tests/doctor/test_doctor_smallest.py",),
        "targets right at 98.3% of the positions pass the shift check",
    ),
    Mutant(
        "llama_rope_rows_not_permuted", "interop/llama.py",
        'q = _half_to_pairs(hf[p + "self_attn.q_proj.weight"], h, d)  # (H·D, C)',
        'q = hf[p + "self_attn.q_proj.weight"]  # (H·D, C)',
        ("tests/interop/test_interop_llama.py::test_logits_match_transformers[Qwen3-0.6B]",),
        "Hugging Face's rotate-half query rows read as neighbour pairs: RoPE pairs the wrong "
        "channels",
    ),
    Mutant(
        "llama3_rope_blend_reversed", "nn/positional.py",
        "inv_freq = keep * inv_freq + (1 - keep) * inv_freq / s.factor",
        "inv_freq = (1 - keep) * inv_freq + keep * inv_freq / s.factor",
        ("tests/interop/test_interop_llama.py::"
         "test_llama3_scaled_rope_rotates_as_transformers_does_far_out",),
        "Llama 3's RoPE scaling interpolates the fast frequencies and keeps the slow ones",
    ),
    Mutant(
        "packed_requests_read_each_other", "serve/paged.py",
        "        self.row_spans = spans if b > 1 else None",
        "        self.row_spans = spans if False else None",
        ("tests/serve/test_paged.py",),
        "a paged batch packed into one row attends over every request's keys at once, with "
        "no mask: each request reads the others' keys and values",
    ),
    Mutant(
        "step_outputs_handed_over_twice", "serve/engine.py",
        "            outputs, self._outputs = self._outputs, []\n",
        "            outputs = self._outputs\n",
        ("tests/serve/test_engine.py",),
        "a step's outputs are never cleared once handed over: every later step hands them "
        "over again, and clients see their text repeated",
    ),
    Mutant(
        "stream_timeout_taken_for_a_disconnect", "serve/asgi.py",
        "            expired = True\n",
        "            expired = False\n",
        ("tests/serve/test_event_stream.py",),
        "a send blocked past the client timeout ends the stream as if cancelled: the stalled "
        "client is dropped without the warning that says why",
    ),
    Mutant(
        "worker_exit_skips_exit_handlers", "train/distributed.py",
        "    atexit._run_exitfuncs()\n",
        "    pass\n",
        ("tests/train/test_exit_worker.py",),
        "a torchrun worker leaves with os._exit before its exit handlers run: log handlers, "
        "progress bars and writers registered with atexit never finish",
    ),
    Mutant(
        "explore_signal_raised_inside_the_loop", "explore/server.py",
        "        if threading.current_thread() is threading.main_thread():\n",
        "        if False:\n",
        ("tests/explore/test_explore_api.py",),
        "Ctrl-C raises inside the explorer's serving loop again: it can land while a handler "
        "thread is being started, a thread nobody joins, and the process aborts at exit",
    ),
    Mutant(
        "explore_stop_helper_not_joined", "explore/server.py",
        "                        stopper.join()\n",
        "                        pass\n",
        ("tests/explore/test_explore_api.py",),
        "serving returns while the signal's helper thread still holds the server: a daemon "
        "thread can free the model while the interpreter tears down, and the process aborts",
    ),
    Mutant(
        "serve_on_asyncio_beside_uvloop", "cli/serve.py",
        '        loop = "uvloop"\n',
        '        loop = "asyncio"\n',
        ("tests/serve/test_cli.py",),
        "handformer serve runs on the standard library's event loop although uvloop is "
        "installed: every streamed token costs the loop more of the engine's GIL",
    ),
    Mutant(
        "engine_process_queue_never_empties", "serve/process.py",
        "            self._unanswered.discard(request_id)\n",
        "            pass\n",
        ("tests/serve/test_process.py",),
        "the server counts every request it ever sent as waiting: once max_waiting requests "
        "were answered, every later one is refused with 429",
    ),
    Mutant(
        "engine_process_deaf_while_draining", "serve/process.py",
        "            worker.stop(0, drain=message[1])",
        "            worker.stop(drain=message[1])",
        ("tests/serve/test_process.py",),
        "the engine's process stops reading commands while it finishes its requests: a client "
        "that leaves during a graceful shutdown is never cancelled, and the shutdown waits "
        "for its last token",
    ),
    Mutant(
        "packed_row_counts_unbounded", "nn/packed.py",
        "(p, p if p <= EXACT_ROWS else -(-p // ROW_STEP) * ROW_STEP)",
        "(p, p)",
        ("tests/nn/test_packed.py",),
        "a packed layer hands oneDNN every row count as it comes: the server keeps a kernel "
        "for each of them per layer shape, and its memory grows with every prefill height",
    ),
    Mutant(
        "load_run_draws_a_random_start", "runs/folder.py",
        "    with skip_init():  # every weight comes from the file, strictly: no random start "
        "to draw\n        model = build()",
        "    if True:\n        model = build()",
        ("tests/runs/test_runs.py",),
        "loading a run fills every weight with random numbers only to overwrite them from the "
        "file: seconds of start-up for a large model, and the caller's random stream moved",
    ),
    Mutant(
        "quantize_checks_only_the_first_row", "nn/quantized.py",
        "    if not bool(finite.all()):",
        "    if not bool(finite[:1].all()):",
        ("tests/nn/test_quantized.py",),
        "a NaN or inf outside a weight's first row is quantized to 0 or ±127 in silence",
    ),
    Mutant(
        "decoded_tokens_restart_their_positions", "nn/kv_cache.py",
        "self._key_positions[:, start : start + n] = self._next_position[:, None] + steps",
        "self._key_positions[:, start : start + n] = steps",
        ("tests/nn/test_kv_cache.py",),
        "tokens the one-call decoding step counted get positions from 0 once something reads "
        "them: ALiBi's bias and every later chunk's positions go wrong after a prompt",
    ),
    Mutant(
        "generate_caches_the_whole_window", "generate/plain.py",
        "    capacity = min(max_len, length + max_new_tokens)",
        "    capacity = max_len",
        ("tests/models/test_budget.py",),
        "a model with a long window asked for a few tokens allocates (and first-touches) a "
        "cache of the whole window",
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


def copy_package(dest: Path) -> Path:
    """A copy of ``src`` at ``dest``; returns its path (what PYTHONPATH points at)."""
    src = dest / "src"
    shutil.copytree(ROOT / "src", src, ignore=shutil.ignore_patterns(
        "__pycache__", "*.egg-info"))
    return src


def check(m: Mutant, tmp: Path, timeout: float) -> tuple[str, str, float, tuple[str, ...]]:
    """One mutant in a package copy of its own (its baseline has passed): the mutated copy
    must fail its tests. Returns (name, verdict, seconds of the mutated run, tests)."""
    src = copy_package(tmp / m.name)
    apply(m, src / "handformer")
    passed, seconds = run_tests(src, m.tests, timeout)
    return m.name, "survived" if passed else "caught", seconds, m.tests


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", help="mutants to run (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutants and stop")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per test run")
    parser.add_argument("--jobs", type=int, default=1,
                        help="mutants checked at once, each in its own process (each test "
                             "run takes one thread: one job per core)")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTANTS if not args.names or m.name in args.names]
    unknown = set(args.names) - {m.name for m in MUTANTS}
    if unknown:
        parser.error(f"unknown mutants {sorted(unknown)}; --list shows them")
    if args.jobs < 1:
        parser.error(f"--jobs must be at least 1; got {args.jobs}")
    if args.list:
        for m in chosen:
            print(f"{m.name:34} {m.file:28} {m.why}")
        return 0

    with tempfile.TemporaryDirectory(prefix="handformer-mutants-") as tmp, \
            ThreadPoolExecutor(max_workers=args.jobs) as pool:
        # The baseline: each distinct set of tests passes on one unmutated copy. Many mutants
        # share their tests (the lever files), and that copy is the same for all of them, so
        # each set runs once rather than once per mutant.
        clean = copy_package(Path(tmp) / "unmutated")
        test_sets = list(dict.fromkeys(m.tests for m in chosen))
        baseline = dict(zip(test_sets, pool.map(
            lambda tests: run_tests(clean, tests, args.timeout)[0], test_sets), strict=True))
        rows = [(m.name, "BASELINE FAILS", 0.0, m.tests) for m in chosen
                if not baseline[m.tests]]
        for row in rows:
            print(f"{row[0]:34} {row[1]:15}          {' '.join(row[3])}", flush=True)
        testable = [m for m in chosen if baseline[m.tests]]
        for row in pool.map(lambda m: check(m, Path(tmp), args.timeout), testable):
            name, verdict, seconds, tests = row
            print(f"{name:34} {verdict:15} {seconds:6.1f} s   {' '.join(tests)}", flush=True)
            rows.append(row)
    failures = sum(r[1] != "caught" for r in rows)
    caught = sum(r[1] == "caught" for r in rows)
    print(f"\n{caught} of {len(rows)} mutants caught")
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main())
