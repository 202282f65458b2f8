"""The layout planner: every valid layout of a model on a cluster, ranked by estimated tokens/s
per GPU within the GPU's memory (``python -m tools.planner``).

Modules: :mod:`.inventory` (parameters and their real sharding), :mod:`.activations`
(activation memory from the model code), :mod:`.choice` (a layout choice and the stages, micro-
batches and recomputed blocks it means for a rank), :mod:`.collectives` (the collectives a step
issues: the prediction API the measured communication is checked against, with
:mod:`.param_groups` and :mod:`.schedule_order`), :mod:`.compute` (matmul FLOPs per rank),
:mod:`.hardware` (GPU table, ring cost model), :mod:`.estimate` (memory and time of one layout),
:mod:`.search` (enumeration and ranking), :mod:`.fit` (``--fit``: the memory options priced, the
cheapest layout + options that fits; :mod:`.fit_cli` its output), :mod:`.cli`, :mod:`.measure`
(what the estimates are checked against).
"""

from tools.planner.choice import LayoutChoice
from tools.planner.collectives import predict_collectives
from tools.planner.estimate import Job, estimate
from tools.planner.search import plan_layouts

__all__ = ["Job", "LayoutChoice", "estimate", "plan_layouts", "predict_collectives"]
