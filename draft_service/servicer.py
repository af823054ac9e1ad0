"""gRPC edge of the draft service: a command converted (batchspec.runtime.wire), the proposer
called, the result converted."""
import time

from batchspec import errors
from batchspec.runtime import service, wire
from batchspec.v1 import draft_pb2, draft_pb2_grpc
from draft_service import SERVICE_NAME, proposer  # noqa: F401 (SERVICE_NAME re-exported)


class DraftServicer(service.ModelServicer, draft_pb2_grpc.DraftServiceServicer):
    result_type = draft_pb2.DraftResult

    def feature_width(self) -> int:
        return self.runner.reads_features

    def handle_own(self, kind, command):
        started = time.perf_counter()
        rows = wire.propose_rows(command)
        if not rows:
            raise errors.InvalidArgument("propose names no sequence")
        proposals, groups = self.propose(rows, command)
        return "propose", wire.propose_result(proposals, wire.timing(
            time.perf_counter() - started, sum(g.realign_seconds for g in groups),
            sum(g.forward_seconds for g in groups)))

    def propose(self, rows, command):
        """(ProposedRows, the group forwards run) for a propose command's rows."""
        proposals, group = proposer.propose(self.runner, rows, command.num_draft_tokens,
                                            realign=command.realign,
                                            min_confidence=command.min_draft_confidence)
        return proposals, [group]
