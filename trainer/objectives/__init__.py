"""Training objectives beside the next-token loss: preference tuning (DPO, IPO, SimPO) on
(chosen, rejected) pairs. dpo.py: the per-row log-probabilities and the pair losses (the
trainer's loss function); reference.py: the reference model (LoRA adapters off, or the frozen
copy's initial weights). trainer/preference.py runs them in the step.

It may import ``trainer.config`` and ``trainer.checkpoint`` (the copy's initial weights),
``models`` and ``parallel_dims``; the loop (trainer/preference.py) builds and calls it.
"""
