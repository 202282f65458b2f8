"""Every memory option of issue 53 on one job, in one run (``make bench`` section
``memory_options``; also ``python -m benchmarks.run --only memory_options --out
bench_results/memory_options.json``): the device-resident peak of one training step per option,
and the planner's prediction of it beside the measurement.

The job: the llama3 debug model with Qwen3's 151,936-token vocabulary (``SHAPE``: 4 blocks, width 64),
rank 0 of fsdp=2 on torch's fake backend (the real FSDP2 wrapping, hence CPU offload's
policy; collectives move no data, so values are garbage but every tensor has its real shape,
dtype and storage), float32, one sequence of ``SEQ`` = 256 tokens per rank, AdamW (the trainer's
``build_optimizer``), one thread. Per option: a fresh model and optimizer, one warm-up step (so
the optimizer state exists), then one measured step (zero_grad, forward, loss, backward,
optimizer step) under a census of live tensor storages (``tools/tensor_census.py``'s method,
with an event log so that storages can be classed afterwards).

What is measured, ``peak_MiB``: the most bytes resident on the *device* at once during the
measured step = the training state present before the step (parameters' shards, optimizer
state) unless an offload keeps it on the host, plus the peak of the storages the step
allocates, leaving out what an option keeps in host memory. A storage resized to 0 bytes in
place (FSDP2's reshard of gathered parameters autograd still views) is released before the
next allocation of 1 MiB or more or the next phase mark (below), whichever comes first. On this CPU host device and host are the same memory, so the classing is
by storage:

- ``training.cpu_offload``: FSDP2's CPUOffloadPolicy keeps the parameter shards, their
  gradient shards and the optimizer state on the host; those storages (the gradient shards
  identified as the ones behind ``p.grad`` after the step) are left out. Not counted: the
  transient device copy of one unit's shard before its all-gather and of one gradient shard
  before its host copy (on CPU these copies are no-ops).
- ``activation_checkpoint.offload``: the hooks run with a real host copy (``copy=True``), the
  host copies are left out, and the copy back in the backward is a fresh (device) allocation
  as on a GPU (on CPU torch's ``.to`` to the same device returns the host tensor itself).
  Measured with full AC and without AC; per-op selective AC with offload is not in the table
  (its kept outputs are freed by resizing their storage in place, which a census of
  allocations does not see).
- ``optimizer.state_dtype = "bfloat16"``: nothing to class; the moments are half the bytes.

``predicted_MiB``: the planner's memory model of the same job
(``tools.planner.fit.option_memory``, what ``--fit`` prices: ``memory_for_rank`` with the
option applied), its total and its saving against the plain row; ``saving_residual`` the
predicted saving's relative error against the measured one.

Phases: the measured step is marked where it enters the forward, the loss backward, the head's
backward (the logits' gradient exists), the blocks' backward (the head input's gradient exists)
and the optimizer step; ``phases_MiB`` is the census's peak within each (the state resident
throughout included), ``peak_phase`` the largest, beside the planner's phases
(``tools/planner/phases.py``: loss, backward, optimizer).
"""

from __future__ import annotations

import json
import sys
import time
import weakref

SHAPE = {"n_layers": 4, "dim": 64, "n_heads": 4, "n_kv_heads": 2, "vocab_size": 151_936}
SEQ, FSDP, CHUNK = 256, 2, 128
SWEEP_BYTES = 2**20  # EventCensus looks for storages resized to nothing before allocations this large
# (row name, config, ParallelizeOptions fields, optimizer.state_dtype, planner options)
OPTIONS = [
    ("plain", "", {}, "float32", ()),
    ("loss_chunk_tokens", f"training.loss_chunk_tokens = {CHUNK}", {"chunked_head": True}, "float32",
     ("loss_chunk_tokens",)),
    ("ac full", 'activation_checkpoint.mode = "full"', {"ac_mode": "full"}, "float32", ()),
    ("ac selective op", 'activation_checkpoint.mode = "selective"', {"ac_mode": "selective"}, "float32", ()),
    ("ac full + offload", "activation_checkpoint.offload = true (mode full)", {"ac_mode": "full", "ac_offload": True},
     "float32", ("activation_offload",)),
    ("no ac + offload", "activation_checkpoint.offload = true (mode none)", {"ac_offload": True}, "float32",
     ("activation_offload",)),
    ("cpu_offload", "training.cpu_offload = true", {"cpu_offload": True}, "float32", ("cpu_offload",)),
    ("bf16 state", 'optimizer.state_dtype = "bfloat16"', {}, "bfloat16", ("state_dtype",)),
]  # fmt: skip


