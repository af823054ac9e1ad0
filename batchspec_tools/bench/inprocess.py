"""Engine clients that call the model-runners in this process instead of over gRPC: the same
engine, minus serialisation and RPC (for the benchmark's in-process methods)."""
import time

from batchspec.runtime import models, wire
from batchspec.runtime import runner as runner_lib
from batchspec.runtime.rows import ProposeRow, VerifyRow
from coordinator.clients import Answered, ModelInfo, Proposal, Timing, VerifyOutcome
from draft_service import proposer
from target_service import verifier


def _timing(group, started: float) -> Timing:
    """A command's Timing from its group forward, or a list of them (plain steps)."""
    groups = group if isinstance(group, list) else [group]
    return Timing(time.perf_counter() - started, sum(g.realign_seconds for g in groups),
                  sum(g.forward_seconds for g in groups))


class _InProcess:
    def __init__(self, runner: runner_lib.ModelRunner, name: str):
        self.runner = runner
        self.address = name
        self.instance = None  # one instance for the life of this process

    def reset(self) -> None:
        pass

    def close(self) -> None:
        pass

    def probe(self, timeout: float | None = None) -> Answered:
        """Answered at once: the runner lives in this process."""
        return Answered(self.describe())

    def describe(self, timeout: float = 0.0) -> ModelInfo:
        r = self.runner
        return ModelInfo(r.name, r.vocab_size, r.eos_token_ids, r.max_context_len,
                         len(r.caches), r.num_cached_tokens(),
                         tuple((c.rows, c.tokens, c.seconds) for c in r.step_costs),
                         str(r.device), feature_width=self.feature_width,
                         calibrated=models.calibrated(r.model))

    @property
    def feature_width(self) -> int:
        return self.runner.reads_features

    def prefill(self, entries, copies=None, features=None):
        if features:  # a feature head: each token's features, as the wire carries them
            return self.runner.prefill(entries, {
                s: wire.features_tensor(f, f"sequence {s}") for s, f in features.items()})
        return (self.runner.prefill_copies(entries, copies) if copies
                else self.runner.prefill(entries))

    def trim(self, entries):
        return self.runner.trim(entries)

    def release(self, seq_ids):
        return self.runner.release(seq_ids)


class InProcessDraft(_InProcess):
    def propose(self, num_drafts, realign, specs, timeout=None, min_confidence=0.0):
        started = time.perf_counter()
        rows = [ProposeRow(s.seq_id, s.expected_cache_len, s.keep_len,
                                    list(s.append_token_ids), s.sampling,
                                    None if s.features is None
                                    else wire.features_tensor(s.features, "propose"))
                for s in specs]
        proposals, group = proposer.propose(self.runner, rows, num_drafts, realign=realign,
                                            min_confidence=min_confidence)
        return [Proposal(p.seq_id, p.draft_token_ids, p.cache_len, p.cut)
                for p in proposals], _timing(group, started)


class InProcessTarget(_InProcess):
    # a draft reads the target's features (set by the coordinator's peers)
    features_for_drafts = False

    @property
    def feature_width(self) -> int:
        return self.runner.hidden_size

    def prefill(self, entries, copies=None, features=None, return_features=False):
        if not return_features:
            return super().prefill(entries, copies, features)
        lens, kept = self.runner.prefill_features(entries, keep=True)
        return lens, [wire.features_message(kept[s]) for s, _ in entries]

    def features(self, prefixes):
        return [wire.features_message(f)
                for f in self.runner.features([t for _, t in prefixes])]

    def verify(self, realign, specs, timeout=None, return_features=None, plain_steps=1,
               rounds=1):
        if rounds > 1:  # (the in-process engine hosts no draft and runs no lines)
            raise ValueError("the in-process target runs one round a verify")
        if return_features is None:
            return_features = self.features_for_drafts
        started = time.perf_counter()
        rows = [VerifyRow(s.seq_id, s.expected_cache_len, list(s.append_token_ids),
                          list(s.draft_token_ids), s.sampling, output_counts=s.output_counts)
                for s in specs]
        outcomes, groups = verifier.decode(self.runner, rows, plain_steps, realign=realign,
                                           keep_features=return_features)
        return [VerifyOutcome(o.seq_id, o.num_accepted, o.output_token_ids, o.cache_len,
                              features=None if o.features is None
                              else wire.features_message(o.features))
                for o in outcomes], _timing(groups, started)
