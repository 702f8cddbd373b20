"""Run folders: created with clear errors, written file by file whole, finished with a checksum list.

A run folder is the ``--output`` of ``mqbench ptq``, ``qat``, ``profile`` and ``mixed-precision``.

* Opening one checks the path first: a file, a path under a file, a folder that cannot be created or
  written is an :class:`OutputError` naming the path, what is wrong and what to do.
* A folder that holds a finished run is refused unless ``overwrite``: the earlier run's files are then set
  aside (``.replaced/``) while the new run works and removed when it finishes; if the new run fails or is
  interrupted they are put back, so a finished run is never lost to a run that did not finish. The files of
  an unfinished earlier run (failed or interrupted) are replaced the same way, without asking; a QAT
  checkpoint the new run resumes from stays where it is.
* Every file is written under a temporary name and renamed when complete (:meth:`RunFolder.write_text`).
* A finished run's last file is ``checksums.sha256`` (``sha256sum`` format, ``sha256sum -c checksums.sha256``
  checks it in the folder): the SHA-256 of the configuration, the quantized state dict and every deployed
  artifact. :func:`check_checksums` compares a folder with it and names the first file that changed.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "CHECKSUMS",
    "RUN_FILES",
    "ChecksumError",
    "OutputError",
    "RunFolder",
    "check_checksums",
    "create_folder",
    "describe_os_error",
    "file_paths",
    "previous_status",
    "read_checksums",
    "sha256_of",
    "update_checksums",
]

CHECKSUMS = "checksums.sha256"
# What a run writes into its folder (deploy/ when the deployment goes there).
RUN_FILES = (
    "config.yaml",
    "results.json",
    "quantized_state_dict.pt",
    "mixed_precision.yaml",
    "checkpoint.pt",
    "verify.txt",
    "report.md",
    "report.html",
    "profile.md",
    CHECKSUMS,
    "deploy",
)
_SET_ASIDE = ".replaced"


class OutputError(ValueError):
    """An output path that cannot take a run, or a write that failed: the message names the path and what to do."""


class ChecksumError(ValueError):
    """A run folder's file differs from the checksum recorded when the run finished."""


def describe_os_error(error: OSError, what: str = "write") -> str:
    """``path: reason; what to do`` for an operating system error while reading or writing a run's files."""
    where = error.filename if error.filename is not None else "the output folder"
    reason = error.strerror or str(error)
    if error.errno == errno.ENOSPC or error.errno == errno.EDQUOT:
        remedy = "free space on that disk (or give --output a folder on another one) and run again"
    elif error.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        remedy = "give --output a folder you can write, or make this one writable"
    elif error.errno in (errno.ENOTDIR, errno.EEXIST):
        remedy = "a part of the path is a file: give --output a folder path"
    else:
        remedy = "check the path and run again"
    return f"cannot {what} {where}: {reason}; {remedy}"


def file_paths(paths: Iterable[str | Path]) -> list[Path]:
    """``paths`` with each folder among them (an artifact that is a folder) replaced by the files in it, sorted."""
    out: list[Path] = []
    for item in paths:
        path = Path(item)
        out.extend(sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path])
    return out


