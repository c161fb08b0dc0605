"""The classic mistakes a checker can name: what each one looks like and how to fix it.

The rows come from the doctor's bug zoo and the tutorial's pitfalls. A checker diagnoses a
row by *reproducing* it: it runs the mistake on the reference (``learn/reference.py``) and
compares the result with the reader's, so a diagnosis is a measured match, not a guess from
the symptom. Every row is a test (``tests/learn/test_learn_mistakes.py``): a buggy
implementation gets that diagnosis, and the correct one passes.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MISTAKES", "Mistake"]


@dataclass(frozen=True)
class Mistake:
    """One row of the table: a classic mistake, what it does, and the line that fixes it."""

    key: str
    title: str  # what is wrong, in the reader's words
    why: str  # what it does to the model
    fix: str  # the line to write instead


_ROWS = (
    Mistake("unscaled", "the scores are not divided by √D",
            "their spread grows like √D, the softmax saturates and its gradients vanish",
            "scores = q @ k.transpose(-2, -1) / math.sqrt(q.size(-1))"),
    Mistake("softmax_axis", "the softmax runs over the wrong axis",
            "each key's column sums to 1 instead of each query's row: a query no longer gets "
            "a distribution over the keys",
            "weights = scores.softmax(dim=-1)  # over the keys S of (B, H, T, S)"),
    Mistake("mask_polarity", "the mask has the wrong polarity",
            "True is read as 'ignore' (torch's nn.MultiheadAttention convention): the model "
            "attends exactly where it must not — for a causal mask, to the future",
            "keep True = may attend, and fill where the mask is False: "
            "scores.masked_fill(~mask, torch.finfo(scores.dtype).min)"),
    Mistake("mask_transposed", "the causal mask is transposed",
            "query i sees keys j ≥ i: the future leaks, the training loss looks wonderful "
            "and generation falls apart",
            "torch.tril(torch.ones(T, T, dtype=torch.bool)): rows are queries, columns keys"),
    Mistake("mask_missing", "there is no causal mask, or one of the wrong polarity",
            "every position sees the tokens after it: the loss falls fast by copying the "
            "answer, and generation, which has no future to read, falls apart",
            "pass torch.tril(torch.ones(T, T, dtype=torch.bool)) to every attention layer and "
            "fill where it is False"),
    Mistake("mask_broadcast", "the mask does not line up with the scores (B, H, T, S)",
            "broadcasting aligns shapes from the right, so a (B, S) mask meets (T, S): it "
            "fails when B ≠ T and silently masks the wrong thing when B == T",
            "give the padding mask its head and query axes: mask[:, None, None, :] "
            "→ (B, 1, 1, S)"),
    Mistake("view_contiguous", "view after transpose, without contiguous",
            "transpose changes strides, not memory; view can only re-read memory in order",
            "x.transpose(1, 2).contiguous().view(B, T, C)  (or .reshape(B, T, C))"),
    Mistake("heads_merged", "the heads are merged in the wrong order",
            "(B, H, T, D) reshaped straight to (B, T, C) glues rows of different tokens "
            "together",
            "out.transpose(1, 2).contiguous().view(B, T, C)  # (B, H, T, D) → (B, T, H, D) "
            "→ (B, T, C)"),
    Mistake("heads_split", "the heads are split in the wrong order",
            "(B, T, C) viewed straight as (B, H, T, D) cuts across tokens instead of across "
            "channels",
            "x.view(B, T, H, D).transpose(1, 2)  # (B, T, C) → (B, T, H, D) → (B, H, T, D)"),
    Mistake("positions_missing", "the positions are not added",
            "without positions attention is blind to order: a repeated token gets the same "
            "output at every position",
            "return x + self.pe[:, : x.size(1)]"),
    Mistake("positions_twice", "the positions are added twice",
            "the position signal is doubled and drowns the token embeddings",
            "add the encoding once, in one place (the embedding stage)"),
    Mistake("layer_norm_axis", "LayerNorm normalises over the wrong axis",
            "statistics over the sequence (or the batch) mix tokens together: a token's "
            "output depends on its neighbours, and padding changes it",
            "mean = x.mean(-1, keepdim=True); var = x.var(-1, keepdim=True, unbiased=False)"),
    Mistake("layer_norm_unbiased", "LayerNorm uses the unbiased (n − 1) variance",
            "torch's LayerNorm divides by n; with n − 1 every output is slightly too small",
            "x.var(-1, keepdim=True, unbiased=False)"),
    Mistake("no_residual", "a sub-layer has no residual connection",
            "x = f(x) instead of x = x + f(x): the signal and the gradient must pass through "
            "every weight, and deep stacks stop training",
            "x = x + self.attn(self.norm1(x), mask); x = x + self.ffn(self.norm2(x))"),
    Mistake("no_activation", "the feed-forward network has no non-linearity",
            "two linear maps in a row are one linear map: the FFN adds no capacity",
            "return self.linear2(torch.relu(self.linear1(x)))"),
    Mistake("targets_unshifted", "the targets are not shifted",
            "targets[:, t] must be the *next* token ids[:, t + 1]; unshifted, the model learns "
            "to copy the token it is reading",
            "inputs, targets = ids[:, :-1], ids[:, 1:]"),
    Mistake("targets_shifted_right", "the targets are shifted the wrong way",
            "targets[:, t] = ids[:, t − 1] asks the model to repeat the token before",
            "inputs, targets = ids[:, :-1], ids[:, 1:]  # targets = the ids shifted left"),
    Mistake("loss_counts_padding", "the loss counts the padding",
            "the model spends capacity predicting pads, and the loss of a row changes with "
            "how much padding its batch has",
            "targets = targets.masked_fill(targets == pad_id, -100); "
            "F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)"),
    Mistake("no_zero_grad", "the gradients are never reset",
            "loss.backward() adds to .grad: every step also applies all the earlier "
            "steps' gradients",
            "optimizer.zero_grad() before loss.backward()"),
    Mistake("generate_wrong_position", "the next token is read from the wrong position",
            "the logits of the *last* position predict the next token; any other position "
            "predicts a token already in the prompt",
            "next_id = logits[:, -1].argmax(-1)  # logits (B, T, V)"),
    Mistake("cache_offset", "the KV cache forgets the offset",
            "a cached step feeds one new token whose position is the cache's length, not 0, "
            "and whose causal mask is aligned to the end of the cached keys; forgetting that "
            "makes every step after the first differ from the full recompute",
            "positions = torch.arange(past, past + T)  # past = tokens already cached"),
)

MISTAKES: dict[str, Mistake] = {m.key: m for m in _ROWS}
