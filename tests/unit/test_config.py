import glob
import os
import re

import pytest

from trainer.config import (
    CONFIG_DIR,
    ConfigError,
    JobConfig,
    config_from_dict,
    gradient_accumulation_steps,
    load_config,
)

SHIPPED = sorted(glob.glob(os.path.join(CONFIG_DIR, "*.toml")))


def test_config_error_is_value_error():
    assert issubclass(ConfigError, ValueError)


def test_defaults_without_config_file():
    cfg = load_config([])
    assert cfg == JobConfig()
    assert cfg.model.name == "llama3" and cfg.parallelism.data_parallel_shard_degree == -1


def test_expected_configs_are_shipped():
    names = {os.path.basename(p) for p in SHIPPED}
    assert {
        "llama3.toml",
        "deepseek_v3.toml",
        "llama3_8b.toml",
        "llama3_70b.toml",
        "deepseek_v3_16b.toml",
        "deepseek_v3_671b.toml",
    } <= names


@pytest.mark.parametrize("path", SHIPPED, ids=os.path.basename)
def test_every_shipped_config_parses(path):
    cfg = load_config(["--config", path])
    assert cfg.training.steps > 0


def test_llama3_debug_config_values():
    cfg = load_config(["--config", "llama3.toml"])
    t = cfg.training
    assert (cfg.model.flavor, t.seq_len, t.global_batch_size, t.local_batch_size) == ("debugmodel", 128, 16, 4)
    assert cfg.checkpoint.interval == 25 and cfg.checkpoint.keep_latest_k == 2
    assert cfg.metrics.log_freq == 1 and cfg.metrics.enable_tensorboard and cfg.metrics.enable_jsonl
    assert t.gradient_accumulation_steps(4) == 1 and t.gradient_accumulation_steps(2) == 2


