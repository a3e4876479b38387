"""Routing this package's log records for ``swift_loader``'s ``logger=`` argument (see :mod:`loader.compat`)."""

from __future__ import annotations

import json
import logging
import os
import sys

#: Loggers that carry everything this package logs (swift_loader's ``logger=`` routes them).
PACKAGE_LOGGERS = ("loader", "cachestore")


class JsonLinesFormatter(logging.Formatter):
    """One JSON object per record, as swift_loader wrote its ``.json`` log files."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {"time": self.formatTime(record), "level": record.levelname, "logger": record.name,
                 "message": record.getMessage()}
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


class ForwardHandler(logging.Handler):
    """Hands our records to a logger of the user's (``logger=some_logging_logger``)."""

    def __init__(self, target: logging.Logger) -> None:
        super().__init__()
        self.target = target

    def emit(self, record: logging.LogRecord) -> None:
        if self.target.isEnabledFor(record.levelno):
            self.target.handle(record)


def log_handlers(spec: dict | logging.Logger | None, consumer_index: int) -> tuple[list[logging.Handler], int | None]:
    """Handlers and level for a :func:`parse_logger_spec` result.

    A file goes to ``<path>_Dataloader-<consumer_index>.json`` (JSON lines),
    or ``.log`` (text) when `path` ends in ``.log``, as swift_loader named it.
    """
    if spec is None:
        return [], None
    if isinstance(spec, logging.Logger):
        ours = [logging.getLogger(name) for name in PACKAGE_LOGGERS]
        # A record already propagates to the root and to ancestors of our loggers:
        # forwarding it there too would print it twice.
        if spec is logging.getLogger() or all(lg.name.startswith(spec.name + ".") for lg in ours):
            return [], spec.getEffectiveLevel()
        return [ForwardHandler(spec)], spec.getEffectiveLevel()
    level = spec["level"]
    text = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    handlers: list[logging.Handler] = []
    path = spec.get("path")
    if path:
        path = os.fspath(path)
        ext = ".log" if path.endswith(".log") else ".json"
        if path.endswith((".json", ".log")):
            path = path[:-len(ext)]
        filename = f"{path}_Dataloader-{consumer_index}{ext}"
        os.makedirs(os.path.dirname(os.path.abspath(filename)), exist_ok=True)
        handler: logging.Handler = logging.FileHandler(filename, encoding="utf-8")
        handler.setFormatter(JsonLinesFormatter() if ext == ".json" else text)
        handlers.append(handler)
    if spec.get("stdout"):
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(text)
        handlers.append(handler)
    for handler in handlers:
        handler.setLevel(level)
    return handlers, level


class AncestorsAboveHandler(logging.Handler):
    """Passes records at or above `threshold` on to the ancestors of a logger that no longer propagates."""

    def __init__(self, parent: logging.Logger, threshold: int) -> None:
        super().__init__()
        self.parent = parent
        self.threshold = threshold

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= self.threshold:
            self.parent.handle(record)


class LogRouting:
    """Handlers added to the ``loader`` and ``cachestore`` loggers for one loader; removed at close.

    A logger left at its default level would drop INFO records before any
    handler saw them, so its level is lowered to the requested one while the
    loader lives. Lowering it alone would also send those records up to the
    root's handlers (a handler has no level of its own after
    ``logging.basicConfig``) and flood the user's console: the logger stops
    propagating, and :class:`AncestorsAboveHandler` hands the ancestors exactly the
    records they saw before. Everything is restored at close. Two such loaders
    alive at once restore in their closing order.
    """

    def __init__(self, handlers: list[logging.Handler], level: int | None) -> None:
        self.handlers = handlers
        self.saved: list[tuple[logging.Logger, int, bool, list[logging.Handler]]] = []
        for name in PACKAGE_LOGGERS:
            logger = logging.getLogger(name)
            added = list(handlers)
            saved = (logger, logger.level, logger.propagate, added)
            before = logger.getEffectiveLevel()
            if level is not None and before > level:
                logger.setLevel(level)
                if logger.propagate and logger.parent is not None:
                    logger.propagate = False
                    added.append(AncestorsAboveHandler(logger.parent, before))
            for handler in added:
                logger.addHandler(handler)
            self.saved.append(saved)

    def remove(self) -> None:
        saved, self.saved = self.saved, []
        for logger, level, propagate, added in reversed(saved):
            for handler in added:
                logger.removeHandler(handler)
            logger.setLevel(level)
            logger.propagate = propagate
        for handler in self.handlers:
            handler.close()


# ---------------------------------------------------------------------------- the loader
