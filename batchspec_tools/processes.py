"""Service processes seen from outside: a free port to start one on, a wait until its health
check says SERVING (failing early when it died), what CPU time one has used, and an orderly
stop."""
import os
import signal
import socket
import subprocess
import time


def stop_children(children) -> None:
    """Coordinator first (it drains), then the services."""
    for child in reversed(children):
        if child.poll() is None:
            child.send_signal(signal.SIGTERM)
            try:
                child.wait(timeout=30)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()


def cpu_seconds(pid: int) -> float | None:
    """CPU seconds (user and system, all its threads) the process `pid` has used so far;
    None where that cannot be read (the process is gone, or no Linux /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            fields = stat.read().rsplit(b")", 1)[1].split()  # past "pid (name)"
    except OSError:
        return None
    # utime and stime are the stat file's 14th and 15th fields, in clock ticks
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A loopback port free now, and never one this process handed out before: the OS may
    give a just-closed port again, and two services told the same port collide at start."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def wait_listening(address: str, timeout: float, children=()) -> None:
    """Poll until `address` accepts TCP connections (a TLS server whose CA is not known
    here; it starts listening once it serves); fail early if a child died."""
    host, _, port = address.rpartition(":")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        _check_alive(children)
        try:
            with socket.create_connection((host, int(port)), timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"{address} not listening after {timeout}s")


def _check_alive(children) -> None:
    dead = [c for c in children if c.poll() is not None]
    if dead:
        raise RuntimeError(f"{dead[0].args[2]} exited with {dead[0].returncode}")


def wait_healthy(address: str, service: str, timeout: float, children=(),
                 credentials=None) -> None:
    """Poll grpc.health.v1 until `service` is SERVING; fail early if a child died.
    credentials: grpc.ChannelCredentials for a TLS server, None for plaintext."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from batchspec import server as server_lib

    deadline = time.monotonic() + timeout
    with server_lib.open_channel(address, credentials) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            _check_alive(children)
            try:
                status = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1)
                if status.status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"{service or 'the server'} at {address} not healthy after {timeout}s")
