"""The planner's estimate of the job a trainer config describes: the config resolved by the
trainer's own job plan (``trainer.plan.plan_job``: layout, batch split, schedule, AC, dtypes,
model overrides, float8, LoRA, the optimizer and its parameter-group routing), turned into the planner's :class:`Job` and
:class:`LayoutChoice` and priced by :func:`tools.planner.estimate.estimate`."""

from __future__ import annotations

from .choice import LayoutChoice
from .estimate import Estimate, Job, estimate
from .hardware import Hardware

__all__ = ["choice_from_plan", "estimate_from_config"]


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
    import dataclasses

    from models.registry import HF_FLAVOR, flavor_names
    from trainer.plan import plan_job

    plan = plan_job(cfg, world_size, tokenizer_vocab=tokenizer_vocab)
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
    return estimate(job, plan.parallel_dims.degrees, choice)
