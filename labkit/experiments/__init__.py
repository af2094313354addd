"""One driver per lab: the functions a notebook (or torchrun) launches on every rank.

* `common.py`: the seeded model, the data split, the single-process reference and the DDP
  counting hook that every driver shares;
* `oom_batch.py`: lab 02, data-parallel steps with gradient accumulation and their memory;
* `unoverlapped_comms.py`: lab 03, the naive, overlapped and torch DDP steps, timed.

The building blocks they drive are in `labkit.parallel`, `labkit.measured_memory` and `labkit.trace`.
"""