def sha256_of(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for block in iter(lambda: stream.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def previous_status(path: str | Path) -> str | None:
    """The ``status`` of the run whose ``results.json`` is in ``path`` (None: no run there); ``finished`` also
    when a run replacing a finished one was killed (the finished one waits in ``.replaced/``)."""
    if Path(path).name != _SET_ASIDE and previous_status(Path(path) / _SET_ASIDE) == "finished":
        return "finished"
    results = Path(path) / "results.json"
    if not results.is_file():
        return None
    try:
        status = json.loads(results.read_text()).get("status")
    except (ValueError, AttributeError, OSError):
        return "unreadable"
    return str(status)


def create_folder(path: Path, what: str = "the run folder") -> None:
    """Create ``path`` (and its parents) and check this process can write there; :class:`OutputError` if not."""
    if path.exists() and not path.is_dir():
        raise OutputError(f"{what} {path} is a file, not a folder: give --output a folder path")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except (NotADirectoryError, FileExistsError) as error:
        raise OutputError(
            f"cannot create {what} {path}: {error.strerror} (a part of that path is a file); "
            "give --output a folder path"
        ) from None
    except OSError as error:
        raise OutputError(f"cannot create {what} {path}: {describe_os_error(error, 'create')}") from None
    try:
        handle, probe = tempfile.mkstemp(prefix=".mqbench-probe-", dir=path)
    except OSError as error:
        raise OutputError(
            f"{what} {path} is not writable ({error.strerror}): give --output a folder you can write"
        ) from None
    os.close(handle)
    os.unlink(probe)


class RunFolder:
    """A run's output folder: every file written whole (temporary name, then renamed).

    Creating it checks that ``path`` is (or can become) a folder this process can write, and raises
    :class:`OutputError` otherwise. A failed write raises :class:`OutputError` naming the file.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        create_folder(self.path)
        self.written: list[str] = []  # names relative to the folder, in the order first written
        self._set_aside: Path | None = None
        self._restore_on_failure = False
        self._kept: set[Path] = set()

    def write_text(self, name: str, text: str) -> Path:
        return self._replace(name, lambda tmp: tmp.write_text(text))

    def write_json(self, name: str, payload: Any) -> Path:
        return self.write_text(name, json.dumps(payload, indent=2, default=str) + "\n")

    def save_torch(self, name: str, payload: Any) -> Path:
        return self._replace(name, lambda tmp: torch.save(payload, tmp))

    def _replace(self, name: str, write: Callable[[Path], Any]) -> Path:
        final = self.path / name
        tmp = final.with_name(f".{final.name}.partial")
        try:
            write(tmp)
            os.replace(tmp, final)
        except OSError as error:
            if error.filename is None or Path(error.filename) == tmp:
                error.filename = str(final)
            raise OutputError(describe_os_error(error)) from error
        finally:
            tmp.unlink(missing_ok=True)
        if name not in self.written:
            self.written.append(name)
        return final

    # -- an earlier run in the folder ----------------------------------------------------------------

    def set_aside_previous(self, keep: Iterable[Path] = (), restore_on_failure: bool = False) -> None:
        """Move an earlier run's files into ``.replaced/`` (all but ``keep``); see :meth:`finish` / :meth:`fail`.

        A ``.replaced/`` holding a finished run is what a killed run with ``overwrite`` left: that run's files
        go and the finished one stays set aside, to come back if this run does not finish either."""
        aside = self.path / _SET_ASIDE
        kept = {Path(p).resolve() for p in keep}
        self._kept = kept
        names = [n for n in RUN_FILES if (self.path / n).exists() and (self.path / n).resolve() not in kept]
        if aside.is_dir() and previous_status(aside) == "finished":
            for name in names:
                _remove(self.path / name)
            self._set_aside, self._restore_on_failure = aside, True
            return
        if aside.exists():
            shutil.rmtree(aside)
        if not names:
            return
        aside.mkdir()
        for name in names:
            os.replace(self.path / name, aside / name)
        self._set_aside = aside
        self._restore_on_failure = restore_on_failure

    def finish(self) -> None:
        """The new run finished: the earlier run's files go."""
        if self._set_aside is not None:
            shutil.rmtree(self._set_aside, ignore_errors=True)
            self._set_aside = None

    def fail(self, results: dict[str, Any]) -> None:
        """The new run failed or was interrupted: put an earlier finished run back (the new run's files go), or
        record ``results`` (status and error) in ``results.json``; never raises."""
        if self._set_aside is not None and self._restore_on_failure:
            try:
                for name in [*self.written, "deploy"]:
                    if (self.path / name).resolve() not in self._kept:  # a checkpoint the run resumed from stays
                        _remove(self.path / name)
                for entry in self._set_aside.iterdir():
                    os.replace(entry, self.path / entry.name)
                self._set_aside.rmdir()
                self._set_aside = None
                return
            except OSError:  # the earlier run stays in .replaced/, where the next run finds it
                self._set_aside = None
        self.finish()
        self.record_results(results)

    def record_results(self, results: dict[str, Any]) -> None:
        """Write ``results.json`` even on a full disk: whole if it can, else over the old file, else remove the
        old one (it must not go on saying ``running``); never raises."""
        text = json.dumps(results, indent=2, default=str) + "\n"
        final = self.path / "results.json"
        try:
            self.write_text("results.json", text)
            return
        except (OutputError, OSError):
            pass
        try:
            with open(final, "w") as stream:  # truncated first: the old file's space takes the new one
                stream.write(text)
            json.loads(final.read_text())
            return
        except (OSError, ValueError):
            pass
        with contextlib.suppress(OSError):
            final.unlink(missing_ok=True)

    # -- checksums -------------------------------------------------------------------------------------

    def write_checksums(self, files: Sequence[str | Path]) -> Path:
        """``checksums.sha256``: the SHA-256 of each of ``files`` (relative to the folder, or absolute)."""
        lines = []
        for path in file_paths(Path(f) if Path(f).is_absolute() else self.path / f for f in files):
            full = path
            try:
                shown = full.resolve().relative_to(self.path.resolve())
            except ValueError:
                shown = full.resolve()
            lines.append(f"{sha256_of(full)}  {shown.as_posix()}\n")
        return self.write_text(CHECKSUMS, "".join(lines))


def update_checksums(folder: str | Path, files: Iterable[str | Path]) -> None:
    """Record the new checksums of ``files`` (written again, e.g. by ``mqbench deploy --run``) in a run folder's
    ``checksums.sha256``; the other entries keep their recorded digests. A folder without a list is left so."""
    path = Path(folder)
    recorded = read_checksums(path)
    if recorded is None:
        return
    for file in file_paths(files):
        full = file.resolve()
        try:
            name = full.relative_to(path.resolve()).as_posix()
        except ValueError:
            name = full.as_posix()
        recorded[name] = sha256_of(full)
    text = "".join(f"{digest}  {name}\n" for name, digest in recorded.items())
    final = path / CHECKSUMS
    tmp = final.with_name(f".{final.name}.partial")
    try:
        tmp.write_text(text)
        os.replace(tmp, final)
    except OSError as error:
        raise OutputError(describe_os_error(error)) from error
    finally:
        tmp.unlink(missing_ok=True)


def read_checksums(folder: str | Path) -> dict[str, str] | None:
    """The recorded checksums of a run folder (path as written -> hex digest); None when it has none."""
    file = Path(folder) / CHECKSUMS
    if not file.is_file():
        return None
    recorded = {}
    for number, line in enumerate(file.read_text().splitlines(), 1):
        digest, sep, name = line.partition("  ")
        if not sep or len(digest) != 64:
            raise ChecksumError(f"{file}: line {number} is not '<sha256>  <path>'; the checksum list is damaged")
        recorded[name] = digest
    return recorded


def check_checksums(folder: str | Path, names: Callable[[str], bool] = lambda name: True) -> list[str]:
    """Compare the files of a finished run folder with ``checksums.sha256`` (those ``names`` selects).

    Returns the files checked; raises :class:`ChecksumError` naming the first file that is missing or changed,
    with what to do. A folder without a checksum list (a run from before they were written) returns [].
    """
    path = Path(folder)
    recorded = read_checksums(path)
    if recorded is None:
        return []
    checked = []
    for name, digest in recorded.items():
        if not names(name):
            continue
        file = Path(name) if Path(name).is_absolute() else path / name
        remedy = _remedy(name)
        if not file.is_file():
            raise ChecksumError(f"{path}: {name} is missing (the run recorded its checksum in {CHECKSUMS}); {remedy}")
        if sha256_of(file) != digest:
            raise ChecksumError(
                f"{path}: {name} changed after the run finished (its SHA-256 differs from the one in {CHECKSUMS}); "
                f"{remedy}"
            )
        checked.append(name)
    return checked


def _remedy(name: str) -> str:
    if name in ("quantized_state_dict.pt", "config.yaml", "mixed_precision.yaml"):
        return (
            "the run's quantized model can no longer be trusted: restore the file from a copy, or run the command "
            "again (--overwrite replaces the run)"
        )
    return "write the run's artifacts again with mqbench deploy --run (it records their new checksums)"
