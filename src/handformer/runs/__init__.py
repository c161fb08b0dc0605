"""Run folders: what a job leaves behind, and how any command reads it back.

``save_run`` / ``load_run`` (``runs.folder``) handle every kind of model; ``runs.files``
holds the atomic, pickle-free file primitives and the one error class, ``RunFolderError``;
``runs.metrics`` reads a run's ``metrics.jsonl`` back as a loss curve; ``runs.guard``
decides where a command may write (``writing_folder``: foreign folders refused, only
handformer's own files ever removed) and ``runs.lock`` keeps one writer per folder.
"""

from handformer.runs.files import RunFolderError
from handformer.runs.folder import RUN_KINDS, Run, load_run, run_kind, save_run
from handformer.runs.guard import (
    CLASSIFIER_FOLDER,
    LM_FOLDER,
    RUN_FOLDERS,
    SEQ2SEQ_FOLDER,
    FolderSpec,
    check_destination,
    folder_path,
    writing_folder,
)
from handformer.runs.lock import FolderBusyError, FolderLock

__all__ = ["CLASSIFIER_FOLDER", "LM_FOLDER", "RUN_FOLDERS", "RUN_KINDS", "SEQ2SEQ_FOLDER",
           "FolderBusyError", "FolderLock", "FolderSpec", "Run", "RunFolderError",
           "check_destination", "folder_path", "load_run", "run_kind", "save_run",
           "writing_folder"]
