"""One driver per lab: the functions a notebook (or torchrun) launches on every rank.

* `common.py`: the seeded model, the data split, the single-process reference and the DDP
  counting hook that every driver shares;
* `parallelism_choice.py` (lab 01), `oom_batch.py`, `precision.py`, `fragmentation.py` (lab 02),
  `unoverlapped_comms.py` (lab 03), `imbalanced_pipeline.py` (lab 04), `unprofiled_run.py` (lab 05),
  `capstone.py` (lab 06): what each lab's notebook launches;
* `script.py` and `cluster_tour.py` (lab 00): each lab's measurement as a script that writes the lab's
  records, `python -m labkit.experiments.<module>` or under `torchrun -m` on any number of nodes.

The building blocks they drive are in `labkit.parallel`, `labkit.measured_memory` and `labkit.trace`.
"""
