"""gRPC edge of the target service: a command converted (batchspec.runtime.wire), the verifier
or the runner called, the result converted. A target may host a draft (`hosted_draft`, a
DraftServicer on the same server, runner lock and compute thread): a verify may then ask it to
propose first and verify what it proposed, in one command."""
import dataclasses
import time

from batchspec import errors
from batchspec.runtime import service, wire
from batchspec.v1 import draft_pb2, target_pb2, target_pb2_grpc
from target_service import verifier
from target_service.rounds import Lines, Rounds

SERVICE_NAME = "batchspec.v1.TargetService"
MAX_PLAIN_STEPS = 64  # VerifyCommand.plain_steps
MAX_ROUNDS = 64  # VerifyCommand.rounds


class TargetServicer(service.ModelServicer, target_pb2_grpc.TargetServiceServicer):
    result_type = target_pb2.TargetResult
    hosted_draft = None  # a DraftServicer sharing this one's lock and instance, or None

    def handle(self, kind, command):
        if kind == "prefill" and command.return_features:
            self.gate.admit(self.runner, wire.prefill_entries(command))
            return "prefill", prefill_with_features(self.runner, command)
        if kind == "prefill" and any(e.HasField("prompt_logprobs") for e in command.entries):
            return "prefill", scored_prefill(self.runner, command)
        return super().handle(kind, command)

    def feature_width(self) -> int:
        return self.runner.hidden_size

    def handle_own(self, kind, command):
        if kind == "features":
            return "features", wire.features_result(
                self.runner.features(wire.feature_prefixes(command)))
        started = time.perf_counter()
        if not command.entries:
            raise errors.InvalidArgument("verify names no sequence")
        if command.plain_steps > 1:
            return "verify", self.decode(command, started)
        if command.rounds > 1:
            self.check_rounds(command)
        proposed, hosted = self.propose_first(command)
        if command.rounds > 1 and (hosted is None or isinstance(hosted, draft_pb2.ProposeResult)):
            return "verify", self.speculate(command, proposed, hosted, started)
        rows = wire.verify_rows(command, self.runner.vocab_size, proposed)
        outcomes, group = verifier.verify(self.runner, rows, realign=command.realign,
                                          keep_features=command.return_features)
        result = wire.verify_result(outcomes, service.timing(group, started))
        if isinstance(hosted, draft_pb2.ProposeResult):
            result.propose.CopyFrom(hosted)
        elif hosted is not None:
            result.propose_error.CopyFrom(hosted)
        return "verify", result

    def decode(self, command, started: float):
        """A verify of plain_steps plain steps (VerifyCommand.plain_steps)."""
        if command.plain_steps > MAX_PLAIN_STEPS:
            raise errors.InvalidArgument(f"plain_steps {command.plain_steps}: at most "
                                         f"{MAX_PLAIN_STEPS}")
        if command.HasField("propose") or any(
                e.draft_token_ids or e.num_proposed or e.token_masks for e in command.entries):
            raise errors.InvalidArgument("a verify of plain_steps carries no drafts, "
                                         "num_proposed, token masks or propose")
        rows = wire.verify_rows(command, self.runner.vocab_size)
        outcomes, groups = verifier.decode(self.runner, rows, command.plain_steps,
                                           realign=command.realign,
                                           keep_features=command.return_features)
        return wire.verify_result(outcomes, service.timing(groups, started))

    def check_rounds(self, command) -> None:
        if command.rounds > MAX_ROUNDS:
            raise errors.InvalidArgument(f"rounds {command.rounds}: at most {MAX_ROUNDS}")
        if any(e.token_masks for e in command.entries):
            raise errors.InvalidArgument("a verify of rounds carries no token masks")

    def speculate(self, command, proposed, first, started: float):
        """A verify of several rounds (VerifyCommand.rounds), the hosted draft's first
        proposal made (first: its ProposeResult; None: the command has no propose)."""
        rows = wire.verify_rows(command, self.runner.vocab_size, proposed)
        for row in rows:  # refused before anything runs, not at the round that reaches them
            self.runner.check_token_ids(row.continuation, f"continuation of sequence {row.seq_id}")
        hosted = None if first is None else Rounds(self.hosted_draft.runner, command, first)
        lines = Lines(rows)

        def following(verified):
            """The next round's drafts; None where the rounds end (see Rounds), and where no
            propose runs and every line was left (a lookup asked again finds more)."""
            drafts = {} if hosted is None else hosted(verified)
            lined = lines(verified)
            if drafts is None or (hosted is None and not any(lined.values())):
                return None
            return {**lined, **drafts}

        outcomes, per_round, groups = verifier.speculate(
            self.runner, rows, command.rounds, following, realign=command.realign,
            keep_features=command.return_features or bool(hosted and hosted.reads_features))
        if not command.return_features:
            outcomes = [dataclasses.replace(o, features=None) for o in outcomes]
        result = wire.verify_result(outcomes, service.timing(groups, started), per_round)
        if hosted is not None:
            result.propose.CopyFrom(hosted.last)
        return result

    def propose_first(self, command):
        """(proposed tokens by sequence, the ProposeResult or the CommandError) of a verify's
        propose by the hosted draft; (None, None) when it asks none. A refused propose leaves
        the draft's caches as they were, and its rows verify no drafts."""
        if not command.HasField("propose"):
            return None, None
        if self.hosted_draft is None:
            raise errors.InvalidArgument("this target hosts no draft: send drafts as "
                                         "draft_token_ids, or start it with --draft-model")
        try:
            _, result = self.hosted_draft.handle("propose", command.propose)
        except errors.BatchspecError as error:
            return {}, wire.error(error)
        return {e.seq_id: list(e.draft_token_ids) for e in result.entries}, result


def prefill_with_features(runner, command):
    """A prefill that returns the features of every position it caches."""
    if any(e.HasField("copy_from") or e.HasField("prompt_logprobs") or e.HasField("features")
           for e in command.entries):
        raise errors.InvalidArgument("a prefill that returns features takes no copy_from, "
                                     "prompt_logprobs or features: send those entries in a "
                                     "command of their own")
    entries = wire.prefill_entries(command)
    lens, kept = runner.prefill_features(entries, keep=True)
    return wire.prefill_result(lens, features=[kept[seq_id] for seq_id, _ in entries])


def scored_prefill(runner, command):
    """A prefill whose entries may ask for their prompt's log-probabilities."""
    if wire.prefill_copies(command):
        raise errors.InvalidArgument("a prefill that scores prompts cannot copy caches: send "
                                     "the entries with copy_from in a command of their own")
    entries = wire.prefill_entries(command)
    lens, scored = runner.prefill_scored(entries, wire.scoring(command))
    return wire.prefill_result(lens, prompt_logprobs=[scored.get(seq_id, [])
                                                      for seq_id, _ in entries])
