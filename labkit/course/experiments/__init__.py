"""One driver per lab: the functions a notebook (or torchrun) launches on every rank.

* `params.py` (each lab's typed `Params` on `LabParams`), `registry.py` (the labs and their Params);
* `parallelism_choice.py` (lab 01), `oom_batch.py`, `precision.py`, `fragmentation.py` (lab 02),
  `unoverlapped_comms.py` (lab 03), `imbalanced_pipeline.py` (lab 04), `unprofiled_run.py` (lab 05),
  `capstone.py` (lab 06): what each lab's notebook launches, each with its exercise checks beside it
  (`<lab>_checks.py`);
* `script.py` and `cluster_tour.py` (lab 00): each lab's measurement as a script that writes the lab's
  records, `python -m labkit.course.experiments.<module>` or under `torchrun -m` on any number of nodes.

The building blocks they drive are in `labkit.course.training` (the one training job), `labkit.parallel`,
`labkit.measured_memory` and `labkit.trace`.
"""
