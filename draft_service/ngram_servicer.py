"""gRPC edge of the n-gram draft: the DraftService protocol over an NgramStore, no torch (a
command converted by batchspec.runtime.wire, the store called, the result converted)."""
import logging
import time

from batchspec import errors, ngram
from batchspec.runtime import service, wire
from batchspec.v1 import draft_pb2, draft_pb2_grpc

log = logging.getLogger(__name__)


class NgramServicer(service.ModelServicer, draft_pb2_grpc.DraftServiceServicer):
    result_type = draft_pb2.DraftResult

    def handle_own(self, kind, command):
        started = time.perf_counter()
        rows = wire.propose_rows(command)
        if not rows:
            raise errors.InvalidArgument("propose names no sequence")
        proposals = self.runner.propose(rows, command.num_draft_tokens)
        return "propose", wire.propose_result(proposals, wire.timing(time.perf_counter()
                                                                     - started))


def build_store(config: service.ServiceConfig) -> ngram.NgramStore:
    return ngram.NgramStore()


def warm_up(store: ngram.NgramStore) -> None:
    store.step_costs = ngram.measure_costs(store)
    log.info("n-gram draft: a proposal for 64 rows takes %.2f ms",
             1000 * max(c.seconds for c in store.step_costs))
