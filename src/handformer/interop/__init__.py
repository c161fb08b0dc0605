"""Bridges to other people's implementations: Hugging Face GPT-2 and BERT weights and model
folders, and torch's own ``nn.MultiheadAttention`` / ``nn.TransformerEncoderLayer`` /
``nn.Transformer`` (``handformer.interop.torch_nn``, weights copied both ways)."""
