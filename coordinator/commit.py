"""Committing one row's verification: its tokens, its text, and the event its client reads.

Invariant kept: after `commit`, the target's record equals what the target answered, and the
sequence holds every token the target committed (up to a stop token, max_new_tokens, or the
token that completes a stop string in the text).
"""
from batchspec import errors
from coordinator.clients import VerifyOutcome
from coordinator.requests import Event, RequestHandle
from coordinator.sequence import Finish, Sequence
from coordinator.telemetry import Telemetry


def check(seq: Sequence, outcome: VerifyOutcome) -> None:
    """The target answered this row, and holds what it should: committed_len - 1 positions
    before the step, plus every output but the last (the drafts it accepted, or all but the
    last token of several plain steps)."""
    expected = seq.committed_len + len(outcome.output_token_ids) - 1
    if outcome.seq_id != seq.seq_id or outcome.cache_len != expected or \
            len(outcome.output_token_ids) <= outcome.num_accepted:
        raise errors.FailedPrecondition(
            f"target answered seq {outcome.seq_id} with cache {outcome.cache_len}; expected "
            f"seq {seq.seq_id} with {expected}")


def commit(handle: RequestHandle, outcome: VerifyOutcome, num_drafts: int, step: int,
           telemetry: Telemetry) -> bool:
    """Apply a checked verification to its sequence and stream it out; True when the
    sequence finished. num_drafts: the drafts the row verified."""
    seq = handle.seq
    keep_features(seq, outcome)
    seq.target.cache_len = outcome.cache_len
    seq.stats.num_drafted_tokens += num_drafts
    seq.stats.num_accepted_tokens += outcome.num_accepted
    # one pass a step: a verify is one, plain steps one a token
    passes = len(outcome.output_token_ids) - outcome.num_accepted
    seq.stats.num_target_forward_passes += passes
    seq.last_step = step
    committed = seq.commit(outcome.output_token_ids)
    accepted = min(outcome.num_accepted, len(committed))
    draft_text = text_of(seq, committed[:accepted], last=False) if accepted else ""
    text = draft_text + text_of(seq, committed[accepted:])
    if seq.text is not None and seq.text.unused:  # (taken: each is cut once)
        unused, seq.text.unused = seq.text.unused, 0
        seq.cut_at_stop_string(unused)
        committed = committed[:len(committed) - unused]
        accepted = min(accepted, len(committed))
    telemetry.committed(handle, len(committed),
                        outcome.rounds or ((num_drafts, outcome.num_accepted),))
    if seq.finish is not None:  # recorded before the client can see its last event
        telemetry.finished(handle)
    prompt_logprobs, seq.prompt_logprobs = seq.prompt_logprobs, None  # the first event's
    handle.events.put(Event(committed, finish=seq.finish, text=text, num_drafted=num_drafts,
                            num_accepted=accepted, num_passes=passes, draft_text=draft_text,
                            logprobs=None if outcome.logprobs is None
                            else outcome.logprobs[:len(committed)],
                            prompt_logprobs=prompt_logprobs))
    return seq.finish is not None


def keep_features(seq: Sequence, outcome: VerifyOutcome) -> None:
    """Extend the sequence's feature log by the positions this verify cached; drop it when
    the rows would not line up (it is asked of the target again when a draft needs it)."""
    if seq.features is None:
        return
    lined_up = outcome.features is not None and seq.features.length == seq.target.cache_len
    if not (lined_up and seq.features.extend(outcome.features)):
        seq.features = None


def text_of(seq: Sequence, committed: list[int], last: bool = True) -> str:
    """The text of newly committed tokens (O(new tokens)); a stop string ends the
    sequence, and the end of a sequence sends the text held back until then (on the
    step's last call: `last`)."""
    if seq.text is None:
        return ""
    text = seq.text.feed(committed)
    if seq.text.stopped:
        seq.finish = seq.finish or Finish.STOP_STRING
    elif seq.finish is not None and last:
        text += seq.text.flush()
    return text
