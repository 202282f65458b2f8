"""The preference loss (trainer/objectives/dpo.py) against TRL 1.16's ``DPOTrainer`` on the same
exported model and the same pairs, sigmoid and IPO: loss, the six TRL metrics and every
parameter gradient of one micro-batch.

Our side: a llama3 model (2 blocks, dim 64) as the policy and a second one as the reference
(different seeds, so the rewards are not 0), both exported with the Hugging Face adapter's
``to_hf`` and loaded by ``transformers``; TRL's side: a ``DPOTrainer`` built on a 2-pair dataset
(no hub: the tokenizer is the shipped BPE with an EOS added) with those two models, its own
collator's batch and its own ``compute_loss`` (which runs TRL's fused-head log-probs and its
loss code). Our side runs the same token rows, interleaved (chosen ``2k``, rejected ``2k + 1``)
with the completion mask as -100 labels, through our model's forward and
:class:`PreferenceLoss` (sum over pairs, divided by the pair count as the trainer does).

Tolerance: both sides are float32 with different kernels (our SDPA attention and head vs
transformers' and TRL's fused log-softmax), which the adapter tests bound at 1e-5 on the
logits; a sequence log-prob sums ~10 token log-probs of magnitude ~8, so its error is ~1e-5
absolute, and beta (0.1) scales that in the loss. Measured (CPU): sigmoid loss within 2.4e-7,
IPO within 1.9e-6 (of 18.7), rewards within 1e-6, logps within 8e-6 (of ~ -75), gradients within
9.8e-7 of their tensor's largest entry. Asserted: loss and rewards rel 1e-5 / abs 1e-5, logps
abs 1e-4, gradients abs 1e-5 x their tensor's max. ``DPOConfig(bf16=False)``: TRL 1.16 defaults
to bf16, and accelerate then runs the prepared reference model under bf16 autocast (measured
0.03 off in a reference log-prob), which is not the float32 comparison meant here.
Negative controls: beta 0.2 instead of 0.1 and the chosen / rejected rows swapped each move the
loss beyond 100x that tolerance.
"""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("trl")
safetensors_torch = pytest.importorskip("safetensors.torch")

from models.registry import build_model, get_hf_adapter  # noqa: E402
from trainer.config.dpo_section import Dpo  # noqa: E402
from trainer.objectives.dpo import METRIC_NAMES, PreferenceLoss  # noqa: E402

pytestmark = pytest.mark.unit

VOCAB = 2112  # the shipped BPE's 2048 tokens and the EOS added here, padded
OURS = dict(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=VOCAB, multiple_of=32, max_seq_len=64)
PAIRS = {
    "prompt": ["The cat sat on", "Numbers go"],
    "chosen": [" the mat today.", " one two three four"],
    "rejected": [" a hat", " up and down in a line"],
}


def _ours(seed: int):
    model = build_model("llama3", "debugmodel", device="cpu", **OURS)
    model.init_weights(seed)
    g = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():  # norms off 1 so a mapping error cannot hide
        for name, t in model.state_dict(keep_vars=True).items():
            if name.endswith("norm.weight"):
                t.copy_(1 + 0.2 * torch.randn(t.shape, generator=g))
    return model


def _export(model, folder):
    from transformers import AutoModelForCausalLM

    adapter = get_hf_adapter("llama3", model.args)
    folder.mkdir()
    sd = {k: v.contiguous() for k, v in adapter.to_hf(model.state_dict()).items()}
    safetensors_torch.save_file(sd, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(adapter.hf_config("float32")))
    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).train()


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import PreTrainedTokenizerFast

    from trainer.data.tokenizer import DEFAULT_TOKENIZER_PATH

    tmp = tmp_path_factory.mktemp("dpo_trl")
    policy, ref = _ours(3), _ours(5)
    tok = PreTrainedTokenizerFast(tokenizer_file=DEFAULT_TOKENIZER_PATH, eos_token="<|eos|>")
    assert len(tok) <= VOCAB
    return policy, ref, _export(policy, tmp / "policy"), _export(ref, tmp / "ref"), tok, tmp


