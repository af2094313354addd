"""The course around the labs: notebooks (build labs/ from solutions/, strip, check, their parameters
cells), the one papermill runner, grading, the runs and their report (the records themselves:
`labkit.course.records`). `labkit.course.cli` drives them from a terminal."""
