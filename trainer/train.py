"""The training loop: config -> ParallelDims -> parallelized model -> steps, metrics, checkpoints.

Launch through ``train.py`` at the repository root (``torchrun ... train.py --config X``). The
loop keeps the invariants that make loss curves comparable across layouts (docs/design.md section 5):
FQN-seeded initial weights (or a seed checkpoint), the same global batch every step whatever the
layout, and a loss equal to the sum of token losses divided by the global token count, with all
reductions summed over the ``loss`` mesh.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import math
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from models.common.sequence import load_balanced_shard
from models.parallel.pipeline import split_model  # the runtime (schedule) is imported where pp > 1 uses it
from models.parallel.tensor_parallel import loss_parallel_context
from models.registry import build_model
from parallel_dims import default_backend, default_device_type
from parallel_dims.comm_record import record_comms, write_records
from trainer.checkpoint.dcp import save_seed_checkpoint
from trainer.checkpoint.manager import CheckpointManager, check_initial_load
from trainer.cli_errors import EXIT_BAD_INPUT, report_user_error, user_error
from trainer.comm_watchdog import (
    EXIT_COMM_TIMEOUT,
    JobWatchdog,
    NullWatchdog,
    apply_flight_recorder_env,
    dump_prefix,
    pg_timeout_seconds,
    write_flight_recorder_dump,
)
from trainer.config import ConfigError, JobConfig, load_config
from trainer.data.loader import build_dataloader, wrap_loader
from trainer.data.tokenizer import load_tokenizer
from trainer.fake_backend import FakeStepMeter, init_fake_process_group, is_fake_backend, prepare_fake_config
from trainer.grad_clip import clip_grad_norm_, finalize_grads
from trainer.metrics import MetricsLogger, training_flops_per_token
from trainer.optim import build_lr_scheduler, build_optimizer
from trainer.plan import model_overrides, parallel_dims_from_config, plan_job  # noqa: F401 - re-exported
from trainer.precision import apply_precision_policy
from trainer.profiling import MatmulCensus, StepProfiler
from trainer.validation import Validator

__all__ = ["Trainer", "TrainingDiverged", "main"]

logger = logging.getLogger(__name__)


class TrainingDiverged(RuntimeError):
    """A non-finite loss or gradient norm: stopping beats silently training on garbage."""


def _log(msg: str) -> None:
    # a fake-backend run is one process playing any rank: it prints
    if not dist.is_initialized() or dist.get_rank() == 0 or is_fake_backend():
        print(msg, flush=True)


def init_distributed(cfg: JobConfig) -> torch.device:
    """Join the torchrun job (or make a 1-process group for ``python train.py``)."""
    device_type = default_device_type()
    if device_type == "cuda":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if not dist.is_initialized() and cfg.comm.mode == "fake_backend":
        # one rank of a comm.fake_world_size job in this process (trainer/fake_backend.py)
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ConfigError(
                f"comm.mode = 'fake_backend' runs one process that plays rank comm.fake_rank of "
                f"comm.fake_world_size ranks, but this launch started {os.environ['WORLD_SIZE']} "
                f"processes: use python train.py (or torchrun --nproc_per_node=1)"
            )
        init_fake_process_group(cfg.comm.fake_world_size, cfg.comm.fake_rank)
    if not dist.is_initialized():
        backend = default_backend(device_type)
        # NCCL's flight recorder reads its environment when the first group is created
        apply_flight_recorder_env(backend, cfg.job.dump_folder, cfg.comm.trace_buf_size)
        # every group gets it: ParallelDims.build_mesh gives its groups WORLD's timeout
        timeout = datetime.timedelta(seconds=pg_timeout_seconds(backend, cfg.comm.init_timeout_seconds))
        if "WORLD_SIZE" not in os.environ:  # plain `python train.py`: a world of one
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", str(_free_port()))
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
        dist.init_process_group(backend=backend, timeout=timeout)
    return device


def apply_train_timeout(seconds: int) -> None:
    """From the first completed step on, every collective of every process group must finish
    within ``comm.train_timeout_seconds`` (start-up, the first step and compilation ran under
    ``comm.init_timeout_seconds``): a dead or hung peer then ends the job in that time, not
    after the long start-up timeout. Placeholder groups (size-1 axes) have no communicator.
    NCCL groups get ``seconds`` + the watchdog's grace: the step watchdog speaks at ``seconds``
    (trainer/comm_watchdog.py)."""
    if not dist.is_initialized():
        return
    dist.barrier()  # every rank finished its first step: nothing is in flight under the old timeout
    for group in list(dist.distributed_c10d._world.pg_map):
        backend = dist.get_backend(group)
        if backend != "fake":
            timeout = datetime.timedelta(seconds=pg_timeout_seconds(backend, seconds))
            dist.distributed_c10d._set_pg_timeout(timeout, group)


def _is_collective_timeout(exc: BaseException) -> bool:
    text = str(exc)
    return isinstance(exc, (RuntimeError, dist.DistBackendError)) and (
        "Timed out" in text or "timed out" in text or "Watchdog caught collective operation timeout" in text
    )


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def require_writable_folder(folder: str, option: str) -> None:
    """Create ``folder`` if needed and check it can be written, before anything is built: a
    run that cannot write its outputs must not train for hours first."""
    try:
        os.makedirs(folder, exist_ok=True)
        probe = os.path.join(folder, f".write_test.{os.getpid()}")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as exc:
        raise ConfigError(
            f"{option} '{folder}' cannot be used ({exc.strerror or exc}: {exc.filename or folder}); "
            f"choose a writable folder with --{option} PATH"
        ) from None


def _moe_layers(model_parts: list[nn.Module]) -> list[nn.Module]:
    """The MoE modules of this rank's model parts (the model contract's ``moe_layers``)."""
    return [moe for part in model_parts for moe in part.moe_layers()]


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    lr: float


class Trainer:
    """Holds everything built from the config; ``train()`` runs the loop."""

    def __init__(self, cfg: JobConfig):
        self.cfg = cfg
        self.fake = cfg.comm.mode == "fake_backend"
        fake_notes = prepare_fake_config(cfg) if self.fake else []
        # training.deterministic and training.enable_tf32 (trainer/precision.py), first: before
        # init_distributed's set_device and any CUDA work, so CUBLAS_WORKSPACE_CONFIG is in the
        # environment before the first cuBLAS handle
        precision_notes = apply_precision_policy(cfg, default_device_type())
        self.device = init_distributed(cfg)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        for note in fake_notes + precision_notes:
            _log(note)
        torch.manual_seed(cfg.training.seed)
        require_writable_folder(cfg.job.dump_folder, "job.dump_folder")

        self.tokenizer = load_tokenizer(cfg.model.tokenizer_path)
        # every check that needs no process group, in one place (trainer/plan.py)
        self.plan = plan_job(cfg, self.world_size, self.tokenizer.vocab_size)
        self.pd = self.plan.parallel_dims
        spec = self.plan.model
        opts = self.plan.parallelize
        # a Hugging Face folder to start from is checked (config.json against the flavor and
        # overrides, every tensor's shape from the headers) before anything is built
        initial_hf = check_initial_load(cfg, self.plan.model.args)
        with torch.device("meta"):
            model = spec.model_cls(spec.args)
        self.num_params = sum(p.numel() for p in model.parameters())
        self.flops_per_token = training_flops_per_token(model, cfg.training.seq_len)

        self.pd.build_mesh(self.device.type)
        _log(
            f"mesh: world={self.world_size} pp={self.pd.pp} dp_replicate={self.pd.dp_replicate} "
            f"dp_shard={self.pd.dp_shard} cp={self.pd.cp} tp={self.pd.tp} ep={self.pd.ep} "
            f"etp={self.pd.etp}; process groups per rank: {self.pd.process_group_count()}; "
            f"mesh builder: {self.pd.mesh_builder} (torch {torch.__version__})"
        )
        self.loss_parallel = self.pd.tp > 1 and opts.loss_parallel
        self.loss_fn = self._cross_entropy
        if cfg.compile.enable and "loss" in cfg.compile.components:
            self.loss_fn = torch.compile(self._cross_entropy)
        self.pipeline = None
        if self.pd.pp > 1:
            p = cfg.parallelism
            split = split_model(
                model,
                self.pd,
                model.args.n_layers,
                p.pipeline_parallel_split_points or None,
                p.pipeline_parallel_schedule,
                layers_per_stage=p.pipeline_parallel_layers_per_stage,
            )
            self.model_parts = list(split.modules)
        else:
            self.model_parts = [model]
        for part in self.model_parts:
            spec.parallelize_fn(part, self.pd, opts)
            part.to_empty(device=self.device)
            with torch.no_grad():
                part.init_weights(cfg.training.seed)  # FQN-seeded: stages match the full model
        if self.pd.pp > 1:
            # imported here, not at the top: the pipeline runtime imports torch.distributed.pipelining
            # and with it torch._dynamo, about a second of every rank's start-up that a run
            # without pp does not need
            from models.parallel.pipeline import build_pipeline_schedule, stage_activation_dtype

            self.pipeline = build_pipeline_schedule(
                self.model_parts,
                split.stage_indices,
                self.pd,
                cfg.parallelism.pipeline_parallel_schedule,
                cfg.parallelism.pipeline_microbatches(),
                self.loss_fn,
                local_batch_size=cfg.training.local_batch_size,
                seq_len=cfg.training.seq_len,
                activation_dtype=stage_activation_dtype(opts.param_dtype),
                loss_parallel=self.loss_parallel,
            )

        # the next step's micro-batches are prepared on a background thread (training.prefetch)
        self.data = wrap_loader(
            build_dataloader(cfg, self.tokenizer, batch_rank=self.pd.coordinate("batch"), batch=self.plan.batch),
            cfg.training.prefetch,
            self.device,
        )
        self.validator = None
        if cfg.validation.enable:
            self.validator = Validator(
                cfg,
                self.tokenizer,
                self.pd,
                self.model_parts,
                self.loss_fn,
                self.device,
                loss_parallel=self.loss_parallel,
                train_pipeline=self.pipeline,
            )
        self.optimizer = build_optimizer(self.model_parts, cfg)
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
        )
        self.step = 0
        self._fake_meter = FakeStepMeter(cfg, self.device, self.pd.degrees.as_dict()) if self.fake else None

    # ---------------------------------------------------------------- one step
    @staticmethod
    def _cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum")

    def _shard_for_cp(self, t: torch.Tensor) -> torch.Tensor:
        return load_balanced_shard(t, 1, self.pd.coordinate("cp"), self.pd.size("cp"))

    def train_step(self, microbatches: list[tuple[torch.Tensor, torch.Tensor]]) -> StepResult:
        model = self.model_parts[0]
        global_tokens = self.data.tokens_per_step
        global_sequences = self.data.global_batch_size
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        moes = _moe_layers(self.model_parts)
        n = len(microbatches)
        for i, (inputs, labels) in enumerate(microbatches):
            if self.pipeline is not None:
                # the schedule splits the local batch into pipeline micro-batches and syncs
                # FSDP gradients on its last backward
                inputs = self._shard_for_cp(inputs).to(self.device, non_blocking=True)
                labels = self._shard_for_cp(labels).to(self.device, non_blocking=True)
                from models.parallel.pipeline import pipeline_step

                part = pipeline_step(self.pipeline, inputs, labels, global_tokens)
                if part is not None:
                    loss_sum += _full(part.detach()).float()
                continue
            sync = i == n - 1
            if hasattr(model, "set_requires_gradient_sync"):
                # reduce-scatter gradients once per step, not once per micro-batch
                model.set_requires_gradient_sync(sync)
            inputs = self._shard_for_cp(inputs).to(self.device, non_blocking=True)
            labels = self._shard_for_cp(labels).to(self.device, non_blocking=True)
            with loss_parallel_context(self.loss_parallel):
                logits = model(inputs)
                loss = self.loss_fn(logits, labels) / global_tokens
                for moe in moes:
                    if moe.aux_loss_sum is not None:
                        loss = loss + moe.aux_loss_sum / global_sequences
                loss.backward()
            loss_sum += _full(loss.detach()).float()
        params = [p for part in self.model_parts for p in part.parameters()]
        finalize_grads(params)
        self.on_grads_ready(params)
        pp_mesh = self.pd.get_optional_mesh("pp")
        grad_norm = clip_grad_norm_(params, self.cfg.training.max_norm, pp_mesh)
        if self.pipeline is not None:
            from models.parallel.pipeline import sum_loss_over_pp

            loss_sum = sum_loss_over_pp(loss_sum, pp_mesh, self.device)  # only last stage has it
        loss_total = self._reduce_loss(loss_sum)
        # The step's one host sync: everything above is queued on the device, and the loss
        # and norm are needed on the host to stop a diverged run before the optimizer applies
        # it. The optimizer's kernels are queued right after, and the next step's data is
        # prepared on the host while they run.
        loss_value, norm_value = torch.stack([loss_total, grad_norm.to(loss_total)]).tolist()
        # fake-backend values are meaningless (no-op collectives): no divergence check there
        if not (math.isfinite(loss_value) and math.isfinite(norm_value)) and not self.fake:
            raise TrainingDiverged(
                f"non-finite {'loss' if not math.isfinite(loss_value) else 'gradient norm'} at step "
                f"{self.step + 1} (loss={loss_value}, grad_norm={norm_value}); the run is "
                f"stopped before the optimizer applies it. Lower optimizer.lr, raise "
                f"lr_scheduler.warmup_steps or check the data, then resume from the last checkpoint."
            )
        self.optimizer.step()
        self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        if moes:
            self._update_expert_bias(moes)
        return StepResult(loss_value, norm_value, self.lr_scheduler.get_last_lr())

    def on_grads_ready(self, params: list[torch.Tensor]) -> None:
        """Extension point, called on every rank once the step's gradients are final (reduced,
        not yet clipped); tools such as tools/compare_loss/grad_dump.py override it."""
        if self._fake_meter is not None:
            self._fake_meter.note_grads(params)

    @contextlib.contextmanager
    def _instruments(self, step: int):
        """Around one training step: the collective recorder on ``comm.record_step`` (writes
        ``<dump_folder>/comm_rank<R>.json``), the matmul census on
        ``profiling.matmul_census_step`` (``<dump_folder>/matmul_census_rank<R>.json``) and, in
        a fake-backend run, the step's compute time
        and peak memory. Yields the dict of fields the step adds to its metrics record."""
        extra: dict = {}
        record = step == self.cfg.comm.record_step
        census = MatmulCensus(local=True) if step == self.cfg.profiling.matmul_census_step else None
        meter = self._fake_meter
        if meter is not None:
            meter.start()
        with record_comms(self.pd) if record else contextlib.nullcontext() as recorder:
            with census if census is not None else contextlib.nullcontext():
                yield extra
        if census is not None:
            path = os.path.join(self.cfg.job.dump_folder, f"matmul_census_rank{self.rank}.json")
            census.write(path, step=step, rank=self.rank, world_size=self.world_size, comm_mode=self.cfg.comm.mode,
                         degrees=self.pd.degrees.as_dict())  # fmt: skip
            _log(f"counted the matmul FLOPs of step {step}: {self.cfg.job.dump_folder}/matmul_census_rank<R>.json")
        if recorder is not None:
            write_records(
                recorder,
                os.path.join(self.cfg.job.dump_folder, f"comm_rank{self.rank}.json"),
                step=step,
                rank=self.rank,
                world_size=self.world_size,
                comm_mode=self.cfg.comm.mode,
                degrees=self.pd.degrees.as_dict(),
            )
            _log(f"recorded the collectives of step {step}: {self.cfg.job.dump_folder}/comm_rank<R>.json")
        if meter is not None:
            entry = meter.stop(step, recorded=record)
            if not meter.state.get("param_bytes"):
                meter.note_state(self.model_parts, self.optimizer)
            meter.write()
            extra.update(meter.metrics(entry))

    def _reduce_loss(self, loss_sum: torch.Tensor) -> torch.Tensor:
        """Sum of the per-rank partial losses over every rank that holds different tokens."""
        total = loss_sum.clone()
        loss_mesh = self.pd.get_optional_mesh("loss")
        if loss_mesh is not None:
            dist.all_reduce(total, group=loss_mesh.get_group())
        return total

    def _update_expert_bias(self, moes: list[nn.Module]) -> None:
        """Load statistics are summed over the ranks that route different tokens: the loss
        mesh, and tp (sequence parallel gives each tp rank its own tokens)."""
        counts = torch.stack([m.tokens_per_expert for m in moes])
        for name in ("loss", "tp"):
            mesh = self.pd.get_optional_mesh(name)
            if mesh is not None:
                dist.all_reduce(counts, group=mesh.get_group())
        for moe, c in zip(moes, counts):
            moe.update_expert_bias(c)

    # ---------------------------------------------------------------- the loop
    def train(self, stop_after: int | None = None) -> None:
        """Run to ``training.steps`` (the LR schedule's length), or stop early after step
        ``stop_after`` without changing the schedule (to retrace a run up to one step)."""
        cfg = self.cfg
        last_step = cfg.training.steps if stop_after is None else min(stop_after, cfg.training.steps)
        resumed = self.ckpt.resume()
        if resumed is not None:
            self.step = resumed
        run_folder = cfg.job.dump_folder
        if self.step >= cfg.training.steps:
            _log(
                f"nothing to train: the run in {run_folder} is already complete (step {self.step} "
                f"of training.steps = {cfg.training.steps}, resumed from {self.ckpt.folder}). To train on, "
                f"pass a larger --training.steps (the learning-rate schedule is recomputed for the "
                f"new length); to start over, delete {run_folder} or choose another --job.dump_folder"
            )
            return
        if self.rank == 0:
            os.makedirs(run_folder, exist_ok=True)
            with open(os.path.join(run_folder, "config.toml"), "w") as f:
                f.write(cfg.to_toml())
        metrics = MetricsLogger(
            run_folder,
            0 if self.fake else self.rank,  # a fake-backend run logs as the rank it plays
            cfg,
            world_size=self.world_size,
            # TFLOPs/MFU only mean something on accelerators
            flops_per_token=self.flops_per_token if self.device.type == "cuda" else None,
            device=self.device,
            total_steps=cfg.training.steps,
        )
        if metrics.peak_note:  # on CUDA: the part and precision MFU is priced at
            _log(metrics.peak_note)
        _log(
            f"training {cfg.model.name}/{cfg.model.flavor} ({self.num_params / 1e6:.1f}M params) for "
            f"{cfg.training.steps} steps; global batch {self.data.global_batch_size} x "
            f"{cfg.training.seq_len} tokens, {self.data.grad_accum_steps} micro-batch(es) of "
            f"{cfg.training.local_batch_size} per rank"
        )
        steps_since_log = 0
        data_wait = 0.0  # seconds the loop waited for data since the last log
        timeout_applied = False
        profiler = StepProfiler(cfg.profiling, run_folder, self.rank, self.device, first_step=self.step)
        # every step (and save, validation) under a deadline: trainer/comm_watchdog.py
        self.watchdog = self._start_watchdog()
        with metrics, profiler, self.data, self.watchdog:
            for message in profiler.messages:
                _log(message)
            while self.step < last_step:
                self.watchdog.step(self.step + 1, first=not timeout_applied)
                microbatches = self.data.next_step()
                data_wait += self.data.wait_s
                with self._instruments(self.step + 1) as step_extra:
                    result = self.train_step(microbatches)
                self.step += 1
                if not timeout_applied:
                    apply_train_timeout(cfg.comm.train_timeout_seconds)
                    timeout_applied = True
                profiler.step(self.step)
                steps_since_log += 1
                if metrics.should_log(self.step) or self.step == cfg.training.steps:
                    metrics.log(
                        self.step,
                        loss=result.loss,
                        grad_norm=result.grad_norm,
                        lr=result.lr,
                        num_tokens=steps_since_log * self.data.tokens_per_step,
                        data_wait_s=data_wait / steps_since_log,
                        extra=step_extra or None,
                    )
                    steps_since_log, data_wait = 0, 0.0
                if self.validator is not None and self.validator.should_run(self.step):
                    self.watchdog.long_phase(f"validation after step {self.step}")
                    val = self.validator.validate()
                    metrics.log_validation(
                        self.step, loss=val.loss, steps=val.steps, tokens=val.tokens, seconds=val.seconds
                    )
                    metrics.reset_timer()
                self.ckpt.maybe_save(
                    self.step, last=self.step == cfg.training.steps, phase=lambda what: self._long_phase(what, metrics)
                )
                self.watchdog.disarm()

    @contextlib.contextmanager
    def _long_phase(self, what: str, metrics: MetricsLogger):
        """A checkpoint save or export after a step: under the watchdog's long-phase deadline,
        and not counted in the next logged step's time."""
        self.watchdog.long_phase(what)
        yield
        metrics.reset_timer()

    def _start_watchdog(self) -> JobWatchdog | NullWatchdog:
        """The step watchdog of a run with peers; nothing for one process or the fake backend."""
        if self.fake or self.world_size == 1:
            return NullWatchdog()
        c = self.cfg.comm
        return JobWatchdog(
            self.rank,
            dist.get_backend(),
            train_timeout_seconds=c.train_timeout_seconds,
            init_timeout_seconds=c.init_timeout_seconds,
            dump_folder=self.cfg.job.dump_folder,
        )


def create_seed_checkpoint(cfg: JobConfig) -> str:
    """Initial weights from the seed, written once by one process; every layout loads them."""
    device = init_distributed(cfg)
    if dist.get_world_size() != 1:
        raise ConfigError(
            "--checkpoint.create_seed_checkpoint runs on one process: use "
            "torchrun --nproc_per_node=1 (or plain python train.py)"
        )
    require_writable_folder(cfg.job.dump_folder, "job.dump_folder")
    tokenizer = load_tokenizer(cfg.model.tokenizer_path)
    model = build_model(cfg.model.name, cfg.model.flavor, device="cpu", **model_overrides(cfg, tokenizer.vocab_size))
    with torch.no_grad():
        model.init_weights(cfg.training.seed)
    folder = cfg.resolve_path(cfg.checkpoint.folder)
    path = save_seed_checkpoint(model.to(device), folder)
    _log(f"wrote seed checkpoint {path}")
    return path


def main(argv: list[str] | None = None) -> int:
    try:
        cfg = load_config(argv)
    except ValueError as exc:
        return report_user_error(exc)
    trainer = None  # read by the collective-timeout message (the step that was running)
    try:
        if cfg.checkpoint.create_seed_checkpoint:
            create_seed_checkpoint(cfg)
            return 0
        trainer = Trainer(cfg)
        if trainer.rank == 0:
            print("resolved config:\n" + cfg.to_toml(), flush=True)
        trainer.train()
        return 0
    except TrainingDiverged as exc:
        print(f"error: {exc}", file=sys.stderr, flush=True)
        return 1
    except BaseException as exc:  # torch.distributed.checkpoint's CheckpointException is a BaseException
        # bad input (config, degrees vs world size, model vs layout, a checkpoint, also when
        # DCP wraps it): a clear message from rank 0, no traceback
        err = user_error(exc)
        if err is not None:
            rank = dist.get_rank() if dist.is_initialized() else 0
            if rank == 0 or is_fake_backend():
                report_user_error(err)
            return EXIT_BAD_INPUT
        if not isinstance(exc, Exception) or not _is_collective_timeout(exc):
            raise
        # gloo (the exception path; on NCCL the step watchdog speaks first): the same one line
        rank = dist.get_rank() if dist.is_initialized() else 0
        backend = dist.get_backend() if dist.is_initialized() else ""
        phase = getattr(getattr(trainer, "watchdog", None), "phase", "")
        # without the Python stacks (seconds to symbolize the first time); the entries' states and
        # sequence numbers say which collective each rank waits in
        dump = write_flight_recorder_dump(rank, backend, dump_prefix(), cfg.job.dump_folder, stack_traces=False)
        print(
            f"error: rank {rank}: {phase + ': ' if phase else ''}a collective did not finish within "
            f"comm.train_timeout_seconds = {cfg.comm.train_timeout_seconds} s (comm.init_timeout_seconds = "
            f"{cfg.comm.init_timeout_seconds} s until the first step): another rank is hung or "
            f"dead, see its log; if steps legitimately take that long, raise the timeout; "
            f"flight-recorder dump: {dump}. ({str(exc).splitlines()[0][:200]})",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_COMM_TIMEOUT
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
