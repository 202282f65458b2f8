"""trainer/inference/lm_eval_model.py's request logic against lm-eval's own HFLM, in one process.

The model side is a stand-in session over the very transformers model HFLM runs (the real
InferenceSession over the sharded model is compared in tests/distributed/test_lm_eval_mesh.py),
so this file isolates what MeshLM itself does: tokenizing, windowing, batching, slicing the
continuation's log-probs, stopping and cutting generations. Claims, on the local tasks of
tests/lm_eval_tasks.py (multiple choice, generate_until, loglikelihood_rolling with a 24-token
context so documents take several windows), batch 3 against HFLM's batch 1:

* every request's answer equals HFLM's: log-likelihoods within 1e-5 relative + 1e-5 absolute
  (the same float32 model; only the batch shapes differ, so the matmuls may sum in another
  order), is_greedy flags and generations exactly; the results' metrics equal;
* negative control: a stand-in whose logits are shifted one position (the off-by-one slice a
  scorer can make) changes the log-likelihoods past that tolerance.
"""

from __future__ import annotations

import math
import os
import random

import numpy as np
import pytest
import torch

from tests.hf_models import hf_model, llama_config
from tests.lm_eval_tasks import offline_env, write_tasks

pytestmark = pytest.mark.unit

lm_eval = pytest.importorskip("lm_eval")
transformers = pytest.importorskip("transformers")

MAX_LEN = 24
TASKS = ["meshtrain_mc", "meshtrain_gen", "meshtrain_rolling"]
RTOL = ATOL = 1e-5


class HFSession:
    """Tests only: the InferenceSession interface over one transformers model (greedy decoding
    without a cache; stop ids and strings checked after each token)."""

    def __init__(self, model, folder, max_seq_len, shift=0):
        from trainer.data.tokenizer import load_tokenizer

        self.model, self.max_seq_len, self.shift = model, max_seq_len, shift
        self.calls = 0  # logits and generate calls (MeshLM's heartbeat precedes each)
        self.tokenizer = load_tokenizer(os.path.join(folder, "tokenizer.json"))
        self.eos_ids = [self.tokenizer.eos_id]

    @torch.no_grad()
    def logits(self, tokens):
        self.calls += 1
        out = self.model(tokens).logits.float()
        return torch.roll(out, self.shift, dims=1) if self.shift else out

    @torch.no_grad()
    def generate(
        self, prompts, max_new_tokens, temperature, top_p, seed, stop_ids, stop_strings, use_cache=True,
        cut_stop_strings=True,
    ):  # fmt: skip
        assert temperature == 0.0
        assert not (cut_stop_strings and stop_strings), "this stand-in returns completions uncut, as MeshLM asks"
        self.calls += 1
        outs = []
        for prompt in prompts:
            ids, new = list(prompt), []
            for _ in range(max_new_tokens):
                nxt = int(self.model(torch.tensor([ids])).logits[0, -1].argmax())
                ids.append(nxt)
                new.append(nxt)
                text = self.tokenizer.decode(new)
                if nxt in stop_ids or any(s in text for s in stop_strings):
                    break
            outs.append(new)
        return outs


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lm_eval_model")
    os.environ.update(offline_env())
    os.environ["HF_DATASETS_CACHE"] = str(root / "datasets")
    from trainer.data.tokenizer import DEFAULT_TOKENIZER_PATH

    folder = root / "hf"
    model = hf_model(llama_config(num_hidden_layers=2, bos_token_id=0, eos_token_id=1, pad_token_id=2), seed=3)
    model.save_pretrained(folder)
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_file=DEFAULT_TOKENIZER_PATH, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>"
    )
    tok.save_pretrained(folder)
    tasks = write_tasks(root / "tasks")
    return model, str(folder), tasks


def _evaluate(lm, tasks, names=TASKS):
    from trainer.inference.lm_eval_run import evaluate, task_manager

    return evaluate(lm, task_manager(names, tasks), names, log_samples=True, bootstrap_iters=0)


def _answers(results, task):
    return [s["resps"] for s in sorted(results["samples"][task], key=lambda s: s["doc_id"])]


