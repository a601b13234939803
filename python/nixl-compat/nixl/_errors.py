"""NIXL status codes (`nixl_status_t`, ai-dynamo/nixl
`src/api/cpp/nixl_types.h`) and the exception raised for each."""

import enum as _enum


class nixl_status_t(_enum.IntEnum):
    NIXL_IN_PROG = 1
    NIXL_SUCCESS = 0
    NIXL_ERR_NOT_POSTED = -1
    NIXL_ERR_INVALID_PARAM = -2
    NIXL_ERR_BACKEND = -3
    NIXL_ERR_NOT_FOUND = -4
    NIXL_ERR_MISMATCH = -5
    NIXL_ERR_NOT_ALLOWED = -6
    NIXL_ERR_REPOST_ACTIVE = -7
    NIXL_ERR_UNKNOWN = -8
    NIXL_ERR_NOT_SUPPORTED = -9
    NIXL_ERR_REMOTE_DISCONNECT = -10
    NIXL_ERR_CANCELED = -11
    NIXL_ERR_NO_TELEMETRY = -12


globals().update(nixl_status_t.__members__)


class nixlNotPostedError(RuntimeError):
    pass


class nixlInvalidParamError(RuntimeError):
    pass


class nixlBackendError(RuntimeError):
    pass


class nixlNotFoundError(RuntimeError):
    pass


class nixlMismatchError(RuntimeError):
    pass


class nixlNotAllowedError(RuntimeError):
    pass


class nixlRepostActiveError(RuntimeError):
    pass


class nixlUnknownError(RuntimeError):
    pass


class nixlNotSupportedError(RuntimeError):
    pass


class nixlRemoteDisconnectError(RuntimeError):
    pass


class nixlCancelledError(RuntimeError):
    pass


class nixlNoTelemetryError(RuntimeError):
    pass


_BY_STATUS = {
    -1: nixlNotPostedError,
    -2: nixlInvalidParamError,
    -3: nixlBackendError,
    -4: nixlNotFoundError,
    -5: nixlMismatchError,
    -6: nixlNotAllowedError,
    -7: nixlRepostActiveError,
    -8: nixlUnknownError,
    -9: nixlNotSupportedError,
    -10: nixlRemoteDisconnectError,
    -11: nixlCancelledError,
    -12: nixlNoTelemetryError,
}


def error_for(status: int, message: str) -> RuntimeError:
    """The exception NIXL's bindings raise for `status`."""
    cls = _BY_STATUS.get(int(status), nixlUnknownError)
    name = nixl_status_t(int(status)).name if int(status) in nixl_status_t._value2member_map_ else str(status)
    return cls(f"{name}: {message}")


def not_supported(what: str, why: str) -> nixlNotSupportedError:
    """`nixlNotSupportedError` naming the feature and the reason."""
    return nixlNotSupportedError(f"NIXL_ERR_NOT_SUPPORTED: {what} is not supported by kvwire's nixl: {why}")
