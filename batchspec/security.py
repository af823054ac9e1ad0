"""TLS, mutual TLS and API keys, all optional: files in, gRPC credentials and an interceptor
out. Nothing here is used on a plain loopback deployment."""
import dataclasses
import hmac
import pathlib

import grpc

# Methods anyone may call without an API key: a load balancer's health checks.
OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)


def _read(path: str) -> bytes:
    file = pathlib.Path(path)
    if not file.is_file():
        raise ValueError(f"no such file: {path}")
    return file.read_bytes()


@dataclasses.dataclass(frozen=True)
class ServerTls:
    """A server's certificate and key; with client_ca, only peers with a certificate signed
    by that CA get in (mutual TLS)."""

    cert: str
    key: str
    client_ca: str | None = None

    def __post_init__(self):
        for path in (self.cert, self.key, self.client_ca):
            if path is not None:
                _read(path)

    def ssl_context(self):
        """The same certificate for an HTTPS server (clients are not asked for theirs)."""
        import ssl

        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(self.cert, self.key)
        return context

    def credentials(self) -> grpc.ServerCredentials:
        ca = _read(self.client_ca) if self.client_ca else None
        return grpc.ssl_server_credentials([(_read(self.key), _read(self.cert))],
                                           root_certificates=ca,
                                           require_client_auth=ca is not None)


@dataclasses.dataclass(frozen=True)
class ClientTls:
    """How a client checks a server (the CA that signed its certificate) and, for mutual TLS,
    the certificate it shows."""

    ca: str
    cert: str | None = None
    key: str | None = None

    def __post_init__(self):
        if (self.cert is None) != (self.key is None):
            raise ValueError("a client certificate needs both its cert and its key file")
        for path in (self.ca, self.cert, self.key):
            if path is not None:
                _read(path)

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=_read(self.ca),
            private_key=_read(self.key) if self.key else None,
            certificate_chain=_read(self.cert) if self.cert else None)


def server_tls(cert: str | None, key: str | None, client_ca: str | None = None):
    """ServerTls from command-line paths, or None when TLS is off. Raises ValueError for a
    half-given pair."""
    if cert is None and key is None:
        if client_ca is not None:
            raise ValueError("--tls-ca on a server needs --tls-cert and --tls-key")
        return None
    if cert is None or key is None:
        raise ValueError("TLS needs both --tls-cert and --tls-key")
    return ServerTls(cert, key, client_ca)


def client_tls(ca: str | None, cert: str | None, key: str | None):
    """ClientTls from command-line paths, or None when TLS is off (no CA). Raises ValueError
    for a certificate without a CA, or a half-given certificate."""
    if ca is None:
        if cert is not None or key is not None:
            raise ValueError("--client-cert and --client-key need --tls-ca")
        return None
    return ClientTls(ca, cert, key)


def read_api_key(path: str) -> str:
    key = _read(path).decode().strip()
    if not key:
        raise ValueError(f"the API key file {path} is empty")
    return key


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Lets a call through only with `authorization: Bearer <key>` in its metadata; anything
    else ends with UNAUTHENTICATED before the servicer runs. Health checks stay open."""

    def __init__(self, key: str):
        self._expected = f"Bearer {key}".encode()

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_METHOD_PREFIXES) \
                or self._authorised(details.invocation_metadata):
            return handler
        return _refusing(handler)

    def _authorised(self, metadata) -> bool:
        given = next((value for key, value in metadata or () if key == "authorization"), "")
        return bearer_matches(given, self._expected)


def bearer_matches(given, expected: bytes) -> bool:
    """An authorization value (str or bytes) equals the expected 'Bearer <key>', compared in
    constant time."""
    given = given.encode() if isinstance(given, str) else given
    return hmac.compare_digest(given, expected)


def _refusing(handler):
    """A handler of the same shape as `handler` that ends the call with UNAUTHENTICATED."""

    async def refuse(_request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED,
                            "missing or wrong API key: send 'authorization: Bearer <key>'")

    make = {(False, False): grpc.unary_unary_rpc_method_handler,
            (False, True): grpc.unary_stream_rpc_method_handler,
            (True, False): grpc.stream_unary_rpc_method_handler,
            (True, True): grpc.stream_stream_rpc_method_handler}[
        (handler.request_streaming, handler.response_streaming)]
    return make(refuse, request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer)
