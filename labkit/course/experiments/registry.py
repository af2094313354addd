"""The labs: each notebook's name and the module that holds its driver, its `Params` and its `headline`.

    registry.module_of("03")            # "labkit.course.experiments.unoverlapped_comms"
    registry.params_of("03_unoverlapped_comms")   # its Params class (the module is imported)

`labkit build` writes each notebook's parameters cell from its `Params`, `labkit run -p` checks values with it
before a kernel starts, and the tests take each lab's small runs from it.
"""

from __future__ import annotations

import importlib

from labkit.course.experiments.params import LabParams

__all__ = ["LABS", "lab_name", "module_of", "params_of"]

LABS: dict[str, str] = {
    "00_cluster_tour": "labkit.course.experiments.cluster_tour",
    "01_parallelism_choice": "labkit.course.experiments.parallelism_choice",
    "02_oom_batch": "labkit.course.experiments.oom_batch",
    "03_unoverlapped_comms": "labkit.course.experiments.unoverlapped_comms",
    "04_imbalanced_pipeline": "labkit.course.experiments.imbalanced_pipeline",
    "05_unprofiled_run": "labkit.course.experiments.unprofiled_run",
    "06_capstone": "labkit.course.experiments.capstone",
}


def lab_name(key: str) -> str:
    """The lab `key` names: "03", "3", "03_unoverlapped_comms" or "unoverlapped_comms" (ValueError else)."""
    for name, module in LABS.items():
        number = name[:2]
        if key in (name, number, module, module.rsplit(".", 1)[1]) or (
            key.isdigit() and int(key) == int(number)
        ):
            return name
    raise ValueError(f"lab {key!r} is not one of the course's labs: {', '.join(LABS)}")


def module_of(key: str) -> str:
    """The module of lab `key` (see `lab_name`)."""
    return LABS[lab_name(key)]


def params_of(key: str) -> type[LabParams]:
    """The `Params` class of lab `key`; importing its module (torch and the lab's driver)."""
    return importlib.import_module(module_of(key)).Params
