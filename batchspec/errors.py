"""Typed errors of batchspec and their one mapping to gRPC status codes.

Domain code raises these; servicers and clients convert with `to_status_code` /
`from_status_code`. Nothing else chooses a status code.
"""
import grpc


class BatchspecError(Exception):
    """Base class: a refused request or command with a message that says what to fix, and
    the request field at fault where one is (named as the gRPC API names it: an edge that
    names it otherwise says it its own way)."""

    code = grpc.StatusCode.INTERNAL

    def __init__(self, message: str = "", field: str | None = None):
        super().__init__(message)
        self.field = field


class InvalidArgument(BatchspecError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class ContextLengthExceeded(InvalidArgument):
    """The prompt and the tokens asked for do not fit the model's context."""


class NotFound(BatchspecError):
    code = grpc.StatusCode.NOT_FOUND


class AlreadyExists(BatchspecError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(BatchspecError):
    """A length or state mismatch: the caller's view of a cache is not the service's."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class ResourceExhausted(BatchspecError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class Unavailable(BatchspecError):
    """A peer service is down or unreachable."""

    code = grpc.StatusCode.UNAVAILABLE


class Draining(Unavailable):
    """The service is shutting down: it takes no new sequence (place it on another replica)
    but still serves those it holds. Carried as UNAVAILABLE with reason DRAINING."""

    reason = "DRAINING"


class DeadlineExceeded(BatchspecError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Cancelled(BatchspecError):
    code = grpc.StatusCode.CANCELLED


_BY_CODE = {cls.code: cls for cls in (InvalidArgument, NotFound, AlreadyExists, FailedPrecondition,
                                      ResourceExhausted, Unavailable, DeadlineExceeded, Cancelled)}


def to_status_code(error: BaseException) -> grpc.StatusCode:
    """The gRPC status for an exception; anything untyped is INTERNAL."""
    return error.code if isinstance(error, BatchspecError) else grpc.StatusCode.INTERNAL


# The HTTP status of each gRPC status, for the OpenAI-compatible edge (anything else: 500).
_HTTP_STATUS = {grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.UNAUTHENTICATED: 401,
                grpc.StatusCode.NOT_FOUND: 404, grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
                grpc.StatusCode.CANCELLED: 499, grpc.StatusCode.UNAVAILABLE: 503,
                grpc.StatusCode.DEADLINE_EXCEEDED: 504}


def to_http_status(error: BaseException) -> int:
    """The HTTP status for an exception, by its gRPC status; anything untyped is 500."""
    return _HTTP_STATUS.get(to_status_code(error), 500)


def code_number(code: grpc.StatusCode) -> int:
    """google.rpc.Code number of a grpc.StatusCode, as carried in CommandError."""
    return code.value[0]


# Errors that a status code alone does not tell apart: by (code, reason).
_BY_REASON = {(Draining.code, Draining.reason): Draining}


def address_refused(what: str, host: str, port: int, error: OSError) -> OSError:
    """The OSError (its errno kept) of a server that could not take host:port, saying which
    of a process's servers (`what`: gRPC, HTTP, metrics) it was."""
    refused = OSError(f"cannot serve {what} on {host}:{port}: {error.strerror or error}")
    refused.errno = error.errno
    return refused


def reason_of(error: BaseException) -> str:
    """The reason word a typed error carries besides its code ("" for most)."""
    return getattr(error, "reason", "")


def from_status_code(code: grpc.StatusCode | int, message: str,
                     reason: str = "") -> BatchspecError:
    """Rebuild the typed error a peer reported (by StatusCode or google.rpc.Code number,
    and the reason word where it sent one)."""
    if isinstance(code, int):
        code = next((c for c in grpc.StatusCode if c.value[0] == code), grpc.StatusCode.UNKNOWN)
    cls = _BY_REASON.get((code, reason)) or _BY_CODE.get(code, BatchspecError)
    return cls(message)


def abort_with(context: grpc.ServicerContext, error: BaseException) -> None:
    """Ends an RPC with the status that belongs to `error` (raises, as context.abort does)."""
    context.abort(to_status_code(error), str(error) or type(error).__name__)


async def abort_async(context, error: BaseException) -> None:
    """abort_with for a grpc.aio handler (raises, as context.abort does)."""
    await context.abort(to_status_code(error), str(error) or type(error).__name__)
