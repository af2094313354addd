"""Lab 00, the cluster tour: what its notebook takes from the course, as `lab00.<name>`.

The bandwidth test and the GPU links it teaches the notebook imports from labkit itself. Here: its checked
parameters (`Params`), the check on a learner's sum over ranks, the bandwidth forecast and the verdict, and
the practice questions (`quiz`).
"""

from __future__ import annotations

from labkit.course import quiz
from labkit.course.experiments.cluster_tour import Params
from labkit.course.experiments.cluster_tour_checks import check_sum_over_ranks
from labkit.course.forecast import bandwidth_forecast, bus_bandwidth_gb_s, verdict

__all__ = [
    "Params", "bandwidth_forecast", "bus_bandwidth_gb_s", "check_sum_over_ranks", "quiz", "verdict",
]
