"""Checkers for your own Transformer: write a piece, hand it to its checker, read what it says.

Each checker takes *your* function or class, runs it on small inputs, compares it with the
library's own layer of the same job, and returns a ``CheckResult``: ``.passed`` (bool) and
``.message`` (``print(result)`` shows it) — PASS with what was checked, or FAIL with what came
out, what was expected, and the likely cause from ``MISTAKES``, the table of classic mistakes
(each diagnosed by reproducing it on the reference and matching your output). A checker never
raises on a bug in your code: an exception inside it is reported with your file and line.

=============================  ============================================================
checker                        what it calls
=============================  ============================================================
``check_attention(fn)``        ``fn(q, k, v, mask=None)`` → out (B, H, T, D) or (out, weights)
``check_causal_mask(fn)``      ``fn(T)`` → bool (T, T), True = may attend
``check_padding_mask(fn)``     ``fn(ids, pad_id)`` → bool (B, 1, 1, S), True on real tokens
``check_multi_head(cls)``      ``cls(d_model, num_heads)(x, mask=None)`` → (B, T, C)
``check_positional_encoding``  ``cls(d_model, max_len)(x)`` → x + sinusoidal positions
``check_layer_norm(cls)``      ``cls(d_model)(x)`` → normalised over C, with gain and bias
``check_feed_forward(cls)``    ``cls(d_model, d_ff)(x)`` → linear, ReLU/GELU, linear
``check_block(cls)``           ``cls(d_model, num_heads, d_ff)(x, mask=None)``, pre-norm
``check_lm(cls)``              ``cls(vocab_size=, d_model=, num_heads=, num_layers=, d_ff=,
                               max_len=)(ids)`` → logits (B, T, V); trained next to DecoderLM
``check_training_loop(fn)``    ``fn(model, optimizer, ids, pad_id)`` → the loss of one step
``check_generate(fn)``         ``fn(model, ids, max_new_tokens)`` → (B, T + max_new_tokens)
=============================  ============================================================

Each checker's docstring gives its contract in full. ``docs/build.md`` is the track that uses
them: from an empty file to a trained character LM.
"""

from handformer.learn.checks_attention import (
    check_attention,
    check_causal_mask,
    check_multi_head,
    check_padding_mask,
)
from handformer.learn.checks_layers import (
    check_block,
    check_feed_forward,
    check_layer_norm,
    check_positional_encoding,
)
from handformer.learn.checks_model import check_generate, check_lm, check_training_loop
from handformer.learn.mistakes import MISTAKES, Mistake
from handformer.learn.result import CheckResult

__all__ = ["MISTAKES", "CheckResult", "Mistake", "check_attention", "check_block",
           "check_causal_mask", "check_feed_forward", "check_generate", "check_layer_norm",
           "check_lm", "check_multi_head", "check_padding_mask", "check_positional_encoding",
           "check_training_loop"]
