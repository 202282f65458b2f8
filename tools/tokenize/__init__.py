"""Offline tokenization: writing token shards (``scripts/tokenize_dataset.py``) and retraining
the shipped tokenizer (``scripts/train_tokenizer.py``). The runtime (``trainer/``) reads what
these write and never imports this package.

Inputs, each turned into a sequence of *units* (a piece of text, whether it ends a document,
and a cursor from which the enumeration can restart), :mod:`tools.tokenize.inputs`:

- ``.txt`` / ``.jsonl`` files or folders: read by :class:`trainer.data.sources.FileSource`
  itself, so the documents, their order and the ~1 MiB pieces of long text files (each
  tokenized on its own) are exactly the streaming path's, and the tokens equal its first epoch;
- local Hugging Face ``datasets`` (a ``save_to_disk`` folder, or ``.parquet`` / ``.arrow`` /
  ``.json`` files or folders of them), one document per row (``--text-field``), no network;
- ``synthetic:SEED:DOCS``: the first DOCS documents of the built-in synthetic corpus, the
  stream ``training.dataset = "synthetic"`` with ``training.seed = SEED`` trains on.

Units are grouped into chunks, tokenized by a pool of worker processes
(:mod:`tools.tokenize.encode`), and written in order (:mod:`tools.tokenize.writer`). Shard i
holds stream tokens ``[i*S, (i+1)*S)``; each is written atomically (``trainer/runtime/files.py``), and
then recorded (with the unit and token offset where it ended) in ``progress.jsonl``
(:mod:`tools.tokenize.resume_log`). A rerun checks the recorded shards (size and sha256), keeps
the good prefix, and goes on from the recorded position; the index is written last, atomically.
The folder format is :mod:`trainer.data.shard_format` / :mod:`trainer.data.token_shards`.
"""
