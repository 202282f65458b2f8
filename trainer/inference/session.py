"""A model on the training mesh that scores and generates: :class:`InferenceSession`.

Two ways to get one:

* :meth:`InferenceSession.from_checkpoint` (scripts): the trainer builds the model from the
  config's ``[parallelism]`` (the same ParallelDims, parallelize and materialize as training:
  tp, fsdp, their product; pp and cp refused in one line) and loads a DCP step folder (LoRA:
  base + adapters) or a Hugging Face folder (``trainer/inference/loading.py``);
* :meth:`InferenceSession.from_live` (evaluation during training): over the trainer's own model
  parts, no copy of the weights. Every call leaves the model as it found it: each module's
  train/eval mode, the global RNG states (CPU and CUDA), the MoE layers' routing counters and
  auxiliary-loss accumulators; it runs under ``torch.no_grad``.

Every rank calls every method with the same arguments (the forward is collective) and gets the
same answer: :meth:`logits` returns the full vocabulary in float32 on every rank (gathered
from the tensor-parallel shards), and decoding draws from generators seeded by the caller's
``seed``, never by the rank (``trainer/inference/decoding.py``).

Generation (:meth:`generate`): prompts of equal length run as one batch (rows of different
lengths never share a forward, so there is no padding mask: each row computes exactly what it
would alone), the batches one after the other. With the KV cache (``use_cache``, the default,
``trainer/inference/kv_cache.py``) the prompt runs once and each new token is one forward of one
position; without it each new token runs the training forward over the whole sequence. Under
sequence parallelism (tp > 1) a forward's length must divide over tp: filler tokens after the
real ones make it so, outside the causal view of every real token.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from trainer.config import ConfigError
from trainer.inference.decoding import StopRules, check_sampling, next_token, prompt_generator
from trainer.inference.kv_cache import KVCache
from trainer.inference.loading import build_from_checkpoint, eos_ids_of, refuse_layout

__all__ = ["InferenceSession"]


class InferenceSession:
    """Scores and generates with one model held on the mesh (see the module docstring).

    ``tokenizer``: the trainer's tokenizer object; ``max_seq_len``: the longest context (the
    model's RoPE table); ``eos_ids``: the ids that end a completion (the tokenizer's eos and
    those the checkpoint's generation_config.json / config.json name)."""

    def __init__(
        self,
        model_parts: Sequence[nn.Module],
        tokenizer: Any,
        plan: Any,
        device: torch.device,
        *,
        eos_ids: Sequence[int],
        cfg: Any = None,
    ) -> None:
        refuse_layout(plan.parallel_dims)
        if len(model_parts) != 1:
            raise ConfigError(f"generation needs the whole model on each rank, got {len(model_parts)} model parts")
        self.model = model_parts[0]
        self.tokenizer = tokenizer
        self.plan, self.device, self.cfg = plan, device, cfg
        self.max_seq_len = int(plan.model.args.max_seq_len)
        self.vocab_size = int(plan.model.args.vocab_size)
        self.eos_ids = tuple(int(i) for i in eos_ids)
        pd = plan.parallel_dims
        # sequence parallelism shards each forward's tokens over tp
        self.seq_multiple = pd.tp if pd.tp > 1 and plan.parallelize.sequence_parallel else 1
        # tests only: added to the RoPE positions of the tokens decoded after the prompt (the
        # negative control of the cache's positions, kv_cache.py)
        self.position_error = 0
        self._chat = None

    # ------------------------------------------------------------------ constructors
    @classmethod
    def from_checkpoint(cls, cfg: Any, path: str, log=lambda _line: None) -> InferenceSession:
        """The config's model on its layout with the weights at ``path`` (a DCP step folder, a
        checkpoint folder (its newest step) or a Hugging Face folder). Joins the process group
        of the job (torchrun's environment) or makes one of one process."""
        built = build_from_checkpoint(cfg, path, log)
        return cls(
            built.model_parts,
            built.tokenizer,
            built.plan,
            built.device,
            eos_ids=eos_ids_of(built.tokenizer, built.eos_folders),
            cfg=built.cfg,
        )

    @classmethod
    def from_live(
        cls,
        model_parts: Sequence[nn.Module],
        tokenizer: Any,
        plan: Any,
        device: torch.device,
        *,
        eos_ids: Sequence[int] | None = None,
        cfg: Any = None,
    ) -> InferenceSession:
        """A session over a training run's model parts (the Trainer's ``model_parts``,
        ``tokenizer``, ``plan`` and ``device``): no copy; each call restores what it touched."""
        return cls(model_parts, tokenizer, plan, device, eos_ids=eos_ids or (int(tokenizer.eos_id),), cfg=cfg)

    # ------------------------------------------------------------------ the model, left as found
    @contextlib.contextmanager
    def _inference(self) -> Iterator[None]:
        modes = [(m, m.training) for m in self.model.modules()]
        moe_buffers = [(b, b.clone()) for moe in self.model.moe_layers() for b in moe.buffers(recurse=False)]
        cpu_rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
        self.model.eval()
        try:
            with torch.no_grad():
                yield
        finally:
            for module, mode in modes:
                module.training = mode
            with torch.no_grad():
                for buf, saved in moe_buffers:
                    buf.copy_(saved)
            torch.set_rng_state(cpu_rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state_all(cuda_rng)

    def _forward(self, tokens: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
        """float32 logits [b, t, vocab] of ``tokens`` [b, t]: the training forward (no cache) or
        the cached one, padded to the sequence-parallel multiple and gathered over tp."""
        t = tokens.shape[1]
        pad = (-t) % self.seq_multiple
        if pad:
            tokens = torch.cat([tokens, tokens[:, -1:].expand(-1, pad)], dim=1)
        tokens = tokens.to(self.device)
        out = self.model(tokens) if cache is None else self.model(tokens, cache=cache)
        if isinstance(out, DTensor):  # loss parallel: the head's vocabulary shards
            out = out.full_tensor()
        return out[:, :t].float()

    def _check_tokens(self, rows: Sequence[Sequence[int]] | torch.Tensor, what: str, room: int = 0) -> None:
        """Every row non-empty, in the vocabulary, and at most the context less ``room``."""
        for i, row in enumerate(rows):
            n = len(row)
            if n == 0:
                raise ValueError(f"{what} {i} is empty: give at least one token")
            if n > self.max_seq_len - room:
                raise ValueError(
                    f"{what} {i} has {n} tokens, too long for the model's context (max_seq_len {self.max_seq_len}"
                    + (", with room for one new token" if room else "")
                    + "); shorten it"
                )
            low, high = (int(row.min()), int(row.max())) if isinstance(row, torch.Tensor) else (min(row), max(row))
            if low < 0 or high >= self.vocab_size:
                raise ValueError(f"{what} {i} holds token ids outside the vocabulary [0, {self.vocab_size})")

    # ------------------------------------------------------------------ scoring
    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """Next-token logits of every position of ``tokens`` [B, T] (the same on every rank):
        float32 [B, T, vocab] on the CPU, identical on every rank."""
        tokens = torch.as_tensor(tokens, dtype=torch.long)
        if tokens.dim() != 2:
            raise ValueError(f"logits takes token ids [B, T], got shape {tuple(tokens.shape)}")
        self._check_tokens(tokens, "row")
        with self._inference():
            return self._forward(tokens).cpu()

    # ------------------------------------------------------------------ generation
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        seed: int = 0,
        stop_ids: Sequence[int] = (),
        stop_strings: Sequence[str] = (),
        use_cache: bool = True,
        cut_stop_strings: bool = True,
    ) -> list[list[int]]:
        """Each prompt's new tokens (after the stop rules: without the id that ended it, cut
        before a stop string). A completion ends at an id of ``eos_ids`` or ``stop_ids``, at a
        stop string, after ``max_new_tokens``, or at the end of the context. With
        ``cut_stop_strings = False`` a completion still ends at the first token that completes a
        stop string, but is returned whole (for callers that cut the decoded text themselves, as
        lm-eval does: a token holding text on both sides of the stop string is kept)."""
        check_sampling(temperature, top_p)
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        prompts = [[int(t) for t in p] for p in prompts]
        self._check_tokens(prompts, "prompt", room=1 if max_new_tokens > 0 else 0)
        rules = StopRules((*self.eos_ids, *stop_ids), stop_strings, self.tokenizer.decode)
        groups: dict[int, list[int]] = {}
        for i, p in enumerate(prompts):
            groups.setdefault(len(p), []).append(i)
        results: list[list[int]] = [[] for _ in prompts]
        with self._inference():
            for length in sorted(groups):
                idx = groups[length]
                rows = torch.tensor([prompts[i] for i in idx], dtype=torch.long)
                gens = [prompt_generator(seed, i) if temperature > 0 else None for i in idx]
                budget = min(max_new_tokens, self.max_seq_len - length)
                for i, out in zip(idx, self._generate_rows(rows, budget, temperature, top_p, gens, rules, use_cache)):
                    results[i] = rules.trim(out, cut=cut_stop_strings)
        return results

    def _generate_rows(
        self,
        rows: torch.Tensor,
        budget: int,
        temperature: float,
        top_p: float,
        gens: list[torch.Generator | None],
        rules: StopRules,
        use_cache: bool,
    ) -> list[list[int]]:
        """The new tokens of prompts of one length (``rows`` [b, L]), at most ``budget`` each."""
        b, length = rows.shape
        new: list[list[int]] = [[] for _ in range(b)]
        if budget <= 0:
            return new
        done = [False] * b
        cache = None
        if use_cache:
            capacity = length + budget + self.seq_multiple
            cache = KVCache(capacity, self.max_seq_len - 1, position_error=self.position_error)
            logits = self._forward(rows, cache)[:, -1]
            cache.advance(length)
        else:
            seqs = rows
            logits = self._forward(seqs)[:, -1]
        for step in range(budget):
            picks = []
            for r in range(b):
                if done[r]:
                    picks.append(new[r][-1])  # a finished row idles on its last token
                    continue
                token = next_token(logits[r], temperature, top_p, gens[r])
                new[r].append(token)
                done[r] = rules.finished(new[r])
                picks.append(token)
            if all(done) or step == budget - 1:
                break
            nxt = torch.tensor(picks, dtype=torch.long)[:, None]
            if cache is not None:
                logits = self._forward(nxt, cache)[:, -1]
                cache.advance(1)
            else:
                seqs = torch.cat([seqs, nxt], dim=1)
                logits = self._forward(seqs)[:, -1]
        return new

    # ------------------------------------------------------------------ chat
    def render_chat(self, messages: list[dict[str, Any]]) -> list[int]:
        """The token ids of ``messages`` rendered by the model's chat template
        (``trainer/data/chat_template.py``: the tokenizer folder's, or the built-in one of the
        shipped tokenizer) with the generation prompt after them: the prompt of the next
        assistant turn."""
        from trainer.data.chat_template import check_messages, load_chat_template
        from trainer.data.tokenizer import DEFAULT_TOKENIZER_PATH

        if self._chat is None:
            self._chat = load_chat_template(self.tokenizer, DEFAULT_TOKENIZER_PATH)
        check_messages(messages)
        text = self._chat.render(messages, add_generation_prompt=True)
        ids, _offsets = self.tokenizer.encode_chat(text)
        return list(ids)