class EventCensus:
    """``tools.tensor_census.TensorCensus``'s bookkeeping with a log: every storage the code
    allocates gets a token; ``events`` holds ``(token, +bytes)`` at its first sight and
    ``(token, -bytes)`` when its last tensor dies, so the peak can be recomputed without some
    storages (:meth:`peak_without`). ``host`` (a flag): storages first seen while it is set are
    host memory (never in the device peak)."""

    def __new__(cls):
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in tree_flatten(out)[0]:
                    if hasattr(t, "untyped_storage"):
                        census._track(t)
                return out

        census = super().__new__(cls)
        census.mode = _Mode()
        return census

    def __init__(self) -> None:
        self.events: list[tuple[int, int]] = []
        self.host_tokens: set[int] = set()
        self.host = False
        self.marks: list[tuple[int, str]] = []  # (events so far, the phase starting there)
        self._live: dict[int, list] = {}  # storage (_cdata) -> [token, tensors alive, bytes, a tensor (weakref)]
        self._next = 0

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        return self.mode.__exit__(*exc)

    def _release(self, ptr: int, token: int) -> None:
        entry = self._live.get(ptr)
        if entry is None or entry[0] != token:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.events.append((token, -entry[2]))
            del self._live[ptr]

    def _track(self, t) -> None:
        t = getattr(t, "_local_tensor", t)  # a DTensor: its local shard holds the memory
        if t.device.type == "meta":
            return
        storage = t.untyped_storage()
        # keyed by the storage itself, not its address: a storage resized away frees its address
        # for a new one while its tensors live
        ptr, nbytes = storage._cdata, storage.nbytes()
        if nbytes == 0:
            return
        entry = self._live.get(ptr)
        if entry is None:
            if nbytes >= SWEEP_BYTES:  # a peak rises at an allocation: none counts a freed storage
                self._sweep()
            self._next += 1
            entry = self._live[ptr] = [self._next, 0, nbytes, weakref.ref(t)]
            self.events.append((self._next, nbytes))
            if self.host:
                self.host_tokens.add(self._next)
        entry[1] += 1
        weakref.finalize(t, self._release, ptr, entry[0])

    def token_of(self, t) -> int | None:
        """The token of the live storage behind ``t`` (None: not allocated under the census)."""
        entry = self._live.get(t.untyped_storage()._cdata)
        return entry[0] if entry else None

    def peak_without(self, tokens: set[int]) -> int:
        live = peak = 0
        for token, delta in self.events:
            if token not in tokens:
                live += delta
                peak = max(peak, live)
        return peak

    def _sweep(self) -> None:
        """Release the storages resized to 0 bytes in place while their tensors live (FSDP2
        frees a resharded group's gathered parameters so; autograd may still hold views of
        them): a census of allocations sees no ``resize_``, so it looks for them before every
        allocation of ``SWEEP_BYTES`` or more and at every mark."""
        for ptr, (token, _n, nbytes, ref) in list(self._live.items()):
            t = ref()
            if t is not None and t.untyped_storage().nbytes() == 0:
                self.events.append((token, -nbytes))
                del self._live[ptr]

    def mark(self, phase: str) -> None:
        """The events from here on belong to ``phase`` (until the next mark)."""
        self._sweep()
        self.marks.append((len(self.events), phase))

    def phase_peaks(self, tokens: set[int]) -> dict[str, int]:
        """:meth:`peak_without` within each marked phase (what is live when it starts counts)."""
        starts = dict(self.marks)
        live, phase, out = 0, None, {}
        for i, (token, delta) in enumerate(self.events):
            if i in starts:
                phase = starts[i]
                out[phase] = max(out.get(phase, 0), live)
            if token not in tokens:
                live += delta
            if phase is not None:
                out[phase] = max(out.get(phase, 0), live)
        return out


