"""Bridges to other people's implementations: Hugging Face GPT-2 and BERT weights and model
folders. (The helpers that copy weights into torch's own ``nn.*`` modules for parity tests
live with the tests, in ``tests/reference/torch_nn.py``.)"""
