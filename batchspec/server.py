"""The one gRPC server skeleton of all three processes: health, reflection, graceful stop."""
import asyncio
import logging
import signal
import threading
import time
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

log = logging.getLogger(__name__)

# gRPC metadata key of a command stream: the service instance its client believes it talks to.
INSTANCE_METADATA = "batchspec-instance"

# Keep-alive pings let a peer notice a dead process within seconds, not minutes.
CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    # A restarted peer is found again within about two seconds.
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 2000),
]
# A port another process serves is refused, not shared (gRPC's default, SO_REUSEPORT, lets a
# second server bind it and the kernel split new connections between the two).
SERVER_OPTIONS = CHANNEL_OPTIONS + [("grpc.so_reuseport", 0)]


def open_channel(address: str, credentials=None, options=CHANNEL_OPTIONS):
    """A client channel: TLS with grpc.ChannelCredentials, plaintext without."""
    if credentials is not None:
        return grpc.secure_channel(address, credentials, options=options)
    return grpc.insecure_channel(address, options=options)


def parse_config(parser, argv, build):
    """Parse the command line and build its frozen config with build(args). A value the
    config refuses exits with the parser's usage message (status 2), not a traceback."""
    args = parser.parse_args(argv)
    try:
        return build(args)
    except ValueError as error:
        parser.error(str(error))


def create_server(address: str, services, *, max_workers: int = 32, credentials=None):
    """Build a server on `address` ('host:port'; port 0 picks a free one).

    services: (add_servicer_to_server function, servicer, full service name) triples.
    credentials: grpc.ServerCredentials for TLS (see batchspec.tls), None for plaintext.
    Returns (server, port, health_servicer); every service starts NOT_SERVING until
    `set_serving` is called, so health says SERVING only once the model is loaded.
    """
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers),
                         options=SERVER_OPTIONS)
    health_servicer = health.HealthServicer()
    port = _register(server, health_servicer, address, services, credentials)
    set_serving(health_servicer, [name for _, _, name in services], serving=False)
    return server, port, health_servicer


def _register(server, health_servicer, address: str, services, credentials) -> int:
    """Add the services, health (all NOT_SERVING) and reflection; bind; return the port."""
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [name for _, _, name in services]
    for add, servicer, _name in services:
        add(servicer, server)
    reflection.enable_server_reflection(names + [health.SERVICE_NAME, reflection.SERVICE_NAME],
                                        server)
    port = (server.add_secure_port(address, credentials) if credentials is not None
            else server.add_insecure_port(address))
    if port == 0:
        raise OSError(f"cannot bind {address}")
    return port


class LoopServer:
    """A grpc.aio server on an event loop of its own thread, driven from synchronous code
    with the same calls as a grpc.server (start, stop(grace).wait()). A streaming handler
    waiting for its next event is a suspended coroutine, not a worker thread, so open streams
    are bounded only by what the servicers admit; health and reflection always have the loop
    to answer on."""

    def __init__(self, address: str, services, *, credentials=None, interceptors=()):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                        name="grpc.aio loop")
        self._thread.start()
        self._stopped: threading.Event | None = None
        self.server, self.port, self.health = self.call(
            self._build(address, services, credentials, list(interceptors)))

    def call(self, coro):
        """Run a coroutine on the server's loop and return its result (from any other
        thread): the HTTP edge is started and stopped this way."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    async def _build(self, address, services, credentials, interceptors):
        server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=interceptors)
        servicer = health.aio.HealthServicer()
        port = _register(server, servicer, address, services, credentials)
        for name in [name for _, _, name in services] + [""]:
            await servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        return server, port, LoopHealth(servicer, self.loop)

    def start(self) -> None:
        self.call(self.server.start())

    def stop(self, grace_s: float | None) -> threading.Event:
        """Stop serving (in-flight RPCs get grace_s seconds), then the loop; the event is set
        once done. Calling it again returns the same event."""
        if self._stopped is None:
            self._stopped = threading.Event()
            future = asyncio.run_coroutine_threadsafe(self.server.stop(grace_s), self.loop)
            future.add_done_callback(self._stop_loop)
        return self._stopped

    def _stop_loop(self, _future) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._stopped.set()


class LoopHealth:
    """The grpc.aio health servicer with the synchronous `set` of grpc.health.v1's own."""

    def __init__(self, servicer, loop: asyncio.AbstractEventLoop):
        self.servicer = servicer
        self.loop = loop
        self.statuses: dict[str, int] = {}  # what set() last set (none yet: NOT_SERVING)

    def serving(self, name: str = "") -> bool:
        return self.statuses.get(name) == health_pb2.HealthCheckResponse.SERVING

    def set(self, name: str, status) -> None:
        self.statuses[name] = status
        coro = self.servicer.set(name, status)
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self.loop:
            self.loop.create_task(coro)
        elif self.loop.is_running():
            asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout=10)
        else:
            coro.close()  # the server has stopped: nobody is left to ask


def set_serving(health_servicer, names, serving: bool = True) -> None:
    """Set every name and the server as a whole ('') to SERVING or NOT_SERVING."""
    status = (health_pb2.HealthCheckResponse.SERVING if serving
              else health_pb2.HealthCheckResponse.NOT_SERVING)
    for name in list(names) + [""]:
        health_servicer.set(name, status)


def run_until_signalled(server, health_servicer, names, *, grace_s: float = 10.0,
                        on_stop=None) -> None:
    """Serve until SIGTERM/SIGINT, then report NOT_SERVING, let on_stop(grace_s) finish the
    work in hand (it returns by the end of the grace period), stop the server with what is
    left of grace_s for in-flight RPCs, and return."""
    stop = threading.Event()

    def handle(signum, _frame):
        log.info("signal %d: draining for up to %.0fs", signum, grace_s)
        stop.set()

    signal.signal(signal.SIGTERM, handle)
    signal.signal(signal.SIGINT, handle)
    # Python runs a handler on the main thread only, when it next runs bytecode: a signal the
    # kernel delivered to another thread (gRPC's) never wakes a wait without a timeout
    while not stop.wait(0.5):
        pass
    end = time.monotonic() + grace_s
    set_serving(health_servicer, names, serving=False)
    if on_stop is not None:
        on_stop(grace_s)
    server.stop(max(0.0, end - time.monotonic())).wait()
    log.info("stopped")
