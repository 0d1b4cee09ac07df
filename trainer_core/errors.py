"""The error hierarchy, classified by what the orchestrator must do.

- ``SpecError``: the input is wrong. Never retried: a retry cannot fix it.
- ``InfrastructureError``: a worker or node died, storage failed transiently. Retried from the
  newest committed checkpoint, on the infrastructure budget; ``PreemptedError`` (a node
  reclaimed for preemption) on its own budget.
- ``TrainingCodeError``: the training code raised. Retried on its own (smaller) budget; the same
  error at the same step twice in a row is a bug, not bad luck (see ``is_repeat_of``).

Every class pickles with its extra fields (errors cross Ray worker and Prefect result boundaries).
"""

from __future__ import annotations


class RelaytrainError(Exception):
    """Root of every error relaytrain raises on purpose."""

    #: Retry budget this error draws on: "none", "infrastructure", "preemption" or "code".
    budget = "none"

    def __reduce__(self):  # keep subclasses with extra kwargs picklable
        return (_rebuild, (type(self), self.args, self.__dict__.copy()))


def _rebuild(cls, args, state):
    error = cls.__new__(cls)
    Exception.__init__(error, *args)
    error.__dict__.update(state)
    return error


class SpecError(RelaytrainError, ValueError):
    """The run specification, a parameter, or something it names is invalid. Never retried."""

    def __init__(self, message: str, *, field: str | None = None):
        super().__init__(message)
        self.field = field


class LeaseHeldError(SpecError):
    """Another live flow holds the run. Not retried: a retry would find it held too."""


class LeaseLostError(LeaseHeldError):
    """This flow's lease was taken over: it commits nothing more. Not retried."""


class ClusterCapacityError(SpecError):
    """The Ray cluster cannot hold the requested workers (Ray itself would wait forever)."""


class ClusterBusyError(RelaytrainError):
    """Other work held the resources the worker group needs for longer than the run waits
    for them (``scaling.wait_for_resources_s``). Not retried: a retry would queue again; the
    run resumes from its newest commit when it is started again."""


class IncompatibleRunError(SpecError):
    """The run directory was written by an incompatible spec, schema or Ray version."""


class DataFileDamagedError(SpecError):
    """A dataset file's bytes are damaged (a page checksum fails, a page does not decode). Not
    retried: a retry reads the same bytes. ``file`` and ``row_group`` name where."""

    def __init__(
        self, message: str, *, field: str | None = None, file: str = "", row_group: int = -1
    ):
        super().__init__(message, field=field)
        self.file = file
        self.row_group = row_group


class StorageError(RelaytrainError):
    """Storage cannot be reached, read or written."""


class StorageUnavailableError(StorageError):
    """A transient storage failure: worth a retry on the infrastructure budget."""

    budget = "infrastructure"


class CheckpointCorruptError(StorageError):
    """A checkpoint's files do not match its manifest (or it has no valid commit marker)."""


class StorageAccessError(StorageError):
    """Storage refused the credentials or the operation (access denied, unknown or expired key,
    read-only store, missing bucket). Not retried: fix the credentials, permissions or URI."""

    def __init__(self, message: str, *, field: str | None = None):
        super().__init__(message)
        self.field = field


class StorageFullError(StorageError):
    """Storage has no space left (or a quota was hit). Not retried: free space, then resume."""

    def __init__(self, message: str, *, field: str | None = None):
        super().__init__(message)
        self.field = field


class InfrastructureError(RelaytrainError):
    """A worker or node died, or was preempted. Retried from the newest committed checkpoint."""

    budget = "infrastructure"

    def __init__(self, message: str, *, step: int | None = None):
        super().__init__(message)
        self.step = step


class PreemptedError(InfrastructureError):
    """A node of the worker group was reclaimed for preemption. Its own budget
    (``retries.preemption``), apart from other infrastructure failures."""

    budget = "preemption"


class TrainingCodeError(RelaytrainError):
    """The training code raised. ``error_type`` and ``step`` identify it across attempts."""

    budget = "code"

    def __init__(
        self,
        message: str,
        *,
        error_type: str,
        step: int | None = None,
        rank: int | None = None,
        traceback: str | None = None,
        deterministic: bool = False,
    ):
        super().__init__(message)
        self.error_type = error_type
        self.step = step
        self.rank = rank
        self.traceback = traceback
        #: True when the failure will repeat on retry (e.g. the loss became NaN).
        self.deterministic = deterministic

    def is_repeat_of(self, other: BaseException | None) -> bool:
        """True when ``other`` is the same training error at the same step (stop retrying)."""
        return (
            isinstance(other, TrainingCodeError)
            and other.error_type == self.error_type
            and other.step == self.step
            and str(other) == str(self)
        )


class InjectedFault(RuntimeError):
    """Raised inside training code by a ``raise`` fault from the spec (tests and demos)."""


def to_json(error: RelaytrainError) -> dict:
    """A relaytrain error as plain JSON (it crosses a Ray job's log): class, message, fields."""
    state = {
        k: v for k, v in error.__dict__.items() if isinstance(v, str | int | float | bool | None)
    }
    return {"class": type(error).__name__, "message": str(error), "state": state}


def from_json(data: dict) -> RelaytrainError:
    """Rebuild what ``to_json`` wrote; an unknown class becomes an InfrastructureError."""

    def subclasses(cls: type) -> list[type]:
        found = [cls]
        direct: list[type] = cls.__subclasses__()
        for sub in direct:
            found.extend(subclasses(sub))
        return found

    known = {cls.__name__: cls for cls in subclasses(RelaytrainError)}
    cls = known.get(data.get("class", ""))
    if cls is None:
        return InfrastructureError(f"{data.get('class')}: {data.get('message')}")
    return _rebuild(cls, (data.get("message", ""),), dict(data.get("state") or {}))
