"""`RankError`: a rank failed. Raised by `labkit.launch` for the ranks it starts and by
`labkit.machine.torchrun` for torchrun's ranks, so both import it from here."""

from __future__ import annotations

__all__ = ["RankError"]


class RankError(RuntimeError):
    """A rank failed: it raised, died, or hung in a collective.

    `rank` is the rank to look at first, `kind` one of "raised", "died", "hung", `exc_type` the name of the
    rank's exception type (None when it died) and `remote_traceback` its traceback as text.
    """

    def __init__(
        self, message: str, *, rank: int, kind: str, exc_type: str | None = None, remote_traceback: str = ""
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.kind = kind
        self.exc_type = exc_type
        self.remote_traceback = remote_traceback
