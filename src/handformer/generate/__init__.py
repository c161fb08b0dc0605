"""Generation over a model's own forward with a KV cache.

* ``plain`` — ``generate``: one token per forward call, every sampling setting.
* ``speculative`` — ``speculative_generate``: a draft model proposes, the target verifies
  several tokens per forward call, with the plain greedy output or the target's sampling
  distribution exactly.
* ``text`` — ``generate_text``: prompts in, continuations out, streaming and stop strings,
  over either of the two.
"""

from handformer.generate.plain import (
    GREEDY_TEMPERATURE,
    NonFiniteLogitsError,
    apply_repetition_penalty,
    check_sampling,
    generate,
    sample_next,
    sampling_weights,
    slide_window,
)
from handformer.generate.speculative import (
    MAX_SPECULATE,
    SpeculationStats,
    check_draft,
    check_same_tokenizer,
    speculative_generate,
)
from handformer.generate.text import generate_text

__all__ = ["GREEDY_TEMPERATURE", "MAX_SPECULATE", "NonFiniteLogitsError", "SpeculationStats",
           "apply_repetition_penalty", "check_draft", "check_same_tokenizer", "check_sampling",
           "generate", "generate_text", "sample_next", "sampling_weights",
           "slide_window", "speculative_generate"]
