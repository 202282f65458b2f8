"""Checkpoints: the run's own (DCP) and Hugging Face folders, one concern per module.

==============  ==============================================================================
manager.py      :class:`CheckpointManager`, the trainer's checkpoint policy: resume, initial
                load (DCP or Hugging Face), periodic saves, Hugging Face exports, the end
dcp.py          DCP step folders ``<folder>/step-N``: save, load, retention, seed checkpoint
async_save.py   ``checkpoint.async_mode``: background saves, their completion and failure
drill.py        test-only hold points of the kill drills and stop tests (``MESHTRAIN_CHECKPOINT_DRILL``)
state.py        what a DCP checkpoint holds (model parts, RNG, train-state blob), process helpers
folders.py      publishing a folder written under ``<final>.tmp`` (keeps ``<final>.old`` until done)
export.py       consolidated ``.pt`` / ``.safetensors`` weights (from the live model or a DCP
                folder: ``python -m trainer.checkpoint``)
errors.py       :class:`CheckpointError` (bad input: one line, exit code 2), read failures
hf_format.py    Hugging Face folder format: file names, dtypes, the safetensors header parser
hf_reader.py    a checked Hugging Face folder and its memory-mapped, slice-reading reader
hf_load.py      Hugging Face weights into this rank's (sharded) model parts
hf_write.py     DCP checkpoint -> Hugging Face folder (``convert_hf.py to-hf``); the folder plan
                and writer frame shared with hf_live.py
hf_live.py      live sharded model -> Hugging Face folder, no temporary DCP (the run's exports)
live.py         full tensors of the live sharded model gathered to one rank (hf_live, export)
convert.py      Hugging Face folder -> DCP folder (``convert_hf.py to-dcp``)
==============  ==============================================================================

Import from the module that holds a name (``from trainer.checkpoint.errors import
CheckpointError``); this package file exports nothing, so a command that needs one module does
not import the others.

It may import ``trainer.config``, ``trainer.data`` (the loader's state, the tokenizer an export
carries), ``trainer.optim`` (optimizer state and groups) and ``trainer.runtime`` (files,
errors, the process group), ``models`` and ``parallel_dims``; not the loop, the run mode or
the way in.
"""
