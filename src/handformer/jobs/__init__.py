"""Jobs wired end to end: data + model + ``Trainer`` + run folder.

* ``lm`` — the language model (``handformer train``): ``train_lm`` / ``resume_lm``.
* ``classify`` — the encoder classifier (``handformer classify``).
* ``seq2seq`` — the encoder-decoder (``handformer seq2seq``).
"""
