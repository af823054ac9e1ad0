"""The one gRPC server skeleton of all three processes: health, reflection, graceful stop."""
import logging
import signal
import threading
from concurrent import futures

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

log = logging.getLogger(__name__)

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


def parse_config(parser, argv, build):
    """Parse the command line and build its frozen config with build(args). A value the
    config refuses exits with the parser's usage message (status 2), not a traceback."""
    args = parser.parse_args(argv)
    try:
        return build(args)
    except ValueError as error:
        parser.error(str(error))


def create_server(address: str, services, *, max_workers: int = 32):
    """Build a server on `address` ('host:port'; port 0 picks a free one).

    services: (add_servicer_to_server function, servicer, full service name) triples.
    Returns (server, port, health_servicer); every service starts NOT_SERVING until
    `set_serving` is called, so health says SERVING only once the model is loaded.
    """
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers),
                         options=CHANNEL_OPTIONS)
    health_servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    names = [name for _, _, name in services]
    for add, servicer, name in services:
        add(servicer, server)
        health_servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    health_servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
    reflection.enable_server_reflection(names + [health.SERVICE_NAME, reflection.SERVICE_NAME],
                                        server)
    port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot bind {address}")
    return server, port, health_servicer


def set_serving(health_servicer, names, serving: bool = True) -> None:
    status = (health_pb2.HealthCheckResponse.SERVING if serving
              else health_pb2.HealthCheckResponse.NOT_SERVING)
    for name in list(names) + [""]:
        health_servicer.set(name, status)


def run_until_signalled(server, health_servicer, names, *, grace_s: float = 10.0,
                        on_stop=None) -> None:
    """Serve until SIGTERM/SIGINT, then stop admitting, let in-flight RPCs finish for up to
    grace_s seconds, and return."""
    stop = threading.Event()

    def handle(signum, _frame):
        log.info("signal %d: draining for up to %.0fs", signum, grace_s)
        stop.set()

    signal.signal(signal.SIGTERM, handle)
    signal.signal(signal.SIGINT, handle)
    stop.wait()
    set_serving(health_servicer, names, serving=False)
    if on_stop is not None:
        on_stop(grace_s)
    server.stop(grace_s).wait()
    log.info("stopped")
