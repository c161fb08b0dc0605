"""Data: text in, batches out.

* ``corpora`` — the built-in text and user text files, read with clear errors.
* ``lm`` — ``Batch`` and the language-model windows over one token stream.
* ``classification`` — labelled CSV/TSV/JSONL files, label vocabularies, padded batches.
* ``seq2seq`` — (source, target) pairs into encoder-decoder batches.
* ``tasks`` — built-in synthetic tasks (balanced brackets, copy/reverse/sort/add).
"""

from handformer.data.lm import Batch, LMWindows, collate_sequences, train_val_split

__all__ = ["Batch", "LMWindows", "collate_sequences", "train_val_split"]
