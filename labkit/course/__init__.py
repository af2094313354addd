"""The course around the labs: notebooks (build labs/ from solutions/, strip, check, their parameters
cells), the one papermill runner, grading, the runs and their report (the records themselves:
`labkit.course.records`). `labkit.course.cli` drives them from a terminal."""

import sys

__all__: list[str] = []

# nbformat validates notebooks with jsonschema, whose format checkers import rfc3987-syntax where it is
# installed (jupyter-events requires jsonschema[format-nongpl]). That package builds about 35 Earley parsers
# for the "iri" formats when it is imported: 2.5 s of CPU on the 2-core VM in every `labkit run`, `labkit
# grade` and test driver (python-jsonschema/jsonschema#1428), for formats no notebook schema uses. A process
# that imports the course before jsonschema gets jsonschema without those two checkers (it skips a checker
# whose library is missing).
if "jsonschema" not in sys.modules:
    sys.modules.setdefault("rfc3987_syntax", None)