def _storages(tensors) -> dict[int, int]:
    out = {}
    for t in tensors:
        local = t._local_tensor if hasattr(t, "_local_tensor") else t
        s = local.untyped_storage()
        out[s.data_ptr()] = s.nbytes()
    return out


def _locals(tensors):
    return [t._local_tensor if hasattr(t, "_local_tensor") else t for t in tensors]


def _host_copies(census: EventCensus):
    """Activation offload with real host copies, measured as a GPU would hold them: the host
    copy made in the forward is host memory, the copy back in the backward a device allocation."""
    from contextlib import contextmanager

    from models.parallel import activation_offload as ao

    @contextmanager
    def patched():
        init, get = ao._Storage.__init__, ao._Storage.get

        def host_init(self, t, copy):
            census.host = True
            try:
                init(self, t, copy)
            finally:
                census.host = False

        def device_get(self):
            if self.restored is None:
                self.restored = self.host.clone()  # the device copy (a fresh allocation)
            return self.restored

        ao._Storage.__init__, ao._Storage.get = host_init, device_get
        try:
            yield
        finally:
            ao._Storage.__init__, ao._Storage.get = init, get

    return patched()


def measure(opts: dict, state_dtype: str) -> dict:
    """One option on rank 0 of fsdp=2 (fake backend): the measured step's device peak."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from models.parallel.activation_offload import model_offloads
    from models.parallelize import ParallelizeOptions
    from models.registry import build_model, get_model_spec
    from parallel_dims import ParallelDims
    from parallel_dims.process_groups import register_fake_backend
    from tools.planner.measure import forget_sharding_caches
    from trainer.config import Optimizer
    from trainer.forward import cross_entropy_sum, token_loss_sum
    from trainer.optim.optimizers import build_optimizer

    register_fake_backend()
    forget_sharding_caches()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=FSDP)
    try:
        pd = ParallelDims(dp_replicate=1, dp_shard=FSDP, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=FSDP)
        pd.build_mesh("cpu")
        spec = get_model_spec("llama3", "debugmodel")
        model = build_model("llama3", "debugmodel", device="meta", max_seq_len=SEQ, **SHAPE)
        spec.parallelize_fn(model, pd, ParallelizeOptions(**opts))
        model.to_empty(device="cpu")
        model.init_weights(0)
        chunk = CHUNK if opts.get("chunked_head") else 0
        model.loss_chunk_tokens = chunk
        for offload in model_offloads([model]):
            offload.copy = True
        optimizer = build_optimizer([model], Optimizer(name="AdamW", lr=1e-4, state_dtype=state_dtype))
        g = torch.Generator().manual_seed(1)
        inputs = torch.randint(0, SHAPE["vocab_size"], (1, SEQ), generator=g)
        labels = torch.randint(0, SHAPE["vocab_size"], (1, SEQ), generator=g)

        mark = [lambda phase: None]  # the census's, while it runs

        def head_input_hook(_module, _args, out):  # its gradient: the head's backward is done
            if out.requires_grad:
                out.register_hook(lambda grad: mark[0]("blocks backward"))

        model.norm.register_forward_hook(head_input_hook)

        def step():  # as trainer/forward.py runs it: the logits held until the backward returns
            optimizer.zero_grad()
            mark[0]("forward")
            logits = model(inputs, labels=labels) if chunk else model(inputs)
            loss = (token_loss_sum if chunk else cross_entropy_sum)(logits, labels) / labels.numel()
            mark[0]("loss backward")
            if not chunk:  # the logits' gradient: the loss's backward is done, the head's starts
                logits.register_hook(lambda grad: mark[0]("head backward"))
            loss.backward()
            del logits, loss
            mark[0]("optimizer step")
            optimizer.step()

        step()  # warm-up: the optimizer state exists from here on
        params = list(model.parameters())
        states = [v for opt in optimizer.optimizers for s in opt.state.values() for v in s.values()]
        states = [v for v in states if isinstance(v, torch.Tensor)]
        resident = sum(_storages([*params, *states]).values())
        census = EventCensus()
        t0 = time.process_time()
        mark[0] = census.mark
        with census, _host_copies(census):
            step()
        cpu_s = time.process_time() - t0
        host = set(census.host_tokens)
        if opts.get("cpu_offload"):
            host |= {census.token_of(g) for g in _locals([p.grad for p in params if p.grad is not None])} - {None}
            resident = 0
        return {
            "peak_bytes": resident + census.peak_without(host),
            "phase_peaks": {k: resident + v for k, v in census.phase_peaks(host).items()},
            "resident_bytes": resident,
            "state_bytes": sum(_storages(states).values()),
            "step_cpu_s": round(cpu_s, 2),
        }
    finally:
        dist.destroy_process_group()


def planner_job(opts: dict):
    """(degrees, choice, job) of the planner for the measured job with ``opts``'s AC mode."""
    from parallel_dims import ParallelDims
    from tools.planner.choice import LayoutChoice
    from tools.planner.estimate import Job
    from tools.planner.hardware import load_hardware

    d = ParallelDims(dp_replicate=1, dp_shard=FSDP, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=FSDP).degrees
    ac = opts.get("ac_mode", "none")
    choice = LayoutChoice(global_batch=FSDP, local_batch=1, seq_len=SEQ, ac=ac, param_dtype="float32")
    overrides = tuple(sorted({**SHAPE, "max_seq_len": SEQ}.items()))
    job = Job("llama3", "debugmodel", FSDP, 8, SEQ, FSDP, load_hardware("h100"), param_dtype="float32",
              model_overrides=overrides)  # fmt: skip
    return d, choice, job


