"""Actuators behind one protocol (``elastic.backends.base.Backend``): ``ray`` and ``kubernetes``."""

from elastic.backends.base import Backend, BackendUnavailable, JobRuntime, RescaleOutcome

__all__ = ["Backend", "BackendUnavailable", "JobRuntime", "RescaleOutcome"]
