"""A reader's pieces, written the way the tutorial writes them — the correct version and, one
switch each, the classic mistakes. Only the tests use them (the build track's reader writes
their own)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


def attention(q, k, v, mask=None, *, scale=True, axis=-1, polarity=True, transpose=False):
    scores = q @ k.transpose(-2, -1)  # (B, H, T, S)
    if scale:
        scores = scores / math.sqrt(q.size(-1))
    if mask is not None:
        if transpose:
            mask = mask.transpose(-2, -1)
        drop = ~mask if polarity else mask
        scores = scores.masked_fill(drop, -1e9)
    weights = torch.softmax(scores, dim=axis)
    return weights @ v, weights


def causal_mask(t, *, transpose=False, polarity=True, dtype=torch.bool):
    m = torch.tril(torch.ones(t, t)).to(dtype)
    if transpose:
        m = m.T
    return m if polarity else ~m


def padding_mask(ids, pad_id=0, *, broadcast=True, polarity=True):
    m = ids != pad_id if polarity else ids == pad_id  # (B, S)
    return m[:, None, None, :] if broadcast else m


class MultiHeadAttention(nn.Module):
    def __init__(self, d_model, num_heads, *, bug=None):
        super().__init__()
        self.h, self.d, self.bug = num_heads, d_model // num_heads, bug
        self.W_q, self.W_k, self.W_v, self.W_o = (nn.Linear(d_model, d_model) for _ in range(4))

    def forward(self, x, mask=None, cache=None):
        b, t, c = x.shape
        if self.bug == "heads_split":
            q, k, v = (w(x).reshape(b, self.h, t, self.d) for w in (self.W_q, self.W_k, self.W_v))
        else:
            q, k, v = (w(x).view(b, t, self.h, self.d).transpose(1, 2)
                       for w in (self.W_q, self.W_k, self.W_v))  # (B, H, T, D)
        if cache is not None:  # the keys and values of the tokens before these
            k, v = cache.add(k, v)  # (B, H, S, D) each
        out, _ = attention(q, k, v, mask, scale=self.bug != "unscaled")
        if self.bug == "heads_merged":
            merged = out.reshape(b, t, c)
        elif self.bug == "view_contiguous":
            merged = out.transpose(1, 2).view(b, t, c)
        else:
            merged = out.transpose(1, 2).contiguous().view(b, t, c)
        return self.W_o(merged)


class PositionalEncoding(nn.Module):
    def __init__(self, d_model, max_len=5000, *, times=1):
        super().__init__()
        pe = torch.zeros(max_len, d_model)
        position = torch.arange(max_len).unsqueeze(1).float()
        div = torch.exp(torch.arange(0, d_model, 2).float() * (-math.log(10000.0) / d_model))
        pe[:, 0::2] = torch.sin(position * div)
        pe[:, 1::2] = torch.cos(position * div)
        self.register_buffer("pe", pe.unsqueeze(0))
        self.times = times

    def forward(self, x):
        return x + self.times * self.pe[:, : x.size(1)]


class LayerNorm(nn.Module):
    def __init__(self, d_model, eps=1e-5, *, dim=-1, unbiased=False):
        super().__init__()
        self.gain, self.bias = nn.Parameter(torch.ones(d_model)), nn.Parameter(torch.zeros(d_model))
        self.eps, self.dim, self.unbiased = eps, dim, unbiased

    def forward(self, x):
        mean = x.mean(self.dim, keepdim=True)
        var = x.var(self.dim, keepdim=True, unbiased=self.unbiased)
        return self.gain * (x - mean) / torch.sqrt(var + self.eps) + self.bias


class FeedForward(nn.Module):
    def __init__(self, d_model, d_ff, *, activation=True):
        super().__init__()
        self.linear1, self.linear2 = nn.Linear(d_model, d_ff), nn.Linear(d_ff, d_model)
        self.activation = activation

    def forward(self, x):
        h = self.linear1(x)
        return self.linear2(torch.relu(h) if self.activation else h)


class TransformerBlock(nn.Module):
    def __init__(self, d_model, num_heads, d_ff, *, residual=True):
        super().__init__()
        self.attn = MultiHeadAttention(d_model, num_heads)
        self.ffn = FeedForward(d_model, d_ff)
        self.norm1, self.norm2 = LayerNorm(d_model), LayerNorm(d_model)
        self.residual = residual

    def forward(self, x, mask=None, cache=None):
        x = x + self.attn(self.norm1(x), mask, cache)
        h = self.ffn(self.norm2(x))
        return x + h if self.residual else h


class MiniLM(nn.Module):
    def __init__(self, vocab_size, d_model, num_heads, num_layers, d_ff, max_len, *,
                 mask="causal", positions=True):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.pos = PositionalEncoding(d_model, max_len)
        self.blocks = nn.ModuleList(TransformerBlock(d_model, num_heads, d_ff)
                                    for _ in range(num_layers))
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size)
        self.mask, self.positions = mask, positions

    def forward(self, ids, positions=None, caches=None):
        t = ids.size(1)
        x = self.embed(ids)
        if self.positions:
            positions = torch.arange(t) if positions is None else positions
            x = x + self.pos.pe[0, positions]
        mask = {"causal": causal_mask(t), "transposed": causal_mask(t, transpose=True),
                "none": None}[self.mask]
        if caches is not None and t == 1:
            mask = None  # one new token may see every cached key
        for i, block in enumerate(self.blocks):
            x = block(x, mask, None if caches is None else caches[i])
        return self.head(self.ln_f(x))


def training_step(model, optimizer, ids, pad_id, *, bug=None):
    inputs, targets = ids[:, :-1], ids[:, 1:]
    if bug == "targets_unshifted":
        targets = inputs
    elif bug == "targets_shifted_right":
        inputs, targets = ids[:, 1:], ids[:, :-1]
    logits = model(inputs)  # (B, T, V)
    ignore = -1 if bug == "loss_counts_padding" else pad_id
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=ignore)
    if bug != "no_zero_grad":
        optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    return loss.item()


def generate(model, ids, max_new_tokens, *, position=-1):
    for _ in range(max_new_tokens):
        logits = model(ids)
        ids = torch.cat([ids, logits[:, position].argmax(-1, keepdim=True)], dim=1)
    return ids


def generate_forgetting_the_offset(model, ids, max_new_tokens):
    """What a KV cache that forgets the offset computes: each token fed after the prompt gets
    position 0 (the cached keys keep the positions they were computed with), written as the
    equivalent full recompute."""
    out, t = ids, ids.size(1)
    for _ in range(max_new_tokens):
        positions = torch.cat([torch.arange(t), torch.zeros(out.size(1) - t, dtype=torch.long)])
        logits = model(out, positions)
        out = torch.cat([out, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return out


class KVCache:
    def __init__(self):
        self.k = self.v = None  # (B, H, S, D) each, growing along S

    @property
    def length(self):
        return 0 if self.k is None else self.k.size(2)

    def add(self, k, v):
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        return self.k, self.v


def generate_cached(model, ids, max_new_tokens, *, offset=True):
    """The build track's KV-cache generation: the prompt once, then one token per call, at
    position ``past`` — or, with ``offset=False``, the bug: at position 0."""
    caches = [KVCache() for _ in model.blocks]
    logits = model(ids, caches=caches)  # the prefill
    for _ in range(max_new_tokens):
        next_id = logits[:, -1].argmax(-1, keepdim=True)  # (B, 1)
        ids = torch.cat([ids, next_id], dim=1)
        past = caches[0].length if offset else 0
        logits = model(next_id, torch.arange(past, past + 1), caches)
    return ids
