"""Real run or simulation: the one place the trainer tells them apart.

run_mode.py     ``RunMode``: the mode of this run (real, ``fake_backend`` or ``local_tensor``),
                one object per mode that answers every question whose answer differs between
                them; the rest of the trainer asks it and never reads ``comm.mode`` itself
fake_backend.py ``comm.mode = "fake_backend"``: one rank of any layout on torch's fake backend
local_tensor.py ``comm.mode = "local_tensor"``: every rank of a layout in one process
                (LocalTensorMode), the per-rank loader and the host-side checks

It may import ``trainer.config`` and ``trainer.data`` (a per-rank loader merges the loaders'
states), ``models`` and ``parallel_dims``; nothing else in the trainer. What a mode changes in a
checkpoint's reading and writing lives with the checkpoint (trainer/checkpoint/local_tensor.py).
"""