@pytest.fixture(scope="module")
def reference(setup):
    """HFLM's results, and whether lm-eval's run moved torch's global RNG (it seeds it)."""
    from lm_eval.models.huggingface import HFLM

    model, folder, tasks = setup
    hflm = HFLM(pretrained=model, tokenizer=folder, batch_size=1, max_length=MAX_LEN, device="cpu")
    before = torch.get_rng_state()
    results = _evaluate(hflm, tasks)
    return results, not torch.equal(before, torch.get_rng_state())


def _close(a, b):
    return math.isclose(a, b, rel_tol=RTOL, abs_tol=ATOL)


def test_requests_and_metrics_equal_hflm(setup, reference):
    from trainer.inference.eval_during_training import rng_preserved
    from trainer.inference.lm_eval_model import MeshLM

    model, folder, tasks = setup
    reference, moved = reference
    before = (random.getstate(), np.random.get_state()[1].copy(), torch.get_rng_state())
    session, beats = HFSession(model, folder, MAX_LEN), []
    with rng_preserved():  # what the evaluation during training runs in
        ours = _evaluate(MeshLM(session, batch_size=3, heartbeat=lambda: beats.append(1)), tasks)
    assert len(beats) == session.calls > 0  # the watchdog's re-arm before every batch
    assert moved  # negative control: lm-eval seeds torch's RNG (a training run's would move)
    after = (random.getstate(), np.random.get_state()[1], torch.get_rng_state())
    assert before[0] == after[0] and (before[1] == after[1]).all() and torch.equal(before[2], after[2])
    n = 0
    for task in ("meshtrain_mc",):
        for got, want in zip(_answers(ours, task), _answers(reference, task), strict=True):
            for (lp, greedy), (lp_ref, greedy_ref) in zip([r[0] for r in got], [r[0] for r in want], strict=True):
                assert _close(lp, lp_ref) and greedy == greedy_ref, (task, lp, lp_ref)
                n += 1
    for got, want in zip(_answers(ours, "meshtrain_rolling"), _answers(reference, "meshtrain_rolling"), strict=True):
        assert _close(got[0][0], want[0][0]), (got, want)
    assert _answers(ours, "meshtrain_gen") == _answers(reference, "meshtrain_gen")
    assert n == sum(3 if i != 1 and i != 5 else 4 for i in range(6))
    for task in TASKS:
        mine, theirs = ours["results"][task], reference["results"][task]
        for key, value in theirs.items():
            if isinstance(value, float) and "stderr" not in key:
                assert _close(mine[key], value), (task, key, mine[key], value)


def test_shifted_logits_fail(setup, reference):
    """Negative control: logits one position off move the answers out of the tolerance."""
    from trainer.inference.lm_eval_model import MeshLM

    model, folder, tasks = setup
    reference = reference[0]
    bad = _evaluate(MeshLM(HFSession(model, folder, MAX_LEN, shift=1), batch_size=3), tasks, ["meshtrain_mc"])
    got = [r[0][0] for a in _answers(bad, "meshtrain_mc") for r in a]
    want = [r[0][0] for a in _answers(reference, "meshtrain_mc") for r in a]
    assert not all(_close(g, w) for g, w in zip(got, want, strict=True))


def test_unknown_task_and_bad_task_file(setup, tmp_path, monkeypatch):
    """One line each (ValueError: exit 2 in scripts/eval.py): a name lm-eval's TaskManager does
    not know, looked up after the include path in lm-eval's built-in index too (here the index
    of the include path alone, the built-in one costing seconds: the same TaskManager call);
    a task YAML that does not parse (lm-eval itself would skip the file silently)."""
    import lm_eval.tasks

    from trainer.inference.lm_eval_run import task_manager

    real = lm_eval.tasks.TaskManager
    monkeypatch.setattr(lm_eval.tasks, "TaskManager", lambda **kw: real(**{**kw, "include_defaults": False}))
    tasks = setup[2]
    assert "meshtrain_mc" in task_manager(["meshtrain_mc"], tasks).all_tasks
    with pytest.raises(ValueError, match=r"^unknown task 'meshtrain_nope': lm-eval finds no task, group or tag"):
        task_manager(["meshtrain_mc", "meshtrain_nope"], tasks)
    (tmp_path / "broken.yaml").write_text("task: broken\ndataset_path: json\n  oops: [unclosed\n")
    with pytest.raises(ValueError, match=r"broken.yaml does not parse as YAML \(line 3, column 7\)"):
        task_manager(["broken"], str(tmp_path))
    with pytest.raises(ValueError, match=r"--include_path .*nowhere does not exist"):
        task_manager(["broken"], str(tmp_path / "nowhere"))


