"""Live membership: which target and draft replicas exist, read from sources while serving.

A source names replicas in one of these forms (each `--target` / `--draft` value is one):
- `HOST:PORT`: that one service, always;
- `dns:NAME:PORT`: every address NAME resolves to, resolved again every refresh (gRPC does not
  re-resolve a healthy channel's name, so the coordinator does it and keeps one channel per
  address, which its cache-affine routing needs);
- `file:PATH`: one `HOST:PORT` per line (`#` comments), read again when the file changes;
- `k8s:NAMESPACE/SERVICE:PORT`: the ready endpoints of the Service's EndpointSlices, watched
  with the Kubernetes API; a terminating endpoint is leaving and no longer a member;
- `local:ngram` (drafts only): the n-gram draft in the coordinator's own process
  (coordinator.local_draft), always there.

`Membership` refreshes every source every `interval_s` on a thread of its own and tells the
router what appeared and what left. Invariant: the router's targets and drafts are the union
of the sources' last answers, less the members that could not be described (they are asked
again at the next refresh). A source that fails to answer keeps its last answer, so a DNS or
API hiccup never removes every replica.
"""
from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time

log = logging.getLogger(__name__)


def check_address(address: str, what: str) -> str:
    """`HOST:PORT` with a port in range, or ValueError naming `what`."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{what}: {address!r} is not HOST:PORT")
    return address


def join_host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class Local:
    """`local:ngram`: the draft the coordinator runs itself (see coordinator.local_draft)."""

    dynamic = False
    tls_name = None

    def __init__(self, name: str):
        if name != "ngram":
            raise ValueError(f"local:{name}: the one draft the coordinator runs in its own "
                             "process is local:ngram")
        self.address = f"local:{name}"

    def addresses(self) -> set[str]:
        return {self.address}

    def __str__(self) -> str:
        return self.address


class Static:
    """One `HOST:PORT`."""

    dynamic = False
    tls_name = None  # the name a TLS certificate is checked against: the address's host

    def __init__(self, address: str):
        self.address = check_address(address, "a replica")

    def addresses(self) -> set[str]:
        return {self.address}

    def __str__(self) -> str:
        return self.address


class DnsSource:
    """`dns:NAME:PORT`: each address NAME resolves to (A and AAAA) is a replica.
    resolve(name) -> list of IP strings; default socket.getaddrinfo."""

    dynamic = True

    def __init__(self, name: str, port: int, resolve=None):
        self.name, self.port = name, port
        self.tls_name = name  # replicas are dialled by IP; their certificates name NAME
        self._resolve = resolve or _getaddrinfo
        self._last: set[str] = set()

    def addresses(self) -> set[str]:
        try:
            self._last = {join_host_port(ip, self.port) for ip in self._resolve(self.name)}
        except OSError as error:
            log.warning("resolving %s failed (%s): keeping its last %d addresses", self.name,
                        error, len(self._last))
        return set(self._last)

    def __str__(self) -> str:
        return f"dns:{self.name}:{self.port}"


def _getaddrinfo(name: str) -> list[str]:
    return sorted({info[4][0] for info in socket.getaddrinfo(name, None,
                                                              type=socket.SOCK_STREAM)})


class FileSource:
    """`file:PATH`: one `HOST:PORT` per line, blank lines and `#` comments skipped; read again
    whenever its modification time or size changes (a template tool rewrites it)."""

    dynamic = True
    tls_name = None

    def __init__(self, path: str):
        self.path = path
        self._stamp = None
        self._last: set[str] = set()

    def addresses(self) -> set[str]:
        try:
            stat = os.stat(self.path)
            stamp = (stat.st_mtime_ns, stat.st_size)
            if stamp != self._stamp:
                with open(self.path) as f:
                    self._last = parse_lines(f.read(), self.path)
                self._stamp = stamp
        except (OSError, ValueError) as error:
            log.warning("reading %s failed (%s): keeping its last %d addresses", self.path,
                        error, len(self._last))
        return set(self._last)

    def __str__(self) -> str:
        return f"file:{self.path}"


def parse_lines(text: str, path: str) -> set[str]:
    """The addresses of a membership file (ValueError on a line that is not HOST:PORT)."""
    lines = (line.split("#", 1)[0].strip() for line in text.splitlines())
    return {check_address(line, path) for line in lines if line}


class K8sSource:
    """`k8s:NAMESPACE/SERVICE:PORT`: the Service's EndpointSlices, watched.

    A replica is an endpoint whose condition `ready` is true (or unset, which Kubernetes
    defines as ready) and `terminating` is not true, with an address; `apply` takes one watch
    event as the API sends it (a dict with `type` and `object`), so recorded events test it."""

    dynamic = True

    def __init__(self, namespace: str, service: str, port: int):
        self.namespace, self.service, self.port = namespace, service, port
        # pods are dialled by IP; their certificates name the Service
        self.tls_name = f"{service}.{namespace}.svc"
        self._slices: dict[str, set[str]] = {}  # EndpointSlice name -> its ready addresses
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def apply(self, event: dict) -> None:
        """Take one watch event (ADDED, MODIFIED, DELETED; BOOKMARK and ERROR ignored)."""
        kind, obj = event.get("type"), event.get("object") or {}
        name = (obj.get("metadata") or {}).get("name")
        if name is None or kind not in ("ADDED", "MODIFIED", "DELETED"):
            return
        with self._lock:
            if kind == "DELETED":
                self._slices.pop(name, None)
            else:
                self._slices[name] = {join_host_port(endpoint["addresses"][0], self.port)
                                      for endpoint in obj.get("endpoints") or []
                                      if _serving(endpoint)}

    def addresses(self) -> set[str]:
        self._start()
        with self._lock:
            return set().union(*self._slices.values())

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, daemon=True,
                                            name=f"watch {self}")
            self._thread.start()

    def _watch(self) -> None:
        """List, then watch from the list's resourceVersion; start over on any failure."""
        from kubernetes import client, config, watch

        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        api = client.DiscoveryV1Api()
        selector = f"kubernetes.io/service-name={self.service}"
        while True:
            try:
                listed = api.list_namespaced_endpoint_slice(
                    self.namespace, label_selector=selector, _preload_content=False)
                body = json.loads(listed.data)
                with self._lock:
                    self._slices.clear()
                for item in body.get("items", []):
                    self.apply({"type": "ADDED", "object": item})
                stream = watch.Watch().stream(
                    api.list_namespaced_endpoint_slice, self.namespace,
                    label_selector=selector,
                    resource_version=body["metadata"].get("resourceVersion"),
                    timeout_seconds=300)
                for event in stream:
                    self.apply({"type": event["type"], "object": event["raw_object"]})
            except Exception as error:  # the API server restarted, a 410 Gone, a network blip
                log.warning("watching %s failed (%s): listing again", self, error)
                time.sleep(2.0)

    def __str__(self) -> str:
        return f"k8s:{self.namespace}/{self.service}:{self.port}"


