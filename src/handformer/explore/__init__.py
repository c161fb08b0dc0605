"""See inside a run: attention weights, masks and the KV cache, in the browser.

``handformer explore --run DIR`` serves a local page (standard library only, no CDN). The
pieces are usable from Python too: ``capture_attention`` records every layer's weights for
one forward pass without leaving anything on the model.
"""

from handformer.explore.attention_capture import (
    AttentionRecord,
    AttentionRecorder,
    capture_attention,
    self_attention_names,
)

__all__ = ["AttentionRecord", "AttentionRecorder", "capture_attention", "self_attention_names"]
