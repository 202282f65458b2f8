"""The planner's estimate of the job a trainer config describes: the config resolved by the
trainer's own job plan (``trainer.plan.plan_job``: layout, batch split, schedule, AC, dtypes,
model overrides, float8, LoRA, the optimizer and its parameter-group routing), turned into the planner's :class:`Job` and
:class:`LayoutChoice` and priced by :func:`tools.planner.estimate.estimate`; and :func:`peak_bytes`, the busiest rank's device
memory of a trainer job plan with the memory options the config turns on (the launcher's
node-range check, which ``train.py`` hands it to: trainer/lifecycle/elastic_fit.py)."""

from __future__ import annotations

from .choice import LayoutChoice
from .estimate import Estimate, Job, estimate
from .hardware import Hardware

__all__ = ["choice_from_plan", "config_options", "estimate_from_config", "job_from_plan", "peak_bytes"]


def choice_from_plan(plan) -> LayoutChoice:
    """The :class:`LayoutChoice` of a trainer job plan (``trainer.plan.plan_job``): batch split,
    schedule, micro-batches, AC, reshard policy, dtypes, sequence and loss parallel, as the
    trainer will run them."""
    p, opts, pd = plan.config.parallelism, plan.parallelize, plan.parallel_dims
    pp = pd.degrees.pp > 1
    return LayoutChoice(
        global_batch=plan.batch.global_batch_size,
        local_batch=plan.batch.local_batch_size,
        seq_len=plan.batch.seq_len,
        schedule=p.pipeline_parallel_schedule if pp else None,
        n_microbatches=p.pipeline_microbatches() if pp else None,
        ac=opts.ac_mode,
        selective_ac_option=str(opts.ac_selective_option),
        reshard=opts.reshard_after_forward,
        param_dtype=opts.param_dtype,
        reduce_dtype=opts.reduce_dtype,
        sequence_parallel=opts.sequence_parallel,
        loss_parallel=opts.loss_parallel,
        float8=opts.float8,
        lora=opts.lora,
    )


def estimate_from_config(
    cfg, world_size: int, hardware: Hardware, *, gpus_per_node: int = 8, efficiency: float = 0.5,
    tokenizer_vocab: int | None = None,
) -> Estimate:  # fmt: skip
    """The estimate of the job a trainer config runs on ``world_size`` GPUs: its layout, batch
    split, schedule, AC, dtypes and model overrides exactly as ``trainer.plan.plan_job`` resolves
    them (which raises for a config the trainer would refuse), float8 included (``model.converters``,
    ``[float8]``). ``tokenizer_vocab`` as for
    ``plan_job`` (None loads the config's tokenizer)."""
    from trainer.plan import plan_job

    plan = plan_job(cfg, world_size, tokenizer_vocab=tokenizer_vocab)
    job, degrees, choice = job_from_plan(plan, hardware, gpus_per_node=gpus_per_node, efficiency=efficiency)
    return estimate(job, degrees, choice)


def job_from_plan(plan, hardware: Hardware, *, gpus_per_node: int = 8, efficiency: float = 0.5):
    """The planner's ``(Job, degrees, LayoutChoice)`` of a trainer job plan (``trainer.plan.plan_job``):
    what :func:`estimate_from_config` prices, for a caller that has the plan already
    (:func:`peak_bytes`)."""
    import dataclasses

    from models.registry import HF_FLAVOR, flavor_names

    cfg, world_size = plan.config, plan.world_size
    choice = choice_from_plan(plan)
    args = plan.model_args  # the flavor's with the config's overrides (trainer.plan.model_overrides)
    overrides = {"vocab_size": args.vocab_size, "max_seq_len": args.max_seq_len, "n_layers": args.n_layers}
    flavor = cfg.model.flavor
    if flavor == HF_FLAVOR:  # sizes from a config.json: the first preset with every arg overridden
        flavor = flavor_names(cfg.model.name)[0]
        overrides = {f.name: getattr(args, f.name) for f in dataclasses.fields(args)}
    elif getattr(args, "mtp_layers", 0):
        overrides["mtp_layers"] = args.mtp_layers
    job = Job(
        cfg.model.name, flavor, world_size, gpus_per_node, choice.seq_len, choice.global_batch, hardware,
        efficiency, choice.param_dtype, choice.reduce_dtype, tf32=bool(cfg.training.enable_tf32),
        model_overrides=tuple(sorted(overrides.items())), float8=choice.float8, lora=plan.parallelize.lora,
        optimizer=cfg.optimizer.name, muon_distribution=cfg.optimizer.muon_distribution,
        muon_ns_steps=cfg.optimizer.muon_ns_steps,
        param_groups=tuple((t["pattern"], t.get("optimizer")) for t in cfg.optimizer.param_groups),
    )  # fmt: skip
    return job, plan.parallel_dims.degrees, choice


def config_options(cfg) -> tuple[str, ...]:
    """The ``--fit`` options (:data:`tools.planner.fit.OPTIONS`) the trainer config turns on."""
    on = {
        "loss_chunk_tokens": cfg.training.loss_chunk_tokens > 0,
        "state_dtype": cfg.optimizer.state_dtype == "bfloat16",
        "activation_offload": cfg.activation_checkpoint.offload,
        "cpu_offload": cfg.training.cpu_offload,
    }
    return tuple(name for name, is_on in on.items() if is_on)


def peak_bytes(plan, gpus_per_node: int) -> float:
    """The device memory in bytes of the busiest rank of a trainer job plan (``trainer.plan.plan_job``
    on one world size): :func:`tools.planner.estimate.memory_for_rank` of the first and the last
    pipeline stage, as :func:`estimate_from_config` prices them, with the memory options the
    config turns on priced as ``--fit`` prices them (:func:`tools.planner.fit.option_memory`).
    Raises for a model or an option the planner has no memory model of. Without options, the
    figure is ``estimate_from_config(...).memory["total"]``; the hardware does not enter it."""
    from .fit import option_memory
    from .hardware import load_hardware

    cfg = plan.config
    job, d, choice = job_from_plan(plan, load_hardware("h100"), gpus_per_node=gpus_per_node)
    ranks = sorted({0, (d.pp - 1) * (d.world_size // d.pp)})  # first and last stage, as estimate()
    options, chunk = config_options(cfg), cfg.training.loss_chunk_tokens
    return max(option_memory(job, d, choice, r, options, chunk)["total"] for r in ranks)
