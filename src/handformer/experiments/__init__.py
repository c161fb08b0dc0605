"""Experiments that answer a question with a measurement (``handformer experiment …``)."""
