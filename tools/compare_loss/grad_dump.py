"""Dump every parameter's gradient at one training step, to find where two layouts diverge.

    torchrun --nproc_per_node=N -m tools.compare_loss.grad_dump --out grads.json [--grads grads.pt] \\
        [--step K] -- --config train_configs/llama3.toml --parallelism.tp 2 ...

Runs the real :class:`trainer.trainer.Trainer` from the same argv as ``train.py`` -- including its
``--training.steps N``, which shapes the LR schedule -- stops after step ``K <= N`` and, at step K,
records each parameter's full gradient norm
*after* gradient finalization and *before* clipping -- the gradient the layout's math produced,
not the clipped update. Rank 0 writes ``{"step", "loss", "grad_norm", "params": {name: norm}}``
to ``--out`` and, with ``--grads``, the full float32 gradients (``{name: tensor}``) for an exact
``||g_a - g_b||`` comparison. ``python -m tools.compare_loss --diagnose`` runs this for the
baseline and the diverging layout. Meant for debug-size models: every rank materializes each
full gradient.

It hooks in through ``Trainer.on_grads_ready``, which the trainer calls on every rank once a
step's gradients are final, and ends the run with ``Trainer.train(stop_after=K)``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import ClassVar

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

import trainer.trainer as train_module
from models.common.init import canonical_fqn
from trainer.config import load_config

PROG = "python -m tools.compare_loss.grad_dump"


class GradDumpTrainer(train_module.Trainer):
    """The real trainer; at step ``dump_step`` it records every parameter's gradient (reduced,
    before clipping) through the trainer's ``on_grads_ready`` extension point, and keeps the
    step's reduced loss and grad norm."""

    dump_step = 1
    keep_grads = False
    norms: dict[str, float] | None = None
    grads: ClassVar[dict[str, torch.Tensor]] = {}  # replaced (not mutated) per dump
    last_result = None

    def on_grads_ready(self, params) -> None:
        if self.step + 1 == self.dump_step:  # self.step counts completed steps
            self._record(params)

    def train_step(self, microbatches):
        self.last_result = super().train_step(microbatches)
        return self.last_result

    def _record(self, params) -> None:
        names = {id(p): canonical_fqn(n) for part in self.model_parts for n, p in part.named_parameters()}
        pp_enabled = self.pd.pp > 1
        # full_tensor() is a collective over the grad's mesh: every rank walks the same
        # parameters in the same order, and every rank takes part even though rank 0 writes.
        keep = self.keep_grads and (dist.get_rank() == 0 or pp_enabled)
        norms: dict[str, float] = {}
        grads: dict[str, torch.Tensor] = {}
        for p in params:
            if p.grad is None:
                continue
            full = p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad
            name = names[id(p)]
            # float64: torch's float32 CPU norm() of a 0.5M-element gradient is off by ~1e-4
            # relative (measured on output.weight), as large as the differences we look for
            norms[name] = full.double().norm().item()
            if keep:
                grads[name] = full.detach().float().cpu().clone()
        if pp_enabled:
            # each pipeline stage holds other parameters: merge every rank's view
            gathered: list = [None] * dist.get_world_size()
            dist.all_gather_object(gathered, (norms, grads))
            norms, grads = {}, {}
            for n, g in gathered:
                norms.update(n)
                grads.update(g)
            if dist.get_rank() != 0:
                grads = {}
        self.norms, self.grads = norms, grads


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" not in argv:
        raise SystemExit(f"usage: {PROG} --out FILE.json [--grads FILE.pt] [--step K] -- <train.py arguments>")
    cut = argv.index("--")
    return argv[:cut], argv[cut + 1 :]


def main(argv: list[str] | None = None) -> int:
    own, train_argv = split_argv(list(sys.argv[1:] if argv is None else argv))
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="JSON file for the per-parameter gradient norms")
    p.add_argument("--grads", help="also save the full float32 gradients here (torch.save)")
    p.add_argument("--step", type=int, default=1, help="step whose gradients are dumped (default 1)")
    args = p.parse_args(own)
    try:
        cfg = load_config(train_argv)
        if not 1 <= args.step <= cfg.training.steps:
            raise ValueError(f"--step {args.step} must be between 1 and training.steps ({cfg.training.steps})")
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    try:
        trainer = GradDumpTrainer(cfg)
        trainer.dump_step, trainer.keep_grads = args.step, args.grads is not None
        # The LR schedule keeps training.steps = N, as in the run being diagnosed, so steps
        # 1..K retrace that run exactly; stop_after ends the loop at K.
        trainer.train(stop_after=args.step)
        if trainer.norms is None:
            raise RuntimeError(f"no gradients recorded at step {args.step}")
        if trainer.rank == 0:
            result = trainer.last_result
            dump = {
                "step": args.step,
                "loss": result.loss,
                "grad_norm": result.grad_norm,
                "world_size": trainer.world_size,
                "degrees": trainer.pd.degrees.as_dict(),
                "params": trainer.norms,
            }
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(dump, f, indent=1)
            if args.grads:
                torch.save(trainer.grads, args.grads)
            print(f"wrote {len(trainer.norms)} gradient norms at step {args.step} to {args.out}", flush=True)
        return 0
    except ValueError as exc:
        if not dist.is_initialized() or dist.get_rank() == 0:
            print(f"error: {exc}", file=sys.stderr, flush=True)
        return 2
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    from trainer.lifecycle.shutdown import run_and_exit  # why not sys.exit: trainer/lifecycle/shutdown.py

    run_and_exit(main)