def _serving(endpoint: dict) -> bool:
    conditions = endpoint.get("conditions") or {}
    return bool(endpoint.get("addresses")) and conditions.get("ready") is not False \
        and not conditions.get("terminating")


def parse_source(spec: str, resolve=None):
    """The source a `--target` / `--draft` value names (ValueError if it names none)."""
    scheme, _, rest = spec.partition(":")
    if scheme == "dns":
        name, _, port = rest.rpartition(":")
        if not name or not port.isdigit():
            raise ValueError(f"{spec!r}: expected dns:NAME:PORT")
        return DnsSource(name, int(port), resolve)
    if scheme == "file":
        if not rest:
            raise ValueError(f"{spec!r}: expected file:PATH")
        return FileSource(rest)
    if scheme == "k8s":
        where, _, port = rest.rpartition(":")
        namespace, _, service = where.partition("/")
        if not namespace or not service or not port.isdigit():
            raise ValueError(f"{spec!r}: expected k8s:NAMESPACE/SERVICE:PORT")
        return K8sSource(namespace, service, int(port))
    if scheme == "local":
        return Local(rest)
    return Static(spec)


class Membership:
    """Refreshes the sources of targets and drafts and applies the differences: `add_target`,
    `remove_target`, `add_draft`, `remove_draft` on `fleet` (see coordinator.fleet)."""

    def __init__(self, fleet, targets: list, drafts: list, interval_s: float = 2.0):
        self.fleet = fleet
        self.targets, self.drafts = targets, drafts
        self.interval_s = interval_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def resolve(sources: list) -> dict[str, str | None]:
        """{address: the name its TLS certificate is checked against (None: its host)}, in
        the order of the sources (the first draft kind is the first flag's)."""
        return {address: source.tls_name for source in sources
                for address in sorted(source.addresses())}

    def refresh(self) -> None:
        """One pass: add what appeared, remove what left (targets, then drafts)."""
        targets, drafts = self.resolve(self.targets), self.resolve(self.drafts)
        have_targets, have_drafts = self.fleet.target_addresses(), self.fleet.draft_addresses()
        for address in sorted(targets.keys() - have_targets):
            self.fleet.add_target(address, targets[address])
        for address in sorted(have_targets - targets.keys()):
            self.fleet.remove_target(address)
        for address in sorted(drafts.keys() - have_drafts):
            self.fleet.add_draft(address, drafts[address])
        for address in sorted(have_drafts - drafts.keys()):
            self.fleet.remove_draft(address)

    def start(self) -> None:
        """Refresh every interval_s, unless every source is a fixed address."""
        if not any(s.dynamic for s in self.targets + self.drafts):
            return
        self._thread = threading.Thread(target=self._run, daemon=True, name="membership")
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.refresh()
            except Exception:  # one failed refresh must not end membership
                log.exception("membership refresh failed")

    def stop(self) -> None:
        self._stop.set()