@pytest.mark.parametrize(
    "args, message",
    [
        (["--eval.interval", "0"], r"eval.interval must be >= 1"),
        (["--eval.limit", "-1"], r"eval.limit must be >= 0"),
        (["--eval.num_fewshot", "-2"], r"eval.num_fewshot must be >= 0, or -1"),
        (["--eval.batch_size", "0"], r"eval.batch_size and eval.max_gen_toks must be >= 1"),
        (["--comm.mode", "fake_backend", "--comm.fake_world_size", "2"], r"a simulated run .* does not run lm-eval"),
    ],
)
def test_eval_section_checks(args, message):
    """[eval] (trainer/config/eval_section.py): one line per value a run could not use; no
    check at all while eval.tasks is empty (the default: off)."""
    from trainer.config import ConfigError, load_config

    cfg = load_config(["--config", "llama3.toml", "--eval.tasks", "a,b", "--eval.interval", "3"])
    assert cfg.eval.tasks == ["a", "b"] and cfg.eval.interval == 3 and cfg.eval.num_fewshot == -1
    load_config(["--config", "llama3.toml", *args])  # off: nothing checked
    with pytest.raises(ConfigError, match=message):
        load_config(["--config", "llama3.toml", "--eval.tasks", "a", *args])


def _bos_tokenizer_folder(folder):
    """The shipped BPE with a post-processor that starts every text with <|bos|> (as Llama 3's
    tokenizer.json starts it with <|begin_of_text|>)."""
    from tokenizers import Tokenizer, processors

    from trainer.data.tokenizer import DEFAULT_TOKENIZER_PATH

    tok = Tokenizer.from_file(DEFAULT_TOKENIZER_PATH)
    tok.post_processor = processors.TemplateProcessing(single="<|bos|> $A", special_tokens=[("<|bos|>", 0)])
    os.makedirs(folder, exist_ok=True)
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        f.write('{"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|bos|>", "eos_token": "<|eos|>"}')
    return str(folder)


@pytest.mark.parametrize("style", ["bos_post_processor", "qwen3"])
def test_tokenization_equals_hflm(setup, tmp_path, style):
    """MeshLM encodes contexts and continuations as HFLM does on the same tokenizer folder: a
    post-processor's BOS added (not by the trainer's own encode), special-token text parsed, no
    BOS again where the text starts with it; the prefix token of an empty context the BOS, or
    the EOS where tokenizer_config.json has no BOS (Qwen)."""
    from lm_eval.models.huggingface import HFLM

    from tests.chat_data import tokenizer_folder
    from trainer.inference.lm_eval_model import MeshLM

    model = setup[0]
    folder = _bos_tokenizer_folder(tmp_path) if style != "qwen3" else tokenizer_folder(tmp_path, "qwen3")
    ours = MeshLM(HFSession(model, folder, MAX_LEN))
    theirs = HFLM(pretrained=model, tokenizer=folder, batch_size=1, max_length=MAX_LEN, device="cpu")
    assert ours.prefix_token_id == theirs.prefix_token_id
    texts = ["Hello world", " spaced out", "<|bos|>Already", "a <|im_end|> b", "x\n\ny"]
    for text in texts:
        assert ours.tok_encode(text) == theirs.tok_encode(text), text
        assert ours.tok_encode(text, add_special_tokens=False) == theirs.tok_encode(text, add_special_tokens=False)
    for context, continuation in [("Question: sky?\nAnswer:", " blue"), ("The end ", "now")]:
        assert ours._encode_pair(context, continuation) == theirs._encode_pair(context, continuation)
    if style != "qwen3":  # the negative control: the trainer's own encode adds no BOS
        assert ours.tok_encode("Hello world")[0] == 0 != ours.tokenizer.encode("Hello world")[0]
