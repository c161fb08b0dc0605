"""Run folders: what a job leaves behind, and how any command reads it back.

``save_run`` / ``load_run`` (``runs.folder``) handle every kind of model; ``runs.files``
holds the atomic, pickle-free file primitives and the one error class, ``RunFolderError``;
``runs.metrics`` reads a run's ``metrics.jsonl`` back as a loss curve.
"""

from handformer.runs.files import RunFolderError
from handformer.runs.folder import RUN_KINDS, Run, load_run, run_kind, save_run

__all__ = ["RUN_KINDS", "Run", "RunFolderError", "load_run", "run_kind", "save_run"]