def test_bare_name_resolves_in_train_configs_from_any_cwd(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    a = load_config(["--config", "llama3.toml"])
    b = load_config(["--config=llama3"])
    assert a == b and a.job.name == "llama3_debug"


def test_missing_config_lists_shipped_ones():
    with pytest.raises(ConfigError, match=r"config file 'nope.toml' not found.*llama3.toml"):
        load_config(["--config", "nope.toml"])


def test_overrides_both_syntaxes_and_types():
    cfg = load_config(
        [
            "--config",
            "llama3.toml",
            "--training.steps",
            "7",
            "--optimizer.lr=1e-3",
            "--optimizer.betas",
            "0.8,0.9",
            "--checkpoint.enable",
            "false",
            "--metrics.enable_tensorboard=0",
            "--job.name",
            "with spaces",
            "--compile.components",
            "model",
            "--model.vocab_size",
            "4096",
            "--parallelism.pipeline_parallel_microbatches=none",
        ]
    )
    assert cfg.training.steps == 7
    assert cfg.optimizer.lr == 1e-3 and cfg.optimizer.betas == [0.8, 0.9]
    assert cfg.checkpoint.enable is False and cfg.metrics.enable_tensorboard is False
    assert cfg.job.name == "with spaces" and cfg.compile.components == ["model"]
    assert cfg.model.vocab_size == 4096 and cfg.parallelism.pipeline_parallel_microbatches is None


def test_bare_bool_flag_means_true_and_last_override_wins():
    cfg = load_config(
        ["--checkpoint.create_seed_checkpoint", "--training.steps", "3", "--training.steps=4", "--checkpoint.enable"]
    )
    assert cfg.checkpoint.create_seed_checkpoint is True and cfg.checkpoint.enable is True
    assert cfg.training.steps == 4


def test_negative_number_is_a_value_not_a_flag():
    cfg = load_config(["--parallelism.dp_shard", "-1", "--checkpoint.load_step", "-1"])
    assert cfg.parallelism.data_parallel_shard_degree == -1


def test_parallelism_aliases():
    cfg = load_config(
        [
            "--model.name",
            "deepseek_v3",
            "--parallelism.tp",
            "2",
            "--parallelism.dp_shard=4",
            "--parallelism.dp_replicate",
            "2",
            "--parallelism.cp",
            "2",
            "--parallelism.pp",
            "2",
            "--parallelism.ep",
            "4",
            "--parallelism.etp",
            "1",
            "--training.local_batch_size",
            "4",
        ]
    )
    p = cfg.parallelism
    assert (
        p.tensor_parallel_degree,
        p.data_parallel_shard_degree,
        p.data_parallel_replicate_degree,
        p.context_parallel_degree,
        p.pipeline_parallel_degree,
        p.expert_parallel_degree,
        p.expert_tensor_parallel_degree,
    ) == (2, 4, 2, 2, 2, 4, 1)
    assert "tp =" not in cfg.to_toml() and "tensor_parallel_degree = 2" in cfg.to_toml()


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--training.stesp", "3"], "unknown key 'training.stesp'; did you mean 'training.steps'?"),
        (["--training.steps", "ten"], "training.steps expects an int, got 'ten'"),
        (["--trainig.steps", "1"], "unknown section 'trainig'; did you mean 'training.steps'?"),
        (["--steps", "3"], "unknown option '--steps'; did you mean '--training.steps'?"),
        (["--parallelism.tpp", "2"], "unknown key 'parallelism.tpp'; did you mean 'parallelism.tp'?"),
        (["--optimizer.lr", "fast"], "optimizer.lr expects a float, got 'fast'"),
        (["--checkpoint.enable", "maybe"], "checkpoint.enable expects a bool (true/false), got 'maybe'"),
        (["--training.steps"], "--training.steps needs a value (an int)"),
        (
            ["--optimizer.name", "adamw"],
            "optimizer.name must be one of 'AdamW', 'Muon', got 'adamw'; did you mean 'AdamW'?",
        ),
        (["--lr_scheduler.decay_style", "cosin"], "did you mean 'cosine'?"),
        (
            ["--model.flavor", "8b"],
            "model.flavor must be one of 'debugmodel', 'debugmodel_tied', '1B', '3B', '8B', '70B', '405B' for model 'llama3', got '8b'; did you mean '8B'?",
        ),
        (["--training.local_batch_size", "0"], "training.local_batch_size must be > 0, got 0"),
        (["--training.seq_len", "-5"], "training.seq_len must be > 0, got -5"),
        (["--optimizer.lr", "-1"], "optimizer.lr must be a finite number >= 0, got -1.0"),
        (
            ["--training.global_batch_size", "10", "--training.local_batch_size", "4"],
            "training.global_batch_size (10) must be a multiple of training.local_batch_size (4)",
        ),
        (["--parallelism.ep", "2"], "expert parallelism (parallelism.ep/etp) needs an MoE model"),
        (["--training.dataset", "jsonl"], "training.dataset = 'jsonl' needs training.dataset_path"),
        (["--activation_checkpoint.selective_ac_option", "sometimes"], "must be 'op' or a positive integer N"),
        (["--compile.components", "model,los"], "did you mean 'loss'?"),
        (["positional"], "unexpected argument 'positional'"),
        (
            ["--parallelism.pp", "4", "--training.local_batch_size", "2"],
            "training.local_batch_size (2) must be divisible by the pipeline microbatch count 4",
        ),
        (["--model.n_layers", "0"], "model.n_layers must be > 0 (or none for the flavor's), got 0"),
        (["--optimizer.implementation", "fusd"], "did you mean 'fused'?"),
        (
            ["--profiling.profile_freq", "3"],
            "profiling.profile_freq (3) must be >= profiler_warmup + profiler_active (3 + 1)",
        ),
    ],
)
def test_cli_errors_name_the_key_and_the_fix(argv, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_config(argv)


def test_toml_errors(tmp_path):
    bad_key = tmp_path / "a.toml"
    bad_key.write_text("[training]\nstesp = 3\n")
    with pytest.raises(ConfigError, match=re.escape("unknown key 'training.stesp'; did you mean 'training.steps'?")):
        load_config(["--config", str(bad_key)])
    bad_type = tmp_path / "b.toml"
    bad_type.write_text('[training]\nsteps = "ten"\n')
    with pytest.raises(ConfigError, match=re.escape("training.steps expects an int, got 'ten'")):
        load_config(["--config", str(bad_type)])
    bad_section = tmp_path / "c.toml"
    bad_section.write_text("[optimiser]\nlr = 1.0\n")
    with pytest.raises(ConfigError, match=re.escape("unknown section 'optimiser'; did you mean 'optimizer.lr'?")):
        load_config(["--config", str(bad_section)])
    not_toml = tmp_path / "d.toml"
    not_toml.write_text("[training\n")
    with pytest.raises(ConfigError, match="is not valid TOML"):
        load_config(["--config", str(not_toml)])


def test_toml_int_for_float_and_for_selective_ac(tmp_path):
    f = tmp_path / "x.toml"
    f.write_text("[optimizer]\nlr = 1\n[activation_checkpoint]\nmode = 'selective'\nselective_ac_option = 2\n")
    cfg = load_config(["--config", str(f)])
    assert cfg.optimizer.lr == 1.0 and isinstance(cfg.optimizer.lr, float)
    assert cfg.activation_checkpoint.selective_ac_option == "2"


def test_cli_overrides_toml(tmp_path):
    cfg = load_config(["--config", "llama3.toml", "--training.seq_len", "64"])
    assert cfg.training.seq_len == 64 and cfg.training.steps == 50


def test_to_toml_roundtrip(tmp_path):
    cfg = load_config(
        [
            "--config",
            "deepseek_v3.toml",
            "--parallelism.ep",
            "2",
            "--optimizer.eps",
            "1e-12",
            "--checkpoint.exclude_from_loading",
            "optimizer,rng",
        ]
    )
    cfg.job.description = 'quote " backslash \\ tab \t newline \n unicode é'
    cfg.model.vocab_size = None
    text = cfg.to_toml()
    path = tmp_path / "resolved.toml"
    path.write_text(text)
    again = load_config(["--config", str(path)])
    assert again.to_dict() == cfg.to_dict()
    assert (
        config_from_dict(cfg.to_dict() | {"model": {k: v for k, v in cfg.to_dict()["model"].items() if v is not None}})
        == cfg
    )


def test_gradient_accumulation_arithmetic_and_errors():
    assert gradient_accumulation_steps(16, 4, 4) == 1
    assert gradient_accumulation_steps(16, 2, 2) == 4
    assert gradient_accumulation_steps(-1, 4, 3) == 1
    with pytest.raises(
        ConfigError,
        match=re.escape(
            "training.global_batch_size (16) must be a positive multiple of batch degree (3) x training.local_batch_size (4) = 12; legal values: 12, 24, 36, 48"
        ),
    ):
        gradient_accumulation_steps(16, 4, 3)


def test_help_exits(capsys):
    with pytest.raises(SystemExit) as e:
        load_config(["--help"])
    assert e.value.code == 0
    assert "--training.steps" in capsys.readouterr().out


def test_model_n_layers_override_reaches_the_model():
    from models.registry import build_model
    from trainer.trainer import model_overrides

    cfg = load_config(["--config", "llama3.toml", "--model.flavor", "8B", "--model.n_layers", "2"])
    overrides = model_overrides(cfg, tokenizer_vocab=2048)
    assert overrides["n_layers"] == 2
    model = build_model("llama3", "8B", device="meta", **overrides)
    assert len(model.layers) == 2 and model.args.dim == 4096  # 8B shapes, two layers
    assert "n_layers" not in model_overrides(load_config(["--config", "llama3.toml"]), 2048)


def test_model_names_and_flavors_come_from_the_registry():
    import dataclasses

    from models.registry import flavor_names, model_names
    from trainer.config import Model

    (name_field,) = [f for f in dataclasses.fields(Model) if f.name == "name"]
    assert name_field.metadata["choices"] == tuple(model_names())
    for model in model_names():
        for flavor in flavor_names(model):
            load_config(["--model.name", model, "--model.flavor", flavor])
