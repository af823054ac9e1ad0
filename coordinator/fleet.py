"""The replicas the coordinator drives and how they change while it serves: one engine per
target replica, the draft replicas grouped into kinds by the model they serve.

`Membership` (coordinator.membership) calls `add_target`, `remove_target`, `add_draft` and
`remove_draft` from its thread. A new target gets an engine of its own (started, then given
new requests by the router); a removed one's engine moves its requests to the others and ends.
A draft replica change reaches each engine as a posted action (only an engine's thread touches
its peers), so it changes only where drafts go.

Sequence ids carry a random 31-bit prefix per coordinator: several coordinators may share the
model services, whose caches are keyed by sequence id, without colliding.
"""
from __future__ import annotations

import functools
import itertools
import logging
import secrets
import threading

from batchspec import errors
from coordinator.clients import DraftClient, ModelInfo, TargetClient
from coordinator.engine import Engine
from coordinator.local_draft import LOCAL_NGRAM, LocalNgram
from coordinator.router import Router
from coordinator.stats import StepLog

log = logging.getLogger(__name__)

# How long adding a replica waits for it to answer before the next refresh asks again.
DESCRIBE_TIMEOUT_S = 2.0


def sequence_ids():
    """Ids unique to this coordinator: a random prefix in the high bits, a counter below."""
    return itertools.count((secrets.randbits(31) << 32) + 1)


def describe(client, timeout_s: float) -> ModelInfo:
    """Wait for a service and describe it, then close this probe connection (on a thread of
    its own: gRPC takes a fifth of a second to close a channel that waited to be ready)."""
    try:
        client.wait_ready(timeout_s)
        return client.describe(timeout=timeout_s)
    finally:
        threading.Thread(target=client.close, daemon=True, name="close probe").start()


def check_draft(info: ModelInfo, target: ModelInfo, address: str) -> None:
    """Refuse a draft whose token ids do not mean the target's tokens: a larger vocabulary,
    or another one (its digest, the token each id stands for, differs). Such a draft is
    served as a draft of the target's tokens, translating through text; its service then
    reports the target's vocabulary."""
    other = info.vocabulary and target.vocabulary and info.vocabulary != target.vocabulary
    if info.vocab_size > target.vocab_size or other:
        raise errors.FailedPrecondition(
            f"the draft at {address} ({info.model}) has another vocabulary than the target "
            f"({info.vocab_size} tokens against {target.vocab_size}, {target.model}): they "
            "do not share a tokenizer, so its token ids stand for other text. Serve it as a "
            "draft of the target's tokens: start its draft service with --target-tokenizer "
            "and the target's tokenizer.json (batchspec serve does so itself)")


def check_target(info: ModelInfo, target: ModelInfo, address: str) -> None:
    if (info.vocab_size, tuple(info.eos_token_ids)) != (target.vocab_size,
                                                        tuple(target.eos_token_ids)):
        raise errors.FailedPrecondition(f"the target at {address} hosts another model "
                                        f"({info.model}) than the first ({target.model})")


