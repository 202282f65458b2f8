"""Scoring and generation with a trained model on the training mesh (issue 54).

session.py   ``InferenceSession``: the model on the config's layout (from a checkpoint, or
             over a live training run's model parts), ``logits`` and ``generate``, the chat
             template's prompts
loading.py   a checkpoint (DCP step folder, LoRA base + adapters, Hugging Face folder) into
             the model the trainer builds for the config's layout
kv_cache.py  the per-layer KV cache (this rank's attention heads) the model's forward takes
decoding.py  greedy and sampled next tokens (seeded generators, the same on every rank), stop
             rules (end-of-sequence ids, stop strings)
lm_eval_model.py  ``MeshLM``: lm-eval's ``LM`` (loglikelihood, rolling, generate_until) over a
             session
lm_eval_run.py    lm-eval's tasks on it: the task index, its checks, ``simple_evaluate``, the
             flat scores (scripts/eval.py and [eval] share it)
eval_during_training.py  ``[eval]``: the tasks scored on the live model between steps (attached
             by trainer/lifecycle/rank.py), the training's RNG put back

It builds the model the trainer's way (trainer/startup.py, trainer/plan.py, trainer/build.py)
and loads it with trainer/checkpoint/; it may import config/, data/, runtime/, checkpoint/ and
the loop's modules at trainer/'s top that build a model, but nothing of lifecycle/. Because it
imports trainer/'s top, the loop (trainer/trainer.py) must not import it: code that runs it
during training is wired in from trainer/lifecycle/, the way in, which may import everything.
"""
