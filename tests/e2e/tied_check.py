"""``train.py`` that also checks, after every optimizer step, that every copy of a tied
embedding/head weight on every rank is bitwise the same (tests/e2e/test_tied_train.py runs it on
forked ranks: ``tools.forkserver.run_train(..., script=this file)``).

A pipeline keeps the tied weight twice, the embedding on the first stage and a copy as the head
on the last (models/parallel/pipeline/tied.py); after each step every rank hashes the full value
of each copy it holds (a collective over its stage's FSDP/TP meshes), the hashes are gathered on
rank 0, which appends ``{"step", "copies", "distinct"}`` to the JSON-lines file
``$TIED_CHECK_OUT``. The training itself is train.py's, unchanged.
"""

from __future__ import annotations

import hashlib
import json
import os

import torch.distributed as dist

from trainer import trainer as train_module
from trainer.forward import full_tensor

_train_step = train_module.Trainer.train_step


def _copies(model_parts) -> list:
    out = []
    for part in model_parts:
        if part.tok_embeddings is not None:
            out.append(part.tok_embeddings.weight)
        if part.output is not None and part.output.weight is not getattr(part.tok_embeddings, "weight", None):
            out.append(part.output.weight)
    return out


def _checked_train_step(self, microbatches):
    result = _train_step(self, microbatches)
    digests = [
        hashlib.sha256(full_tensor(p.detach()).cpu().numpy().tobytes()).hexdigest() for p in _copies(self.model_parts)
    ]
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, digests)
    if dist.get_rank() == 0:
        flat = [d for ds in everyone for d in ds]
        self._tied_checks = getattr(self, "_tied_checks", self.step) + 1
        with open(os.environ["TIED_CHECK_OUT"], "a") as f:
            f.write(json.dumps({"step": self._tied_checks, "copies": len(flat), "distinct": len(set(flat))}) + "\n")
    return result


if __name__ == "__main__":
    train_module.Trainer.train_step = _checked_train_step
    from trainer.lifecycle.rank import run_rank as main
    from trainer.lifecycle.shutdown import run_and_exit

    run_and_exit(main)