class Fleet:
    def __init__(self, config, router: Router, telemetry, target: ModelInfo,
                 kinds: list[tuple[str, list[str]]], tls_names: dict | None = None,
                 local: LocalNgram | None = None):
        """config: CoordinatorConfig; target: the first target's ModelInfo (every target
        must host its model); kinds: (model, draft addresses) per draft kind; tls_names:
        address -> the name its certificate carries, where not its host."""
        self.config = config
        self.router = router
        self.telemetry = telemetry
        self.target = target
        self.kinds = [(model, list(addresses)) for model, addresses in kinds]
        self.credentials = config.peer_credentials()
        self.seq_ids = sequence_ids()
        self.step_log = StepLog(config.step_log) if config.step_log else None
        self._refused: set[str] = set()  # addresses refused once (logged once)
        # address -> the name its TLS certificate carries, where not its host (see
        # membership: replicas found by DNS or Kubernetes are dialled by IP)
        self.tls_names: dict[str, str | None] = dict(tls_names or {})
        # the draft this process runs itself (local:ngram), if a kind names it: one for
        # every engine
        self.local = local

    # ---- engines --------------------------------------------------------------------------------
    def build_engine(self, address: str, tls_name: str | None = None) -> Engine:
        """An engine for the target at `address`; it uses the draft replicas from its place
        in the router on (engines spread over replicas), failing over to the others in turn."""
        i = len(self.router.engines)
        drafts = [[self._draft_client(addresses[(i + j) % len(addresses)])
                   for j in range(len(addresses))] for _, addresses in self.kinds]
        self.tls_names[address] = tls_name
        return self.router.add(Engine(
            TargetClient(address, self.config.stall_timeout_s, self.credentials, tls_name),
            drafts,
            self.config.engine, self.target.eos_token_ids, telemetry=self.telemetry,
            handover=self.router.handover, seq_ids=self.seq_ids, step_log=self.step_log))

    def _draft_client(self, address: str) -> DraftClient | LocalNgram:
        if address == LOCAL_NGRAM:
            return self.local
        return DraftClient(address, self.config.stall_timeout_s, self.credentials,
                           self.tls_names.get(address))

    def target_addresses(self) -> set[str]:
        return {e.peers.target.address for e in self.router.engines if not e.turnover.removed}

    def draft_addresses(self) -> set[str]:
        return {a for _, addresses in self.kinds for a in addresses}

    # ---- membership changes (the membership thread) --------------------------------------------
    def add_target(self, address: str, tls_name: str | None = None) -> None:
        info = self._describe(TargetClient, address, tls_name)
        if info is None or not self._checked(check_target, info, address):
            return
        engine = self.build_engine(address, tls_name)
        engine.start()
        self.router.health_changed()
        log.info("target %s joined (%s): it takes new requests", address, info.model)

    def remove_target(self, address: str) -> None:
        for engine in list(self.router.engines):
            if engine.peers.target.address == address and not engine.turnover.removed:
                log.info("target %s left: its requests move to the other targets", address)
                engine.turnover.remove()

    def add_draft(self, address: str, tls_name: str | None = None) -> None:
        info = self._describe(DraftClient, address, tls_name)
        if info is None or not self._checked(check_draft, info, address):
            return
        self.tls_names[address] = tls_name
        index = next((i for i, (model, _) in enumerate(self.kinds) if model == info.model),
                     None)
        if index is None:
            if address not in self._refused:
                self._refused.add(address)
                log.warning("draft %s serves %s, which no draft kind of this coordinator "
                            "serves: kinds are fixed at start, so it is not used", address,
                            info.model)
            return
        addresses = self.kinds[index][1]
        addresses.append(address)
        for i, engine in enumerate(list(self.router.engines)):
            engine.turnover.post(functools.partial(engine.turnover.add_draft_replica, index,
                                          self._draft_client(address),
                                          addresses[i % len(addresses)]))
        log.info("draft %s joined (%s): %d replicas of that draft", address, info.model,
                 len(addresses))

    def remove_draft(self, address: str) -> None:
        for _, addresses in self.kinds:
            if address in addresses:
                addresses.remove(address)
        for engine in list(self.router.engines):
            engine.turnover.post(functools.partial(engine.turnover.remove_draft_replica, address))
        log.info("draft %s left: drafts go to the other replicas", address)

    def _describe(self, client_type, address: str, tls_name: str | None) -> ModelInfo | None:
        try:
            info = describe(client_type(address, credentials=self.credentials,
                                        tls_name=tls_name), DESCRIBE_TIMEOUT_S)
        except errors.Unavailable as error:
            log.info("%s does not answer yet (%s): asked again at the next refresh", address,
                     error)
            return None
        if info.draining:
            log.info("%s is draining: not added", address)
            return None
        return info

    def _checked(self, check, info: ModelInfo, address: str) -> bool:
        try:
            check(info, self.target, address)
            return True
        except errors.FailedPrecondition as error:
            if address not in self._refused:
                self._refused.add(address)
                log.error("%s", error)
            return False
