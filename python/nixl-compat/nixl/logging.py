"""`nixl.logging.get_logger`, as NIXL's: loggers under `nixl`, level from
`NIXL_LOG_LEVEL` (TRACE/DEBUG/INFO/WARN/ERROR; default WARN)."""

import logging as _logging
import os as _os

_LEVELS = {
    "TRACE": _logging.DEBUG,
    "DEBUG": _logging.DEBUG,
    "INFO": _logging.INFO,
    "WARN": _logging.WARNING,
    "WARNING": _logging.WARNING,
    "ERROR": _logging.ERROR,
    "FATAL": _logging.CRITICAL,
}

_root = _logging.getLogger("nixl")
if not _root.handlers:
    _h = _logging.StreamHandler()
    _h.setFormatter(_logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s"))
    _root.addHandler(_h)
    _root.setLevel(_LEVELS.get(_os.environ.get("NIXL_LOG_LEVEL", "WARN").upper(), _logging.WARNING))
    _root.propagate = False


def get_logger(name: str = "nixl") -> _logging.Logger:
    """A logger under the `nixl` hierarchy."""
    if name != "nixl" and not name.startswith("nixl."):
        name = "nixl." + name
    return _logging.getLogger(name)
