"""CPU offload's predicted saving (models/parallel/offload.py ``cpu_offload_bytes``) against the
real sharded model: one rank of a layout built with the real code on the fake backend, FSDP2 under
``CPUOffloadPolicy``, one forward/backward and one AdamW step
(``tools.planner.measure.measure_training_state``), whose distinct storages behind the
parameters, the gradients and the AdamW moments are exactly what the offload keeps on the host.
Cases: llama3 debugmodel on dp_shard=3, rank 2 (FSDP2 pads dim 0 to a multiple of 3: the vocab
2048 and the dims 256 / 768 are not), and tp=2 x fsdp=2, rank 3 (DTensor shards over two mesh
dimensions). Negative control: the unpadded local elements miss the padding on dp_shard=3.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

CASES = [({"dp_shard": 3, "world_size": 3}, 2), ({"dp_shard": 2, "tp": 2, "world_size": 4}, 3)]


def test_cpu_offload_bytes_are_the_offloaded_storages():
    from tests.distributed.run_json import run_on_own_process

    def measure(case):
        degrees, rank = case
        return run_on_own_process(
            "tools.planner.measure:measure_training_state", "llama3", "debugmodel", degrees, rank, cpu_offload=True
        )

    with ThreadPoolExecutor(2) as pool:
        measured = list(pool.map(measure, CASES))
    for case, got in zip(CASES, measured, strict=True):
        pred = got["cpu_offload_bytes"]
        assert (pred["params"], pred["grads"], pred["optimizer"]) == (
            got["params_bytes"],
            got["grads_bytes"],
            got["optimizer_bytes"],
        ), (case, got)
        assert pred["total"] == pred["params"] + pred["grads"] + pred["optimizer"]
    # negative control: 2.6M parameters over 3 ranks without FSDP2's dim-0 padding is less
    unpadded = 4 * 2_622_720 // 3
    assert measured[0]["params_bytes"] > unpadded
