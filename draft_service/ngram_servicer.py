"""gRPC edge of the n-gram draft: the DraftService protocol over an NgramStore, no torch."""
import logging
import time

from batchspec import errors
from batchspec.runtime import service
from batchspec.v1 import cache_pb2, draft_pb2, draft_pb2_grpc
from draft_service import ngram

log = logging.getLogger(__name__)


class NgramServicer(service.ModelServicer, draft_pb2_grpc.DraftServiceServicer):
    result_type = draft_pb2.DraftResult

    def handle_own(self, kind, command):
        started = time.perf_counter()
        if not command.entries:
            raise errors.InvalidArgument("propose names no sequence")
        proposals = self.runner.propose(
            [(e.seq_id, e.expected_cache_len, e.keep_len, list(e.append_token_ids))
             for e in command.entries], command.num_draft_tokens)
        seconds = time.perf_counter() - started
        return "propose", draft_pb2.ProposeResult(
            timing=cache_pb2.CommandTiming(compute_seconds=seconds, forward_seconds=seconds),
            entries=[draft_pb2.ProposeResultEntry(
                seq_id=p.seq_id, draft_token_ids=p.draft_token_ids, cache_len=p.cache_len)
            for p in proposals])


def build_store(config: service.ServiceConfig) -> ngram.NgramStore:
    return ngram.NgramStore()


def warm_up(store: ngram.NgramStore) -> None:
    store.step_costs = ngram.measure_costs(store)
    log.info("n-gram draft: a proposal for 64 rows takes %.2f ms",
             1000 * max(c.seconds for c in store.step_costs))
