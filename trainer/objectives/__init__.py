"""Training objectives beside the next-token loss: preference tuning (DPO, IPO, SimPO) on
(chosen, rejected) pairs (trainer/objectives/dpo.py: the loss; reference.py: the reference
model; step.py: how the trainer's step runs them)."""
