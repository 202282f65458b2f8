"""The layout planner: every valid layout of a model on a cluster, ranked by estimated tokens/s
per GPU within the GPU's memory (``python -m parallel_dims plan``, ``python -m tools.planner``).

Modules: :mod:`.inventory` (parameters and their real sharding), :mod:`.activations`
(activation memory from the model code), :mod:`.collectives` (the collectives a step issues:
the prediction API the measured communication is checked against), :mod:`.hardware` (GPU table,
ring cost model), :mod:`.estimate` (enumeration, memory, time, ranking), :mod:`.cli`,
:mod:`.measure` (what the estimates are checked against).
"""

from tools.planner.collectives import LayoutChoice, predict_collectives
from tools.planner.estimate import Job, estimate, plan_layouts

__all__ = ["Job", "LayoutChoice", "estimate", "plan_layouts", "predict_collectives"]