def predict(opts: dict, options: tuple) -> dict:
    """The planner's memory of the same job and rank with ``options`` on (``--fit``'s pricing:
    the peak phase's terms, ``total`` and each phase's total, bytes)."""
    from tools.planner.fit import option_memory

    d, choice, job = planner_job(opts)
    return option_memory(job, d, choice, 0, options, CHUNK)


def run() -> dict:
    import torch

    from tools.planner.phases import PHASES

    torch.set_num_threads(1)
    rows = []
    plain = plain_pred = None
    t0 = time.process_time()
    for name, config, opts, state_dtype, options in OPTIONS:
        got = measure(opts, state_dtype)
        mem = predict(opts, options)
        pred = mem["total"]
        if plain is None:
            plain, plain_pred = got["peak_bytes"], pred
        phases = got["phase_peaks"]
        saving, predicted_saving = plain - got["peak_bytes"], plain_pred - pred
        row = {
            "option": name,
            "config": config or "(none)",
            "peak_MiB": round(got["peak_bytes"] / 2**20, 2),
            "saving_MiB": round(saving / 2**20, 2),
            "predicted_MiB": round(pred / 2**20, 2),
            "predicted_saving_MiB": round(predicted_saving / 2**20, 2),
            # (predicted - measured) / measured saving; None on the plain row
            "saving_residual": round((predicted_saving - saving) / saving, 4) if saving else None,
            "peak_phase": max(phases, key=lambda k: phases[k]),
            "predicted_peak_phase": PHASES[int(mem["peak_phase"])],
            "phases_MiB": {k: round(v / 2**20, 2) for k, v in phases.items()},
            "predicted_phases_MiB": {k: round(mem[f"phase_{k}"] / 2**20, 2) for k in PHASES},
            "state_MiB": round(got["state_bytes"] / 2**20, 2),
            "step_cpu_s": got["step_cpu_s"],
        }
        rows.append(row)
        print(f"memory_options {json.dumps(row)}", file=sys.stderr)
    return {
        "summary": " ".join(" ".join(__doc__.split("\n\n")[1:4]).split()),
        "shape": {**SHAPE, "seq_len": SEQ, "fsdp": FSDP, "chunk": CHUNK},
        "rows": rows,
        "cpu_s": round(time.process_time() - t0, 1),
    }


if __name__ == "__main__":
    print(json.dumps(run(), indent=1))
