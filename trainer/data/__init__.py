"""Training data: packed token streams with layout-invariant global batches and exact resumption.

Documents are tokenized, each followed by eos, concatenated, and cut into consecutive windows of
``seq_len + 1`` tokens (inputs = window[:-1], labels = window[1:]). Window k is "global sample
k". Optimizer step s consumes global samples ``[s*G, (s+1)*G)``; the rank with batch coordinate
b of batch degree D owns the contiguous slice ``[s*G + b*G/D, s*G + (b+1)*G/D)`` and yields it
as micro-batches of local_batch_size.

Consequently every parallel layout (any D, any local batch size) trains on exactly the same
global batch at every step, which is what makes loss curves comparable across layouts and lets
a run resume on a different number of GPUs. The price is that every rank tokenizes the whole
stream (and discards other ranks' samples); tokenization is cheap next to a training step, and
the alternative (sharding documents per rank) makes the data order depend on the layout.

The resume state is the position of the next unconsumed step in the stream (sample index plus
a document cursor and token offset), identical on all ranks and independent of D.

``training.dataset = "tokens"`` reads the same stream from token shards written once by
``scripts/tokenize_dataset.py`` (:mod:`tools.tokenize`): window k is addressed directly, so a
rank reads only its own samples (O(its tokens), independent of D); the step -> samples
arithmetic and the resume state (a sample index and token position) are the same.

Modules (one concern each):

- :mod:`~trainer.data.synthetic`: the built-in synthetic corpus and its entropy bars;
- :mod:`~trainer.data.sources`: document sources (synthetic, ``.txt`` / ``.jsonl`` files);
- :mod:`~trainer.data.tokenizer`: the tokenizers (shipped BPE, ``tokenizer.json``, Llama 3
  ``tokenizer.model``, bytes);
- :mod:`~trainer.data.packing`: documents -> windows of ``seq_len + 1`` tokens;
- :mod:`~trainer.data.shard_format`: the token-shard folder format (names, dtypes, the
  tokenizer fingerprint), shared with the offline writer;
- :mod:`~trainer.data.token_shards`: reading token shards by address;
- :mod:`~trainer.data.batching`: a step's global batch -> this rank's micro-batches, resume state;
- :mod:`~trainer.data.rows`: row datasets (``.jsonl``, ``.parquet``, ``save_to_disk`` folders);
- :mod:`~trainer.data.chat_template`, :mod:`~trainer.data.chat`: chat conversations -> windows with
  assistant-only targets (``training.dataset = "chat"``);
- :mod:`~trainer.data.preference`: (prompt, chosen, rejected) rows -> pairs of windows with
  completion-only targets (``training.dataset = "preference"``);
- :mod:`~trainer.data.mixture`: weighted mixtures of sources (``[[training.sources]]``);
- :mod:`~trainer.data.striped`: parquet / save_to_disk rows read in stripes, one per sample of
  the global batch (``training.row_reading``), so each rank reads only its own rows;
- :mod:`~trainer.data.prefetch`: the background prefetch thread;
- :mod:`~trainer.data.loader`: building the loaders the trainer uses from the config.

The offline side (writing token shards, retraining the shipped tokenizer) is :mod:`tools.tokenize`;
nothing here imports it.

It may import ``trainer.config`` (the ``[training]`` data keys, ``[validation]``), ``models``
and ``parallel_dims``; nothing else in the trainer.
"""
