"""The course around the labs: notebooks (build labs/ from solutions/, strip, check, run),
records of headline numbers, and the run report. `labkit.cli` drives them from a terminal."""
