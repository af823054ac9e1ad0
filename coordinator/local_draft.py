"""The n-gram draft in the coordinator's own process (`--draft local:ngram`): a lookup over
tokens the coordinator already holds costs no round trip to a service.

`LocalNgram` answers what a DraftClient answers (describe, probe, prefill, trim, release,
propose), over one batchspec.ngram.NgramStore: the same cache contract, checks and errors as
the n-gram draft service, so the engine drives both the same way. One per coordinator: every
engine's handle is the same object, and its store is shared the way one n-gram service is
shared by every target replica (a request moving between engines is released here first).
"""
import time
import uuid

from batchspec import ngram
from coordinator.clients import Answered, ModelInfo, Proposal, ProposeSpec, Timing

LOCAL_NGRAM = "local:ngram"  # the --draft value, and the kind's address


class LocalNgram:
    address = LOCAL_NGRAM

    def __init__(self):
        self.store = ngram.NgramStore()
        self.store.step_costs = ngram.measure_costs(self.store)
        self.instance = uuid.uuid4().hex  # it never restarts: one instance for its life

    def describe(self, timeout: float | None = None) -> ModelInfo:
        store = self.store
        with store.lock:
            return ModelInfo(store.name, store.vocab_size, list(store.eos_token_ids),
                             store.max_context_len, len(store.caches),
                             store.num_cached_tokens(),
                             tuple((c.rows, c.tokens, c.seconds) for c in store.step_costs),
                             # the host's CPU, as the n-gram service reports it (so
                             # --overlap auto decides as it would with the service)
                             device="cpu", instance_id=self.instance)

    def probe(self, timeout: float | None = None) -> Answered:
        return Answered(self.describe())

    def wait_ready(self, timeout: float) -> None:
        """Always ready."""

    def reset(self) -> None:
        """No stream to drop."""

    def close(self) -> None:
        """Nothing to close: the store lives as long as the coordinator."""

    def prefill(self, entries: list[tuple[int, list[int]]], copies: dict | None = None,
                features: dict | None = None, return_features: bool = False) -> list[int]:
        # the engine sends neither copies nor features to a draft that reads none
        with self.store.lock:
            return self.store.prefill(entries)

    def trim(self, entries: list[tuple[int, int, int]]) -> list[int]:
        with self.store.lock:
            return self.store.trim(entries)

    def release(self, seq_ids: list[int]) -> int:
        with self.store.lock:
            return self.store.release(seq_ids)

    def propose(self, num_drafts: int, realign: bool, specs: list[ProposeSpec],
                timeout: float | None = None,
                min_confidence: float = 0.0) -> tuple[list[Proposal], Timing]:
        started = time.perf_counter()
        with self.store.lock:
            proposed = self.store.propose(specs, num_drafts)
        return ([Proposal(p.seq_id, p.draft_token_ids, p.cache_len) for p in proposed],
                Timing(time.perf_counter() - started))