def _trl(setup, loss_type: str, beta: float):
    """TRL's loss, metrics and gradients (by HF parameter name) of the 2 pairs, and its batch."""
    from datasets import Dataset
    from trl import DPOConfig, DPOTrainer

    _, _, policy_hf, ref_hf, tok, tmp = setup
    args = DPOConfig(
        output_dir=str(tmp / f"trl_{loss_type}"), beta=beta, loss_type=[loss_type], report_to=[], use_cpu=True,
        per_device_train_batch_size=2, save_strategy="no", logging_strategy="no", bf16=False,
    )  # fmt: skip
    trainer = DPOTrainer(
        model=policy_hf, ref_model=ref_hf, args=args, train_dataset=Dataset.from_dict(PAIRS), processing_class=tok
    )
    batch = trainer.data_collator([trainer.train_dataset[i] for i in range(2)])
    policy_hf.zero_grad(set_to_none=True)
    loss = trainer.compute_loss(policy_hf, batch)
    loss.backward()
    metrics = {name: trainer._metrics["train"][name][-1] for name in METRIC_NAMES}
    grads = {n: p.grad.detach().clone() for n, p in policy_hf.named_parameters()}
    _forget_accelerate_state()
    return loss.item(), metrics, grads, batch


def _forget_accelerate_state() -> None:
    """The ``DPOTrainer`` made, through accelerate, a gloo process group of one in this pytest
    process and a state singleton that points at it: both go, so the next test here starts
    without a default group (tests/conftest.py fails a test that leaves one)."""
    import torch.distributed as dist
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    if dist.is_initialized():
        dist.destroy_process_group()


def _our_rows(batch, swap: bool = False):
    """TRL's [chosen..., rejected...] rows interleaved, as next-token inputs and -100 labels."""
    ids, mask = batch["input_ids"], batch["completion_mask"]
    b = ids.shape[0] // 2
    order = [i + (b if (k % 2) != swap else 0) for i in range(b) for k in range(2)]
    ids, mask = ids[order], mask[order]
    labels = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
    return ids[:, :-1], labels


def _ours_loss(setup, batch, loss_type: str, beta: float, swap: bool = False):
    policy, ref, *_ = setup
    inputs, labels = _our_rows(batch, swap)
    loss_fn = PreferenceLoss(Dpo(beta=beta, loss_type=loss_type), None, 1, reference_free=False)
    loss_fn.collecting = True
    with torch.no_grad():
        loss_fn(ref(inputs), labels)
    loss_fn.collecting = False
    policy.zero_grad(set_to_none=True)
    pairs = inputs.shape[0] // 2
    loss = loss_fn(policy(inputs), labels) / pairs
    loss.backward()
    metrics = dict(zip(METRIC_NAMES, (loss_fn.take_metrics(torch.device("cpu")) / pairs).tolist()))
    adapter = get_hf_adapter("llama3", policy.args)
    grads = adapter.to_hf({n: p.grad for n, p in policy.named_parameters()})  # to_hf is linear per tensor
    return loss.item(), metrics, grads


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_dpo_matches_trl(setup, loss_type):
    beta = 0.1
    trl_loss, trl_metrics, trl_grads, batch = _trl(setup, loss_type, beta)
    loss, metrics, grads = _ours_loss(setup, batch, loss_type, beta)
    print(f"{loss_type}: ours {loss:.8f} trl {trl_loss:.8f} diff {abs(loss - trl_loss):.2e}")
    assert abs(trl_metrics["rewards/margins"]) > 1e-2  # policy and reference differ: a real comparison
    assert loss == pytest.approx(trl_loss, rel=1e-5, abs=1e-5)
    for name in METRIC_NAMES:
        tol = 1e-4 if name.startswith("logps") else 1e-5
        print(f"  {name:<20} ours {metrics[name]: .6f} trl {trl_metrics[name]: .6f}")
        assert metrics[name] == pytest.approx(trl_metrics[name], rel=1e-5, abs=tol), name
    worst = 0.0
    for name, g in trl_grads.items():
        ours = grads[name.removeprefix("model.") if name not in grads else name]
        scale = g.abs().max().item()
        worst = max(worst, (ours - g).abs().max().item() / scale)
        torch.testing.assert_close(ours, g, rtol=0, atol=1e-5 * scale, msg=name)
    print(f"  gradients: worst |diff| / max|g| {worst:.2e} over {len(trl_grads)} tensors")

    # negative controls: beta changed, chosen and rejected swapped
    for what, kwargs in (("beta 0.2", dict(beta=0.2)), ("swapped", dict(beta=beta, swap=True))):
        wrong, _, _ = _ours_loss(setup, batch, loss_type, **kwargs)
        print(f"  control {what}: loss {wrong:.6f} (diff {abs(wrong - trl_loss):.2e})")
        assert abs(wrong - trl_loss) > 100 * (1e-5 + 1e-5 * abs(trl_loss)), what


