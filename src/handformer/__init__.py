"""handformer: a Transformer written by hand — readable, proved against references, fast.

The package's face: every model and its config, both tokenizers, the data batch, the
attention pieces, the loss, the ``Trainer`` and ``generate``. Each name lives in one module
(``handformer.models.decoder_lm``, ``handformer.train.trainer``, …); this file only
gathers them.
"""

from handformer.config import ClassifierConfig, ModelConfig, Seq2SeqConfig, TrainConfig
from handformer.data import Batch
from handformer.generate import generate
from handformer.loss import IGNORE_INDEX, lm_loss
from handformer.models.decoder_lm import DecoderLM
from handformer.models.encoder import Encoder, EncoderClassifier
from handformer.models.seq2seq import EncoderDecoder
from handformer.nn.attention import MultiHeadAttention, scaled_dot_product_attention
from handformer.nn.block import TransformerBlock
from handformer.tokenizers import BPETokenizer, CharTokenizer, HFTokenizer
from handformer.train.trainer import Trainer, TrainResult

__version__ = "0.1.0"

__all__ = [
    "IGNORE_INDEX",
    "BPETokenizer",
    "Batch",
    "CharTokenizer",
    "ClassifierConfig",
    "DecoderLM",
    "Encoder",
    "EncoderClassifier",
    "EncoderDecoder",
    "HFTokenizer",
    "ModelConfig",
    "MultiHeadAttention",
    "Seq2SeqConfig",
    "TrainConfig",
    "TrainResult",
    "Trainer",
    "TransformerBlock",
    "__version__",
    "generate",
    "lm_loss",
    "scaled_dot_product_attention",
]
