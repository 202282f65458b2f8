"""lm-evaluation-harness's ``LM`` over an :class:`~trainer.inference.session.InferenceSession`:
the model sharded on the training mesh answers lm-eval's three request types.

* ``loglikelihood``: lm-eval's own ``TemplateLM`` tokenizes each (context, continuation) pair
  (trailing context spaces moved to the continuation, the whole string encoded and split; an
  empty context conditioned on the prefix token), as its ``HFLM`` does, with the text encoded
  as transformers encodes it (the tokenizer.json's post-processor, e.g. Llama 3's BOS; special
  text parsed), not as the trainer encodes documents; this class scores the
  pairs: the input is ``(context + continuation)[-(max_seq_len + 1):][:-1]``, right-padded in a
  batch (a causal model's earlier positions never see the padding), the answer the float32 sum
  of the continuation's log-probabilities and whether every continuation token is the argmax.
* ``loglikelihood_rolling``: the disjoint windows of ``max_seq_len`` tokens lm-eval's
  ``get_rolling_token_windows`` / ``make_disjoint_window`` cut (the first conditioned on the
  prefix token), scored as above and summed per document.
* ``generate_until``: requests grouped by their generation arguments (lm-eval's ``Collator``),
  the context left-truncated to ``max_seq_len - max_gen_toks``, ``session.generate`` with the
  model's eos ids as stops; the continuation decoded without special tokens and cut at the
  first ``until`` string (plus the eos text, as HFLM adds it) by lm-eval's
  ``postprocess_generated_text``. ``session.generate`` gets the stop strings so a completion
  ends at the first token that completes one (as HFLM's stopping criteria end it), with
  ``cut_stop_strings = False``: its own cut would leave out a token that holds text on both
  sides of the stop (``".\n"`` under ``until: ["\n"]``), where HFLM keeps the text before it;
  the cut is lm-eval's, on the text.

Every rank runs every request (the model is sharded: every rank must take part in each forward,
with the same tokens), so lm-eval sees one process (``rank`` 0, ``world_size`` 1) on every rank
and does not split the requests; the caller lets rank 0 alone write the results.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from lm_eval.api.model import TemplateLM
from lm_eval.models.utils import Collator, handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

__all__ = ["MeshLM", "score_requests"]

DEFAULT_MAX_GEN_TOKS = 256  # HFLM's max_gen_toks
DEFAULT_GENERATION_SEED = 1234  # lm-eval's default seeds (a sampled task is reproducible)


def score_requests(
    logits_fn: Callable[[torch.Tensor], torch.Tensor],
    requests: list[tuple[list[int], list[int]]],
    max_seq_len: int,
    batch_size: int,
) -> list[tuple[float, bool]]:
    """(sum of the continuation's log-probs, is greedy) for each (context ids, continuation ids),
    in the order given: longest first in batches of ``batch_size`` (one shape per batch)."""
    order = sorted(range(len(requests)), key=lambda i: -len(requests[i][0]) - len(requests[i][1]))
    out: list[tuple[float, bool] | None] = [None] * len(requests)
    for start in range(0, len(order), max(1, batch_size)):
        chunk = order[start : start + max(1, batch_size)]
        inputs, spans = [], []
        for i in chunk:
            ctx, cont = requests[i]
            if not ctx or not cont:
                raise ValueError("a loglikelihood request needs a context and a continuation of at least one token")
            if len(cont) > max_seq_len:
                raise ValueError(f"a continuation of {len(cont)} tokens is longer than the context ({max_seq_len})")
            inp = (ctx + cont)[-(max_seq_len + 1) :][:-1]
            inputs.append(inp)
            spans.append((len(inp), cont))
        width = max(len(x) for x in inputs)
        tokens = torch.zeros(len(inputs), width, dtype=torch.long)
        for row, inp in enumerate(inputs):
            tokens[row, : len(inp)] = torch.tensor(inp, dtype=torch.long)
        logprobs = F.log_softmax(logits_fn(tokens).float(), dim=-1)
        for row, (i, (inplen, cont)) in enumerate(zip(chunk, spans, strict=True)):
            picked = logprobs[row, inplen - len(cont) : inplen]  # the positions that predict the continuation
            target = torch.tensor(cont, dtype=torch.long)
            greedy = bool((picked.argmax(dim=-1) == target).all())
            out[i] = (float(picked.gather(-1, target[:, None]).sum()), greedy)
    return out  # type: ignore[return-value]


class MeshLM(TemplateLM):
    """lm-eval's model interface over an inference session (the model on the training mesh).

    ``session`` needs ``tokenizer`` (trainer/data/tokenizer.py: ``encode``/``decode``,
    ``bos_id``/``eos_id``), ``max_seq_len``, ``eos_ids``, ``logits(tokens [B, T]) -> [B, T, V]``
    (float32, the same on every rank) and ``generate(prompts, ...)`` (the new tokens of each
    prompt). ``batch_size``: requests per forward; ``max_gen_toks``: a generation task's default
    length (HFLM's 256); ``heartbeat``: called before each batch's forward or generation (the
    evaluation during training re-arms the step watchdog with it, so the limit holds per batch,
    not for a whole benchmark)."""

    def __init__(
        self,
        session: Any,
        batch_size: int = 1,
        max_gen_toks: int = DEFAULT_MAX_GEN_TOKS,
        seed: int = DEFAULT_GENERATION_SEED,
        heartbeat: Callable[[], None] | None = None,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.session = session
        self.tokenizer = session.tokenizer
        self.batch_size = batch_size
        self.max_gen_toks = max_gen_toks
        self.seed = seed
        self._rank, self._world_size = 0, 1  # every rank answers every request (the docstring)
        self._device = torch.device("cpu")
        self._special_ids = _special_ids(self.tokenizer)
        self._hf_encoder, self._prefix = _hf_encoder(self.tokenizer)
        self._heartbeat = heartbeat or (lambda: None)

    # ---------------------------------------------------------------- tokens
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self._prefix if self._prefix is not None else self.eot_token_id

    @property
    def max_length(self) -> int:
        return int(self.session.max_seq_len)

    @property
    def tokenizer_name(self) -> str:
        return str(getattr(self.tokenizer, "path", type(self.tokenizer).__name__)).replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """As HFLM encodes (``_hf_encoder``): the tokenizer's own special tokens (a Llama 3
        tokenizer.json's BOS) unless ``add_special_tokens`` is False or the text already starts
        with the prefix token's text; special-token text parsed as the special id."""
        if self._hf_encoder is None:  # tiktoken or bytes: no post-processor, no special parsing
            return self.tokenizer.encode(string)
        add = add_special_tokens is not False
        if add_special_tokens is None and string.startswith(self.tokenizer.decode([self.prefix_token_id])):
            add = False
        return self._hf_encoder.encode(string, add_special_tokens=add).ids

    def tok_decode(self, tokens: list[int]) -> str:
        """Text without special tokens (HFLM decodes a generation with ``skip_special_tokens``)."""
        return self.tokenizer.decode([t for t in tokens if t not in self._special_ids])

    # ---------------------------------------------------------------- loglikelihood
    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        pairs = [(list(ctx), list(cont)) for _, ctx, cont in requests]
        answers = score_requests(self._logits, pairs, self.max_length, self.batch_size)
        for (request, _, _), answer in zip(requests, answers, strict=True):
            if request is not None:
                self.cache_hook.add_partial("loglikelihood", request, answer)
        return answers

    def _logits(self, tokens: torch.Tensor) -> torch.Tensor:
        self._heartbeat()
        return self.session.logits(tokens)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owner = [], []
        for index, (string,) in enumerate(req.args for req in requests):
            for ctx, cont in map(
                make_disjoint_window,
                get_rolling_token_windows(
                    token_list=self.tok_encode(string),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length,
                    context_len=1,
                ),
            ):
                windows.append((None, ctx, cont))
                owner.append(index)
        scores = self._loglikelihood_tokens(windows) if windows else []
        totals = [0.0] * len(requests)
        for index, (logprob, _) in zip(owner, scores, strict=True):
            totals[index] += logprob
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # ---------------------------------------------------------------- generation
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        args = [req.args for req in requests]
        collator = Collator(args, sort_fn=lambda x: (-len(self.tok_encode(x[0])), x[0]), group_by="gen_kwargs")
        eos_text = self.tokenizer.decode([self.eot_token_id])
        results = []
        for chunk in collator.get_batched(n=self.batch_size):
            contexts, all_kwargs = zip(*chunk, strict=True)
            kwargs = normalize_gen_kwargs(all_kwargs[0], self.max_gen_toks)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
            max_gen_toks = int(kwargs.pop("max_gen_toks"))
            max_ctx_len = self.max_length - max_gen_toks
            if max_ctx_len <= 0:
                raise ValueError(
                    f"a generation task asks for max_gen_toks = {max_gen_toks} new tokens, not less than the "
                    f"model's context ({self.max_length}); lower the task's generation_kwargs.max_gen_toks"
                )
            sample = bool(kwargs.get("do_sample")) and float(kwargs.get("temperature", 0.0)) > 0.0
            prompts = [self.tok_encode(c)[-max_ctx_len:] for c in contexts]
            self._heartbeat()
            outputs = self.session.generate(
                prompts,
                max_new_tokens=max_gen_toks,
                temperature=float(kwargs.get("temperature", 0.0)) if sample else 0.0,
                top_p=float(kwargs.get("top_p", 1.0)) if sample else 1.0,
                seed=self.seed,
                stop_ids=list(self.session.eos_ids),
                stop_strings=until,  # ends the completion early; the cut is lm-eval's, below
                cut_stop_strings=False,
            )
            for context, gen_kwargs, new_tokens in zip(contexts, all_kwargs, outputs, strict=True):
                text = postprocess_generated_text(self.tok_decode(list(new_tokens)), until, None)
                results.append(text)
                self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
        return collator.get_original(results)


def _hf_encoder(tokenizer: Any) -> tuple[Any, int | None]:
    """(a ``tokenizers.Tokenizer`` of the same tokenizer.json, encoding as transformers' fast
    tokenizer does: its post-processor adds the special tokens it names, special-token text
    becomes the special id; the prefix token HFLM conditions an empty context on: the BOS that
    tokenizer_config.json or special_tokens_map.json names, None without one (Qwen's), where
    HFLM takes the EOS; a folder with neither file (the shipped tokenizer) has the trainer's BOS,
    which its Hugging Face exports name). The trainer's own ``encode`` does neither (documents
    are data there), and it finds a BOS by name where transformers has none."""
    import json
    import os

    path = getattr(tokenizer, "path", "")
    if not (isinstance(path, str) and path.endswith(".json") and os.path.isfile(path)):
        return None, getattr(tokenizer, "bos_id", None)
    from tokenizers import Tokenizer

    encoder = Tokenizer.from_file(path)
    configs = [os.path.join(os.path.dirname(path), n) for n in ("tokenizer_config.json", "special_tokens_map.json")]
    configs = [c for c in configs if os.path.isfile(c)]
    if not configs:  # the shipped tokenizer: its exports name the trainer's BOS (checkpoint/hf_extras.py)
        return encoder, getattr(tokenizer, "bos_id", None)
    bos = None
    for config in configs:
        with open(config, encoding="utf-8") as f:
            value = json.load(f).get("bos_token")
        value = value.get("content") if isinstance(value, dict) else value
        if bos is None and isinstance(value, str):
            bos = encoder.token_to_id(value)
    return encoder, bos


def _special_ids(tokenizer: Any) -> set[int]:
    """The ids of the tokenizer's special tokens (a generation's text leaves them out)."""
    ids = {getattr(tokenizer, name, None) for name in ("bos_id", "eos_id", "pad_id")}
    texts = tokenizer.special_token_texts() if hasattr(tokenizer, "special_token_texts") else []
    if texts and hasattr(tokenizer, "encode_chat"):  # special text parsed as the special id
        for text in texts:
            parsed = tokenizer.encode_chat(text)[0]
            if len(parsed) == 1:
                ids.add(parsed[0])
    return {i for i in ids if i is not None}