def test_simpo_matches_trl_cpo_loss():
    """SimPO (reference-free) against TRL's own formula: ``CPOTrainer.get_batch_logps`` (length
    averaged) and ``cpo_loss`` (loss_type simpo) of trl.experimental.cpo, called unbound on the
    same logits and labels: loss per pair and rewards ``beta * average logp``. Same float32 math
    up to summation order: rel 1e-6. Control: gamma 0 instead of 0.5 differs by > 1e-2."""
    from types import SimpleNamespace

    from trl.experimental.cpo.cpo_trainer import CPOTrainer

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 12, 50, generator=g)
    labels = torch.randint(0, 50, (4, 12), generator=g)
    labels[:, :4] = -100  # the prompt
    labels[1, 9:] = -100  # a shorter rejected completion (padding)
    beta, gamma = 2.0, 0.5
    from trainer.objectives.dpo import pair_losses, row_logps

    logp, n = row_logps(logits[:, :-1], labels[:, 1:])
    losses, metrics = pair_losses(logp, n, None, loss_type="simpo", beta=beta, gamma=gamma)
    fake = SimpleNamespace(
        alpha=0.0, loss_type="simpo", simpo_gamma=gamma, beta=beta, label_smoothing=0.0,
        accelerator=SimpleNamespace(device="cpu"),
    )  # fmt: skip
    avg = CPOTrainer.get_batch_logps(logits, labels, average_log_prob=True)
    theirs, chosen_rewards, rejected_rewards = CPOTrainer.cpo_loss(fake, avg[0::2], avg[1::2])
    torch.testing.assert_close(losses, theirs, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(metrics[:, 0], chosen_rewards, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(metrics[:, 1], rejected_rewards, rtol=1e-6, atol=1e-6)
    control, _ = pair_losses(logp, n, None, loss_type="simpo", beta=beta, gamma=0.0)
    assert (control - theirs).abs().max() > 1e-2


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--training.dataset", "synthetic"], "set training.dataset = 'preference'"),
        (["--dpo.beta", "0"], "dpo.beta must be > 0"),
        (["--dpo.loss_type", "simpo"], "set dpo.reference = 'none'"),
        (["--dpo.reference", "none"], "needs a reference model"),
        (["--dpo.loss_type", "ipo", "--dpo.label_smoothing", "0.1"], "applies to loss_type 'sigmoid' only"),
        (["--dpo.label_smoothing", "0.5"], "must be in [0, 0.5)"),
        (["--model.converters", "lora", "--lora.dropout", "0.1"], "set lora.dropout = 0"),
        (
            ["--training.local_batch_size", "3", "--training.global_batch_size", "-1"],
            "must be even with preference data",
        ),
        (["--dpo.loss_type", "orpo"], "dpo.loss_type"),
    ],
)
def test_bad_dpo_configs_are_one_line_errors(args, needle):
    from trainer.config import load_config
    from trainer.config.errors import ConfigError

    base = ["--config", "llama3.toml", "--training.objective", "dpo", "--training.dataset", "preference"]
    base += ["--training.dataset_path", "pairs.jsonl"]  # not read: the config checks come first
    with pytest.raises(ConfigError) as exc:
        load_config([*base, "--training.local_batch_size", "4", *args])
    message = str(exc.value)
    assert needle in message and "\n" not in message, message
