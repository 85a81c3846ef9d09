"""The one base of the package's errors.

Every error the package raises on purpose derives from :class:`OstinatoError`: a stable machine
``code`` (e.g. "model_not_found"), a human ``message`` (also ``str(error)``), the HTTP ``status``
an answer carrying it uses, and ``extra`` fields of that answer (e.g. ``n_ctx`` of a context
overflow). The arguments are always in this order: ``OstinatoError(code, message, status, extra)``.

Errors described by their message alone (a bad file, a failed build, ...) derive from
:class:`MessageError`: ``SomeError(message)``, with ``code`` and ``status`` those of the class.
Both also derive from the builtin class their callers catch (``ValueError``, ``RuntimeError``)
where they did before, so ``except ValueError`` keeps catching a ``PlanError``.

This module imports nothing of the package: every layer can use it.
"""

from __future__ import annotations

from typing import Any, Optional


def _restore(cls: type, args: tuple, state: dict[str, Any]) -> "OstinatoError":
    err = cls.__new__(cls)
    err.args = args
    err.__dict__.update(state)
    return err


class OstinatoError(Exception):
    """Base of the package's errors: ``code`` (str), ``message`` (str), ``status`` (int HTTP
    status; the class's default when None), ``extra`` (dict of further answer fields, copied).
    Raises TypeError when ``code`` is an int or ``status`` a string: arguments in the order some
    classes had before, ``(status, code, message)``."""

    code: str = "error"
    status: int = 500

    def __init__(self, code: str, message: str, status: Optional[int] = None,
                 extra: Optional[dict[str, Any]] = None):
        if isinstance(code, int) or isinstance(status, str):  # an older class's order, not a value
            raise TypeError(f"{type(self).__name__}(code, message, status, extra): got code {code!r}, "
                            f"status {status!r}")
        super().__init__(message)
        self.code = code
        self.message = message
        if status is not None:
            self.status = status
        self.extra = dict(extra or {})

    def __reduce__(self):  # picklable whatever the subclass's constructor takes
        return _restore, (type(self), self.args, dict(self.__dict__))


class MessageError(OstinatoError):
    """An error described by its message alone: ``code`` and ``status`` are the class's."""

    def __init__(self, message: str = ""):
        super().__init__(type(self).code, message)
