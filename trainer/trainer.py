"""The training loop: config -> job plan -> parallelized model -> steps, metrics, checkpoints.

Launch through ``train.py`` at the repository root (``torchrun ... train.py --config X``). The
loop keeps the invariants that make loss curves comparable across layouts (docs/design.md section 5):
FQN-seeded initial weights (or a seed checkpoint), the same global batch every step whatever the
layout, and a loss equal to the sum of token losses divided by the global token count, with all
reductions summed over the ``loss`` mesh.

After ``plan_job`` the layout and the batch come from the :class:`~trainer.plan.JobPlan` only
(the stages, the schedule, the loader's batch, the parallelize options). The rooms around the
loop: trainer/runtime/distributed_init.py (joining the job, timeouts, the watchdog), trainer/build.py
(model parts and pipeline from the plan), trainer/forward.py (the forward + loss shared with
validation), trainer/step.py (the step's result and reductions), trainer/simulation/run_mode.py (real or
fake backend) and trainer/instruments/ (the step hooks).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time

import torch
import torch.distributed as dist

from models.kernels import kernels_line
from models.parallel.activation_offload import activation_offload_line
from models.parallel.float8 import float8_startup_line, precompute_float8_scales
from models.parallel.lora import lora_startup_line
from models.parallel.pipeline.tied import sync_tied_embedding_grads, tied_copies
from parallel_dims import default_device_type
from parallel_dims.torch_compat import host_side
from trainer.bad_steps import BadSteps
from trainer.build import build_model_parts, build_pipeline, trainable_params
from trainer.checkpoint.dcp import CheckpointFolder
from trainer.checkpoint.drill import hold_until_stopped, stop_gate
from trainer.checkpoint.local_tensor import LocalTensorFolder, load_local_initial_weights
from trainer.checkpoint.manager import CheckpointManager
from trainer.config import JobConfig
from trainer.data.doc_stats import document_stats_line
from trainer.data.loader import build_dataloader, wrap_loader
from trainer.faults import Faults
from trainer.forward import ModelForward, loss_functions, memory_lines
from trainer.instruments import Instruments, build_instruments
from trainer.optim.grad_clip import clip_grad_norm_, finalize_grads
from trainer.optim.optimizers import build_lr_scheduler, build_optimizer
from trainer.plan import model_overrides, parallel_dims_from_config, plan_job  # noqa: F401 - re-exported
from trainer.preference import PreferenceStep, build_objective
from trainer.reporting.data_progress import DataProgress
from trainer.reporting.metrics import MetricsLogger, training_flops_per_token
from trainer.reporting.restart_row import restart_row
from trainer.reporting.run_metrics import open_metrics
from trainer.reporting.run_summary import RunTotals, commit_run, end_lines
from trainer.reporting.stragglers import Stragglers
from trainer.runtime.console import configure_console
from trainer.runtime.distributed_init import (
    apply_train_timeout,
    init_distributed,
    require_writable_folder,
    start_watchdog,
    wait_until_every_rank_joined,
)
from trainer.runtime.distributed_init import log as _log
from trainer.runtime.precision import apply_precision_policy
from trainer.runtime.stop import StopSignals, stop_group
from trainer.simulation.local_tensor import rank0_view
from trainer.simulation.run_mode import RunMode
from trainer.startup import plan_startup
from trainer.step import (
    StepResult,
    TrainingDiverged,
    checked_step_values,
    global_target_count,
    moe_layers,
    read_step_scalars,
    reduce_loss,
    update_expert_bias,
)
from trainer.validation import Validator, validate_after_step

__all__ = ["StepResult", "Trainer", "TrainingDiverged"]

logger = logging.getLogger(__name__)


class Trainer:
    """Holds everything built from the config; ``train()`` runs the loop."""

    def __init__(self, cfg: JobConfig):
        self.cfg = cfg
        self.totals = RunTotals(time.perf_counter())  # the end-of-run summary's figures
        self.mode = RunMode.from_config(cfg)
        mode_notes = self.mode.prepare(cfg)
        # training.deterministic and training.enable_tf32 (trainer/runtime/precision.py), first: before
        # init_distributed's set_device and any CUDA work, so CUBLAS_WORKSPACE_CONFIG is in the
        # environment before the first cuBLAS handle
        precision_notes = apply_precision_policy(cfg, default_device_type())
        self.device = init_distributed(cfg)
        with host_side():  # local_tensor on torch 2.15 answers get_rank() per simulated rank: this process is 0
            self.rank = dist.get_rank()
            self.world_size = dist.get_world_size()
        configure_console(self.rank)  # warnings and log records: rank 0 says each once
        for note in mode_notes + precision_notes:
            _log(note)
        torch.manual_seed(cfg.training.seed)
        require_writable_folder(cfg.job.dump_folder, "job.dump_folder")

        # every check that needs no process group, the same as the launcher's pre-start check
        # (trainer/startup.py); from here on the layout and the batch come from the plan, never
        # from cfg.parallelism
        startup = plan_startup(cfg, self.world_size, self.device.type)
        self.tokenizer, self.doc_separator = startup.tokenizer, startup.doc_separator
        self.plan = plan = startup.plan
        self.pd = plan.parallel_dims
        initial_hf = startup.initial_hf
        with torch.device("meta"):
            model = plan.model.model_cls(plan.model.args)
        self.num_params = sum(p.numel() for p in model.parameters())
        self.flops_per_token = training_flops_per_token(model, plan.batch.seq_len)

        with host_side():  # the meshes are the same for every simulated rank (built as rank 0's)
            self.pd.build_mesh(self.device.type)
        if self.mode.has_peers(self.world_size):
            # every rank created every group before any may go on (and perhaps stop on bad
            # input) and close its sockets under a peer still connecting
            wait_until_every_rank_joined()
        _log(
            f"mesh: world={self.world_size} pp={self.pd.pp} dp_replicate={self.pd.dp_replicate} "
            f"dp_shard={self.pd.dp_shard} cp={self.pd.cp} tp={self.pd.tp} ep={self.pd.ep} "
            f"etp={self.pd.etp}; process groups per rank: {self.pd.process_group_count()}; "
            f"mesh builder: {self.pd.mesh_builder} (torch {torch.__version__})"
        )
        self.loss_parallel = self.pd.tp > 1 and plan.parallelize.loss_parallel
        # the training loss, MTP's (its depths added with training.mtp_loss_weight) and validation's
        # (the main next-token loss), chunked or compiled as configured (trainer/forward.py)
        self.loss_fn, val_loss_fn, self.mtp_loss = loss_functions(cfg, getattr(plan.model.args, "mtp_layers", 0))
        preference = build_objective(cfg, plan, self.device)  # training.objective = dpo (trainer/preference.py)
        self.loss_fn = preference or self.loss_fn
        chunk = cfg.training.loss_chunk_tokens
        # every parameter of the whole model (all stages) after the converters (LoRA trains its
        # adapters only): the optimizer's groups are checked and summarised against the trainable
        # ones (trainer/optim/groups.py)
        all_params, frozen_params = trainable_params(plan, model)
        self.model_parts = build_model_parts(plan, model, self.device, cfg.training.seed)
        for part in self.model_parts:
            part.loss_chunk_tokens = chunk
        self.float8_precompute = False
        self._float8_scales_due = False  # precomputed float8 scales are missing or stale
        if plan.parallelize.float8 is not None:
            _log(float8_startup_line(self.model_parts, plan.parallelize.float8, self.device))
            self.float8_precompute = plan.parallelize.float8.precompute_scale
            self._float8_scales_due = self.float8_precompute
        if plan.parallelize.lora is not None:
            _log(lora_startup_line(self.model_parts, plan.parallelize.lora))
        self.pipeline = build_pipeline(plan, self.model_parts, self.loss_fn, loss_parallel=self.loss_parallel)
        for line in memory_lines(plan, self.pd, self.model_parts, self.pipeline, cfg):  # what the memory options save
            _log(line)
        self.forward = ModelForward(
            self.pd,
            self.model_parts,
            self.loss_fn,
            self.device,
            loss_parallel=self.loss_parallel,
            pipeline=self.pipeline,
        )
        args = (cfg, plan, preference, self.model_parts, self.forward, self.device, _log, initial_hf)
        self.objective = PreferenceStep(*args) if preference is not None else None

        # the next step's micro-batches are prepared on a background thread (training.prefetch)
        # every simulated rank's slice under local_tensor (one LocalTensor per micro-batch); the
        # sources say nothing when they start over: the trainer's epoch line does
        # (trainer/reporting/data_progress.py)
        loader = self.mode.loader(
            lambda c: build_dataloader(cfg, self.tokenizer, batch_rank=c, batch=plan.batch, log_epochs=False),
            self.pd,
            self.world_size,
        )
        if self.mode.local:  # a seed checkpoint read on the host, cut per simulated rank
            load_local_initial_weights(cfg.checkpoint, self.model_parts, _log)
        self.data = wrap_loader(loader, cfg.training.prefetch, self.device)
        self.validator = None
        self.downstream = None  # [eval] between steps: trainer/inference/eval_during_training.py (set by rank.py)
        if cfg.validation.enable:
            self.validator = Validator(
                cfg, self.tokenizer, plan, self.model_parts, val_loss_fn, self.device, loss_parallel=self.loss_parallel
            )
        self.optimizer = build_optimizer(self.model_parts, cfg, all_params=all_params, frozen_params=frozen_params)
        for line in self.optimizer.summary:
            _log(line)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg)
        self.ckpt = CheckpointManager(
            cfg,
            model_parts=self.model_parts,
            optimizer=self.optimizer,
            lr_scheduler=self.lr_scheduler,
            dataloader=self.data,
            model_args=self.plan.model.args,
            initial_hf=initial_hf,
            log=_log,
            folder_cls=LocalTensorFolder if self.mode.local else CheckpointFolder,
            lora=plan.parallelize.lora,
        )
        self.step = 0
        self.stopped_by: int | None = None  # the signal that stopped train() early (trainer/runtime/stop.py)
        self.stop_signals: StopSignals | None = None  # while and after train() runs
        self.instruments = Instruments()  # the step hooks; train() builds the config's
        # training.on_nonfinite and debug.fault (docs/long_runs.md)
        self.bad_steps, self.faults = BadSteps(cfg, _log), Faults(cfg.debug.fault, self.rank, self.world_size)

    # ---------------------------------------------------------------- one step
    def train_step(self, microbatches: list[tuple[torch.Tensor, torch.Tensor]]) -> StepResult:
        model = self.model_parts[0]
        if self._float8_scales_due:
            # the first step of this run (fresh or resumed weights): its forward needs the
            # scales a previous step's precompute would have left
            precompute_float8_scales(self.model_parts)
            self._float8_scales_due = False
        global_tokens = self.data.tokens_per_step  # every label a target: a constant
        targets = None  # chat data: the global count of target tokens, one reduction, read with the loss
        if self.data.masked:  # a mixture's: one count per source (each sample's source rides with the step)
            names, labels = self.data.source_names, [y for _x, y in microbatches]
            sources = {"sources": self.data.step_sources, "n_sources": len(names)} if names else {}
            targets = global_target_count(labels, self.pd, self.device, at_least_one=False, **sources)
            global_tokens = (targets.sum() if names else targets).clamp_min(1)
        if self.objective is not None:  # DPO: the reference pass; the loss is the mean over the global batch's pairs
            global_tokens = self.objective.before_step(microbatches)
        global_sequences = self.data.global_batch_size
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        moes = moe_layers(self.model_parts)
        n = len(microbatches)
        for i, (inputs, labels) in enumerate(microbatches):
            if self.pipeline is None and hasattr(model, "set_requires_gradient_sync"):
                # reduce-scatter gradients once per step, not once per micro-batch (the
                # pipeline's schedule syncs on its last backward itself)
                model.set_requires_gradient_sync(i == n - 1)
            part = self.forward(
                inputs, labels, global_tokens, backward=True, aux_loss_sequences=global_sequences, moes=moes
            )
            if part is not None:
                loss_sum += part
        params = [p for part in self.model_parts for p in part.parameters()]
        # copies of the embedding (a tied head on the last pipeline stage, the MTP depths'
        # copies) sum their gradients with it, so they stay one parameter
        sync_tied_embedding_grads(self.model_parts, self.pd)
        finalize_grads(params)
        loss_sum = self.faults.poison(self.step + 1, loss_sum, params)  # debug.fault nan_loss
        self.on_grads_ready(params)
        pp_mesh = self.pd.get_optional_mesh("pp")
        grad_norm = clip_grad_norm_(params, self.cfg.training.max_norm, pp_mesh, tied_copies(self.model_parts))
        if self.mtp_loss is not None:  # the MTP depths' loss rides along with the loss
            loss_sum = torch.stack([loss_sum, self.mtp_loss.take(self.device) / (global_tokens * self.mtp_loss.depth)])
        if self.objective is not None:  # the preference metrics ride along with the loss
            loss_sum = torch.cat([loss_sum.reshape(1), self.objective.take_metrics()])
        if self.pipeline is not None:
            from models.parallel.pipeline import sum_loss_over_pp

            loss_sum = sum_loss_over_pp(loss_sum, pp_mesh, self.device)  # only last stage has it
        loss_total = reduce_loss(loss_sum, self.pd).reshape(-1)  # the loss, then the MTP loss or DPO's metrics
        scalars = torch.cat([loss_total[:1], grad_norm.to(loss_total).reshape(1), loss_total[1:]])
        if targets is not None:  # last: a step without any target is stopped too (and skipped on the device)
            scalars = torch.cat([scalars, targets.to(scalars).reshape(-1)])
        n_targets = 0 if targets is None else targets.numel()
        # The step's one host sync reads the loss and the norm (to log them and to stop a
        # diverged run). Where the optimizer can skip a non-finite step on the device (fused
        # AdamW's found_inf), it comes after the optimizer and the rest of the step are queued,
        # so the device never waits for the host; otherwise before the optimizer step, which
        # must not apply a non-finite update.
        ok = self.mode.skips_on_device and self.bad_steps.device_skip_ok(moes)
        skip_on_device, bad = ok and self.optimizer.skips_on_device, False
        if not skip_on_device:
            (loss_value, norm_value, *rides), counts, bad = self._read_scalars(scalars, n_targets)
        self.ckpt.wait_for_staging()  # a background copy of the weights (pinned mode) is complete
        # skipped on the device: a non-finite step, one without any target, a loss spike (trainer/bad_steps.py)
        no_step = self.bad_steps.no_step(scalars, targets) if skip_on_device else None
        if not bad:  # a bad step read on the host (training.on_nonfinite = skip / rollback) is not applied
            self.optimizer.step(found_inf=no_step)
        self.mode.check_step(self.model_parts, self.optimizer)  # local_tensor: every state holds every rank's value
        if self.float8_precompute:  # the next forward's float8 all-gathers need their weights' scales
            precompute_float8_scales(self.model_parts)
        lr_used = self.lr_scheduler.get_last_lr()  # the rate this step's update ran at, before the schedule moves on
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if moes:  # a skipped step's routing counts are dropped with it
            update_expert_bias(moes, self.pd) if not bad else [m.tokens_per_expert.zero_() for m in moes]
        if skip_on_device:
            # a non-finite step left the weights and the optimizer state as they were (the
            # schedule and, where on_nonfinite = stop, the experts' bias moved on)
            (loss_value, norm_value, *rides), counts, bad = self._read_scalars(scalars, n_targets)
        mtp = rides[0] if self.mtp_loss is not None else None
        dpo = self.objective.metrics(rides) if self.objective is not None else None
        return StepResult(loss_value, norm_value, lr_used, mtp, counts or None, bad=bad, dpo=dpo)

    def _read_scalars(self, scalars: torch.Tensor, n_targets: int) -> tuple[list[float], list[int], bool]:
        """The step's one host read, checked (trainer/step.py ``checked_step_values``): its values,
        its ``n_targets`` last ones (the global target counts) and whether it is a bad step to
        skip or roll back (trainer/bad_steps.py; on_nonfinite = stop raises instead)."""
        check, step = self.mode.checks_divergence, self.step + 1
        values, counts = checked_step_values(
            read_step_scalars(scalars), step, check, n_targets, self.data.description, finite=self.bad_steps.stops
        )
        return values, counts, check and self.bad_steps.judge(values[0], values[1], step)

    def on_grads_ready(self, params: list[torch.Tensor]) -> None:
        """Extension point, called on every rank once the step's gradients are final (reduced,
        not yet clipped); tools such as tools/compare_loss/grad_dump.py override it. By
        default it hands them to the step hooks (the fake meter counts their bytes)."""
        self.instruments.grads_ready(params)

    # ---------------------------------------------------------------- the loop
    def train(self, stop_after: int | None = None) -> None:
        """Run to ``training.steps`` (the LR schedule's length), or stop early after step
        ``stop_after`` without changing the schedule (to retrace a run up to one step)."""
        cfg = self.cfg
        last_step = cfg.training.steps if stop_after is None else min(stop_after, cfg.training.steps)
        # tests only: hold before the last step until a stop is requested (trainer/checkpoint/drill.py)
        gate = stop_gate()
        resumed = self.ckpt.resume()
        if resumed is not None:
            self.step = resumed
        run_folder = cfg.job.dump_folder
        if self.step >= cfg.training.steps:
            # checkpoint.last_save_in_hf asked for after the run ended: the export of the final weights
            self.ckpt.export_missing(self.step)
            _log(
                f"nothing to train: the run in {run_folder} is already complete (step {self.step} "
                f"of training.steps = {cfg.training.steps}, resumed from {self.ckpt.folder}). To train on, "
                f"pass a larger --training.steps (the learning-rate schedule is recomputed for the "
                f"new length); to start over, delete {run_folder} or choose another --job.dump_folder"
            )
            return
        _log(
            f"config: {os.path.join(run_folder, 'config.toml')} (the resolved config, written once the first step "
            "is done; --job.print_config prints it)"
        )
        restart = restart_row(cfg, resumed)  # a worker restarted by the elastic agent (before any row of its own)
        metrics = open_metrics(self, resumed is not None, _log)  # trainer/reporting/run_metrics.py
        if restart is not None:
            metrics.log_event(self.step, restart)
        batch = self.plan.batch
        _log(
            f"training {cfg.model.name}/{cfg.model.flavor} ({self.num_params / 1e6:.1f}M params) for "
            f"{cfg.training.steps} steps; global batch {self.data.global_batch_size} x "
            f"{batch.seq_len} tokens, {self.data.grad_accum_steps} micro-batch(es) of "
            f"{batch.local_batch_size} per rank"
        )
        _log(f"dataset: {self.data.description}")  # (the first step's "data:" line describes its batch)
        _log(kernels_line(self.model_parts, self.device, getattr(torch, self.plan.parallelize.param_dtype)))
        self.totals.begin(self.step, self.data.tokens_per_step, self.data.targets)
        steps_since_log = 0
        data_wait = 0.0  # seconds the loop waited for data since the last log
        timeout_applied = False
        # every step (and save, validation) under a deadline: trainer/runtime/comm_watchdog.py
        self.watchdog = start_watchdog(cfg.comm, cfg.job.dump_folder, self.mode, self.rank, self.world_size)
        peers = self.mode.has_peers(self.world_size)
        self.progress = progress = DataProgress(self.data, epochs=cfg.training.epochs, peers=peers)
        values = progress.local_values if progress.agree else None  # striped passes ride on the stop agreement
        self.stop_signals = stop = StopSignals(stop_group(cfg.comm, peers), newest=self.ckpt.newest, values=values)
        timing = Stragglers(cfg.metrics, stop.group, self.world_size, self.step, _log)  # reporting/stragglers.py
        with metrics, self._build_instruments() as instruments, self.data, self.watchdog, stop:
            for message in instruments.messages:
                _log(message)
            if progress.agree:  # the passes of the position resumed from (a signal noted now stops step 1)
                stop.agreed()
            progress.update(stop.agreed_values)
            if progress.reached:  # a resumed run that already made training.epochs passes
                _log(f"nothing to train: the data has been read training.epochs = {cfg.training.epochs} times")
                last_step = self.step
            while self.step < last_step:
                self.watchdog.step(self.step + 1, first=not timeout_applied)
                self.faults.step_start(self.step + 1)  # debug.fault kill / hang
                timing.step_start()
                microbatches = self.data.next_step()
                data_wait += self.data.wait_s
                if not timeout_applied:  # the first step of this run (also after a resume)
                    first = [(rank0_view(x), rank0_view(y)) for x, y in microbatches]  # rank 0's, as printed
                    _log(
                        document_stats_line(first, self.doc_separator, self.plan.model.args.attn_mask_type)
                        + self.data.notes()
                    )
                result, step_extra = instruments.run_step(self.step + 1, self.train_step, microbatches)
                timing.add_compute(self.faults.slow(self.step + 1, timing.step_done(self.step + 1, self.data.wait_s)))
                self.step += 1
                phase = lambda what: self._long_phase(what, metrics)  # noqa: E731
                back = self.bad_steps.after_step(self.step, result, self.data, self.ckpt, metrics, phase)
                if back is not None:  # rolled back to a checkpoint (trainer/bad_steps.py)
                    self.step = back
                    self.watchdog.disarm()
                    continue
                self.totals.step(self.step, result.loss)
                if result.targets:
                    progress.add_targets(result.targets)
                if not timeout_applied:
                    apply_train_timeout(cfg.comm.train_timeout_seconds)
                    timeout_applied = True
                    commit_run(cfg, self.rank, metrics)  # config.toml, metrics files, W&B id
                    if line := activation_offload_line(self.model_parts, self.step):  # what step 1 moved
                        _log(line)
                steps_since_log += 1
                # a SIGINT or SIGTERM on any rank: every rank stops after this step, with a save; the
                # agreement also carries striped data's passes (at the last step too, for its epoch)
                end = self.step == cfg.training.steps
                agreed = stop.agreed() if not end or progress.agree else None
                stopping = None if end else agreed
                strag = timing.after_step(self.step)  # every metrics.straggler_interval steps (collective)
                for line in progress.update(stop.agreed_values, self.step):
                    _log(line)
                end = end or progress.reached  # training.epochs complete passes: the run's end too
                if gate and stopping is None and not end and self.step == cfg.training.steps - 1:
                    stopping = hold_until_stopped(stop.agreed, self.step, self.rank)
                # checkpointing first (a finished background save published, the save or export
                # due now), so its numbers are in this step's line; its time is not step time
                ckpt = self.ckpt.after_step(
                    self.step,
                    last=end,
                    phase=lambda what: self._long_phase(what, metrics),
                    stopping=stopping is not None,
                )
                if metrics.should_log(self.step) or end or ckpt or stopping or strag or result.bad:
                    position = self.data.state_dict()
                    tokens = self.data.source_metrics(position)
                    # the global samples this step trained, [end - G, end) (skipped ranges are
                    # passed before a step reads): what a restart or a lost node must not repeat
                    # or lose among the steps that count (docs/long_runs.md)
                    end_sample = int(position["sample_index"])
                    samples = {"samples": f"{end_sample - self.data.global_batch_size}:{end_sample}"}
                    metrics.log(
                        self.step,
                        loss=result.loss,
                        grad_norm=result.grad_norm,
                        lr=result.lr,
                        num_tokens=steps_since_log * self.data.tokens_per_step,
                        data_wait_s=data_wait / steps_since_log,
                        # result.extra(): the MTP loss; then a mixture's tokens per source so far (the
                        # position after this step), the epoch and the target tokens (trainer/reporting/data_progress.py)
                        extra={**(step_extra or {}), **ckpt, **result.extra(), **tokens, **progress.metrics(tokens)}
                        | self.bad_steps.metrics()
                        | samples
                        | strag
                        or None,
                    )
                    steps_since_log, data_wait = 0, 0.0
                if stopping is not None:
                    self.stopped_by = stopping
                    self.watchdog.disarm()
                    break
                validate_after_step(self.validator, self.step, end, self.watchdog, metrics, self.totals)
                if self.downstream is not None and self.downstream.due(self.step, end):  # [eval]
                    self.watchdog.long_phase(f"evaluation after step {self.step}")
                    self.downstream.run(self.step, metrics)
                self.watchdog.disarm()
                if end:  # training.steps, or training.epochs passes before it
                    break
            # the end of training (also of a run stopped early): the save in flight is finished
            # and published before the process may exit
            done = self.ckpt.close(phase=lambda what: self._long_phase(what, metrics))
            if done:
                metrics.log_checkpoint(self.step, done)
        self.totals.data_read(progress, cfg.training.epochs)
        for line in end_lines(
            self.totals,
            cfg,
            self.ckpt.folder,
            metrics.jsonl_path if cfg.metrics.enable_jsonl else None,
            self.stopped_by,
        ):
            _log(line)

    @contextlib.contextmanager
    def _long_phase(self, what: str, metrics: MetricsLogger):
        """A checkpoint save or export after a step: under the watchdog's long-phase deadline,
        and not counted in the step's time."""
        self.watchdog.long_phase(what)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            metrics.exclude(time.perf_counter() - t0)

    def _build_instruments(self) -> Instruments:
        """The config's step hooks (trainer/instruments/), built as the loop starts."""
        self.instruments = build_instruments(
            self.cfg,
            self.mode,
            parallel_dims=self.pd,
            rank=self.rank,
            world_size=self.world_size,
            device=self.device,
            model_parts=self.model_parts,
            optimizer=self.optimizer,
            first_step=self.step,
            log=_log,
        )
        return self.instruments
