"""The optimizer: what updates the weights after the backward pass.

optimizers.py   ``build_optimizer`` / ``build_lr_scheduler``: one optimizer per model part
                behind one ``Optimizers``, and the checkpoint's view of them
groups.py       parameter groups (weight decay, per-group learning rates, Muon's matrices)
muon.py         the Muon optimizer; muon_dist.py its distributed update (gather / round_robin)
lr_schedule.py  warmup, stable and decay phases of the learning rate
grad_clip.py    the gradient norm over every sharding group, and clipping to it
low_precision.py  bf16 optimizer state (``optimizer.state_dtype``): stochastic rounding, AdamW
                with bf16 moments, the state's bytes per parameter

It may import ``trainer.config`` (its ``[optimizer]``, ``[lr_scheduler]`` sections) and
``trainer.simulation`` (the run mode: a local_tensor run distributes Muon by gather), ``models``
and ``parallel_dims``; nothing else in the trainer. The checkpoint reads it (optimizer state,
parameter groups); the training loop builds it.
"""
