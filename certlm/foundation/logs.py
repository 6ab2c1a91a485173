"""Where log records go: certlm's own to the console, the libraries' there only from WARNING (asyncua's INFO lines
carry whole certificates and endpoint lists), and everything from INFO up to a private, rotated file in the data
directory; asyncua's INFO lines only at ``debug``, since formatting them costs more than certlm's own work."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from logging.handlers import RotatingFileHandler
from pathlib import Path
from typing import TextIO

from certlm.foundation.secretbox import open_private_file, private_directory

LEVELS = ("debug", "info", "warning", "error")
DEFAULT_LEVEL = "info"
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LOG_FILE_MAX_BYTES = 10 * 1024 * 1024
LOG_FILE_BACKUPS = 5
# The fields of an operation's line (``log_operation``), kept apart in JSON logs for a collector to index.
OPERATION_FIELDS = ("device", "operation", "step", "outcome")
# ``extra`` of a record for the log file only, kept off the console.
FILE_ONLY = {"console": False}
# Never lower: asyncua logs the requests it sends, passwords and private keys included, at DEBUG.
FILE_LEVEL = logging.INFO


def log_file(data_dir: Path) -> Path:
    return data_dir / "logs" / "certlm.log"


def console_level(flag: str | None, env: Mapping[str, str] | None = None) -> str:
    """The console level from ``--log-level``, else ``$CERTLM_LOG_LEVEL``, else ``info``; ValueError names the
    source of a level that is not one of ``LEVELS``."""
    env = os.environ if env is None else env
    source, value = ("--log-level", flag) if flag else ("CERTLM_LOG_LEVEL", env.get("CERTLM_LOG_LEVEL"))
    level = (value or DEFAULT_LEVEL).strip().lower()
    if level not in LEVELS:
        raise ValueError(f"{source} must be one of {', '.join(LEVELS)}, got {value!r}")
    return level


def is_certlm_logger(name: str) -> bool:
    """certlm's own modules and its first-party plugins' (``certlm_<name>``)."""
    return name == "certlm" or name.startswith(("certlm.", "certlm_"))


class ConsoleFilter(logging.Filter):
    """Passes certlm's records from ``own`` up and every other library's from ``others`` up."""

    def __init__(self, own: int, others: int) -> None:
        super().__init__()
        self.own = own
        self.others = others

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "console", True) is False:
            return False
        return record.levelno >= (self.own if is_certlm_logger(record.name) else self.others)


class PrivateRotatingFileHandler(RotatingFileHandler):
    """A size-rotated log whose files, the first and each one a rollover starts, are readable by their owner only."""

    def _open(self) -> TextIO:
        return open(self.baseFilename, self.mode, encoding=self.encoding, errors=self.errors, opener=open_private_file)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: time, level, logger, message, an operation's fields (``OPERATION_FIELDS``) when
    the record has them, and the traceback of an exception. Nothing else of the record: its arguments may hold
    anything, and the message is what certlm chose to say."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in OPERATION_FIELDS:
            value = getattr(record, name, None)
            if value is not None:
                line[name] = value
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False, default=str)


def log_operation(logger: logging.Logger, device: str, operation: str, step: str, outcome: str, detail: str) -> None:
    """The one line an operator reads for a certificate operation on a device: which device, which operation, the
    step it ended at and its outcome, then ``detail`` (never a secret). WARNING when it failed."""
    level = logging.INFO if outcome in ("ok", "started") else logging.WARNING
    fields = {"device": device, "operation": operation, "step": step, "outcome": outcome}
    logger.log(
        level, "device=%s operation=%s step=%s outcome=%s: %s", device, operation, step, outcome, detail, extra=fields
    )


def configure_logging(
    level: str = DEFAULT_LEVEL,
    data_dir: Path | None = None,
    *,
    log_format: str = "text",
    max_bytes: int = LOG_FILE_MAX_BYTES,
    backups: int = LOG_FILE_BACKUPS,
) -> Path | None:
    """Set up the root logger for a certlm process; returns the log file, which exists once ``data_dir`` is given.

    On the console ``info`` shows certlm's records from INFO and the libraries' from WARNING, ``debug`` adds certlm's
    DEBUG and the libraries' INFO records, ``warning`` and ``error`` show only those. The file always gets every
    record from INFO up, whatever the console shows, but asyncua's INFO records only at ``debug``; it rotates at
    ``max_bytes``, keeping ``backups`` older files.
    ``log_format`` ``json`` writes one JSON object per line to both.
    """
    threshold = logging.getLevelNamesMapping()[level.upper()]
    others = logging.INFO if threshold <= logging.DEBUG else max(threshold, logging.WARNING)
    formatter = JsonFormatter() if log_format == "json" else logging.Formatter(LOG_FORMAT)
    console = logging.StreamHandler()
    console.setFormatter(formatter)
    console.addFilter(ConsoleFilter(threshold, others))
    handlers: list[logging.Handler] = [console]
    path = None
    if data_dir is not None:
        path = log_file(data_dir)
        # The CLI sets logging up first: the data directory may be made here, and must not be left as it was.
        private_directory(data_dir)
        private_directory(path.parent)
        details = PrivateRotatingFileHandler(path, maxBytes=max_bytes, backupCount=backups, encoding="utf-8")
        details.setFormatter(formatter)
        details.setLevel(FILE_LEVEL)
        handlers.append(details)
    logging.basicConfig(level=min(threshold, FILE_LEVEL), handlers=handlers, force=True)
    # asyncua logs each request and session at INFO, endpoint lists with whole certificates among them: formatting
    # them cost a campaign a tenth of its CPU. Its warnings always get through; its INFO lines only at ``debug``.
    logging.getLogger("asyncua").setLevel(logging.INFO if threshold <= logging.DEBUG else logging.WARNING)
    if path is not None:
        logging.getLogger(__name__).info("details (INFO and up, every library) go to %s", path)
    return path
