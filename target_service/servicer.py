"""gRPC edge of the target service: protobuf in, verifier call, protobuf out."""
import time

from batchspec import errors
from batchspec.runtime import features_wire, logprobs, service
from batchspec.v1 import cache_pb2, target_pb2, target_pb2_grpc
from target_service import verifier

SERVICE_NAME = "batchspec.v1.TargetService"


class TargetServicer(service.ModelServicer, target_pb2_grpc.TargetServiceServicer):
    result_type = target_pb2.TargetResult

    def handle(self, kind, command):
        if kind == "prefill" and command.return_features:
            self.gate.admit(self.runner, [(e.seq_id, e.token_ids) for e in command.entries])
            return "prefill", prefill_with_features(self.runner, command)
        if kind == "prefill" and any(e.HasField("prompt_logprobs") for e in command.entries):
            return "prefill", scored_prefill(self.runner, command)
        return super().handle(kind, command)

    def feature_width(self) -> int:
        return self.runner.hidden_size

    def handle_own(self, kind, command):
        if kind == "features":
            prefixes = [list(e.token_ids) for e in command.entries]
            return "features", target_pb2.FeaturesResult(features=[
                features_wire.to_message(f) for f in self.runner.features(prefixes)])
        started = time.perf_counter()
        rows = [to_verify_row(e, self.runner.vocab_size) for e in command.entries]
        if not rows:
            raise errors.InvalidArgument("verify names no sequence")
        outcomes, group = verifier.verify(self.runner, rows, realign=command.realign,
                                          keep_features=command.return_features)
        timing = service.timing(group, started)
        return "verify", target_pb2.VerifyResult(timing=timing, entries=[
            target_pb2.VerifyResultEntry(seq_id=o.seq_id, num_accepted=o.num_accepted,
                                         output_token_ids=o.output_token_ids,
                                         cache_len=o.cache_len,
                                         logprobs=to_wire(o.logprobs or []),
                                         features=None if o.features is None
                                         else features_wire.to_message(o.features))
            for o in outcomes])


def prefill_with_features(runner, command: cache_pb2.PrefillCommand) -> cache_pb2.PrefillResult:
    """A prefill that returns the features of every position it caches."""
    if any(e.HasField("copy_from") or e.HasField("prompt_logprobs") or e.HasField("features")
           for e in command.entries):
        raise errors.InvalidArgument("a prefill that returns features takes no copy_from, "
                                     "prompt_logprobs or features: send those entries in a "
                                     "command of their own")
    lens, kept = runner.prefill_features([(e.seq_id, list(e.token_ids))
                                          for e in command.entries], keep=True)
    return cache_pb2.PrefillResult(cache_lens=lens, features=[
        features_wire.to_message(kept[e.seq_id]) for e in command.entries])


def scored_prefill(runner, command: cache_pb2.PrefillCommand) -> cache_pb2.PrefillResult:
    """A prefill whose entries may ask for their prompt's log-probabilities."""
    if any(e.HasField("copy_from") for e in command.entries):
        raise errors.InvalidArgument("a prefill that scores prompts cannot copy caches: send "
                                     "the entries with copy_from in a command of their own")
    scoring = {e.seq_id: (e.prompt_logprobs.num_top, e.next_token_id)
               for e in command.entries if e.HasField("prompt_logprobs")}
    lens, scored = runner.prefill_scored([(e.seq_id, list(e.token_ids))
                                          for e in command.entries], scoring)
    return cache_pb2.PrefillResult(cache_lens=lens, prompt_logprobs=[
        cache_pb2.PromptLogprobs(tokens=to_wire(scored.get(e.seq_id, [])))
        for e in command.entries])


def to_wire(scored: list[logprobs.TokenLogprobs]) -> list[cache_pb2.TokenLogprobs]:
    return [cache_pb2.TokenLogprobs(logprob=t.logprob, top_token_ids=t.top_token_ids,
                                    top_logprobs=t.top_logprobs) for t in scored]


def to_verify_row(entry: target_pb2.VerifyEntry, vocab_size: int) -> verifier.VerifyRow:
    sampling = service.to_sampling(entry.sampling)
    num_top = None
    if entry.HasField("logprobs"):
        num_top = entry.logprobs.num_top
        logprobs.check_num_top(num_top)
    masks = None
    if entry.token_masks:
        if len(entry.token_masks) != len(entry.draft_token_ids) + 1:
            raise errors.InvalidArgument(
                f"sequence {entry.seq_id}: {len(entry.token_masks)} token masks for "
                f"{len(entry.draft_token_ids)} drafts; send one per draft and one more")
        try:
            masks = verifier.decode_masks(list(entry.token_masks), vocab_size)
        except ValueError as error:
            raise errors.InvalidArgument(f"sequence {entry.seq_id}: {error}") from error
    return verifier.VerifyRow(seq_id=entry.seq_id, expected_cache_len=entry.expected_cache_len,
                              append_token_ids=list(entry.append_token_ids),
                              draft_token_ids=list(entry.draft_token_ids),
                              sampling=sampling, num_top=num_top, token_masks=masks)
