"""handformer: a Transformer written by hand — readable, proved against references, fast."""

from handformer.config import ModelConfig, TrainConfig
from handformer.data import Batch
from handformer.generate import generate
from handformer.loss import IGNORE_INDEX, lm_loss
from handformer.models.decoder_lm import DecoderLM
from handformer.nn.attention import MultiHeadAttention, scaled_dot_product_attention
from handformer.nn.block import TransformerBlock
from handformer.tokenizers import CharTokenizer

__version__ = "0.1.0"

__all__ = [
    "IGNORE_INDEX",
    "Batch",
    "CharTokenizer",
    "DecoderLM",
    "ModelConfig",
    "MultiHeadAttention",
    "TrainConfig",
    "TransformerBlock",
    "__version__",
    "generate",
    "lm_loss",
    "scaled_dot_product_attention",
]
