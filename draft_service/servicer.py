"""gRPC edge of the draft service: protobuf in, proposer call, protobuf out."""
import time

from batchspec import errors
from batchspec.runtime import features_wire, service
from batchspec.v1 import draft_pb2, draft_pb2_grpc
from draft_service import SERVICE_NAME, proposer  # noqa: F401 (SERVICE_NAME re-exported)


class DraftServicer(service.ModelServicer, draft_pb2_grpc.DraftServiceServicer):
    result_type = draft_pb2.DraftResult

    def feature_width(self) -> int:
        return self.runner.reads_features

    def handle_own(self, kind, command):
        started = time.perf_counter()
        rows = [proposer.ProposeRow(e.seq_id, e.expected_cache_len, e.keep_len,
                                    list(e.append_token_ids), service.to_sampling(e.sampling),
                                    features_wire.from_message(e.features, f"sequence {e.seq_id}")
                                    if e.HasField("features") else None)
                for e in command.entries]
        if not rows:
            raise errors.InvalidArgument("propose names no sequence")
        proposals, group = proposer.propose(self.runner, rows, command.num_draft_tokens,
                                            realign=command.realign,
                                            min_confidence=command.min_draft_confidence)
        timing = service.timing(group, started)
        return "propose", draft_pb2.ProposeResult(timing=timing, entries=[
            draft_pb2.ProposeResultEntry(
                seq_id=p.seq_id, draft_token_ids=p.draft_token_ids, cache_len=p.cache_len,
                cut=p.cut)
            for p in proposals])
