"""The one place the model services convert between protobuf and their own types
(`batchspec.v1` cache, target and draft messages; the types: rows.py, SamplingParams, the
runner's lists and tensors). A servicer converts a command here, calls the runner, the verifier
or the proposer, and converts the result here; nothing else in a service reads or builds a
message.

torch is imported only where a tensor is made or read (features, token masks), so the n-gram
draft, which never sees either, serves without it.
"""
from batchspec import errors
from batchspec.params import SamplingParams, logit_adjustments
from batchspec.runtime.rows import ProposedRow, ProposeRow, VerifiedRow, VerifyRow
from batchspec.v1 import cache_pb2, draft_pb2, target_pb2


# ---- both services --------------------------------------------------------------------------
def sampling(params: cache_pb2.SamplingParams, vocab_size: int | None = None) -> SamplingParams:
    """The settings; logit_bias's token ids are checked against `vocab_size` where given (the
    target's: a draft ignores the bias)."""
    if params.temperature < 0 or params.top_k < 0 or not 0 <= params.top_p <= 1:
        raise errors.InvalidArgument("sampling: temperature >= 0, top_k >= 0, top_p in (0, 1]")
    wrong = logit_adjustments(params.presence_penalty, params.frequency_penalty,
                              dict(params.logit_bias), vocab_size)
    if wrong is not None:
        raise errors.InvalidArgument(f"sampling: {wrong[1]}")
    return SamplingParams(temperature=params.temperature, top_k=params.top_k,
                          top_p=params.top_p or 1.0, seed=params.seed,
                          presence_penalty=params.presence_penalty,
                          frequency_penalty=params.frequency_penalty,
                          logit_bias=tuple(sorted(params.logit_bias.items())))


def timing(compute_s: float, realign_s: float = 0.0,
           forward_s: float | None = None) -> cache_pb2.CommandTiming:
    """How a command spent its time (forward_s: its forwards', default all of compute_s)."""
    return cache_pb2.CommandTiming(compute_seconds=compute_s, realign_seconds=realign_s,
                                   forward_seconds=compute_s if forward_s is None else forward_s)


def error(raised: BaseException) -> cache_pb2.CommandError:
    code = errors.to_status_code(raised)
    return cache_pb2.CommandError(code=errors.code_number(code), message=str(raised),
                                  reason=errors.reason_of(raised))


def model_info(runner, dtype: str, gate, feature_width: int,
               calibrated: bool) -> cache_pb2.ModelInfo:
    """Describe's answer for a service's runner (a CacheBook) and its gate (service.Gate)."""
    return cache_pb2.ModelInfo(model=runner.name, vocab_size=runner.vocab_size,
                               feature_width=feature_width, vocabulary=runner.vocabulary,
                               calibrated=calibrated,
                               instance_id=gate.instance_id, draining=gate.draining.is_set(),
                               max_sequences=gate.max_sequences,
                               max_cached_tokens=gate.max_cached_tokens,
                               eos_token_ids=runner.eos_token_ids,
                               max_context_len=runner.max_context_len,
                               num_sequences=len(runner.caches),
                               num_cached_tokens=runner.num_cached_tokens(),
                               device=str(runner.device), dtype=dtype,
                               packs_positions=getattr(runner, "packs_positions", False),
                               step_costs=[cache_pb2.StepCost(rows=c.rows, tokens=c.tokens,
                                                              context=c.context,
                                                              seconds=c.seconds)
                                           for c in runner.step_costs])


def prefill_entries(command: cache_pb2.PrefillCommand) -> list[tuple[int, list[int]]]:
    return [(e.seq_id, list(e.token_ids)) for e in command.entries]


def prefill_copies(command: cache_pb2.PrefillCommand) -> dict[int, int]:
    """seq_id -> the sequence whose cache it starts from, for entries that name one."""
    return {e.seq_id: e.copy_from for e in command.entries if e.HasField("copy_from")}


def prefill_features(command: cache_pb2.PrefillCommand) -> dict:
    """seq_id -> [positions, width] features, for entries that carry them."""
    return {e.seq_id: features_tensor(e.features, f"sequence {e.seq_id}")
            for e in command.entries if e.HasField("features")}


def prefill_result(lens: list[int], features=None,
                   prompt_logprobs=None) -> cache_pb2.PrefillResult:
    """features: per entry a [positions, width] tensor; prompt_logprobs: per entry a list of
    logprobs.TokenLogprobs."""
    return cache_pb2.PrefillResult(
        cache_lens=lens,
        features=[features_message(f) for f in features] if features is not None else None,
        prompt_logprobs=None if prompt_logprobs is None else [
            cache_pb2.PromptLogprobs(tokens=logprobs_messages(scored))
            for scored in prompt_logprobs])


def trim_entries(command: cache_pb2.TrimCommand) -> list[tuple[int, int, int]]:
    return [(e.seq_id, e.expected_cache_len, e.keep_len) for e in command.entries]


def trim_result(lens: list[int]) -> cache_pb2.TrimResult:
    return cache_pb2.TrimResult(cache_lens=lens)


def release_result(remaining: int) -> cache_pb2.ReleaseResult:
    return cache_pb2.ReleaseResult(num_sequences=remaining)


def features_message(values) -> cache_pb2.Features:
    """[positions, width] float tensor -> Features (float16, row-major)."""
    import torch

    half = values.detach().to("cpu", torch.float16).contiguous()
    rows, width = half.shape
    return cache_pb2.Features(num_positions=rows, width=width,
                              values_f16=half.numpy().astype("<f2").tobytes())


def features_tensor(message: cache_pb2.Features, what: str):
    """Features -> [positions, width] float32 tensor; InvalidArgument when the payload does
    not hold num_positions x width float16 values."""
    import numpy as np
    import torch

    expected = 2 * message.num_positions * message.width
    if len(message.values_f16) != expected:
        raise errors.InvalidArgument(
            f"{what}: features of {message.num_positions} x {message.width} need {expected} "
            f"bytes, not {len(message.values_f16)}")
    values = np.frombuffer(message.values_f16, dtype="<f2").astype(np.float32)
    return torch.from_numpy(values.reshape(message.num_positions, message.width).copy())


def logprobs_messages(scored) -> list[cache_pb2.TokenLogprobs]:
    """logprobs.TokenLogprobs -> their messages."""
    return [cache_pb2.TokenLogprobs(logprob=t.logprob, top_token_ids=t.top_token_ids,
                                    top_logprobs=t.top_logprobs) for t in scored]


# ---- the target -----------------------------------------------------------------------------
def scoring(command: cache_pb2.PrefillCommand) -> dict[int, tuple[int, int]]:
    """seq_id -> (num_top, next_token_id) for the entries that ask their prompt's
    log-probabilities."""
    return {e.seq_id: (e.prompt_logprobs.num_top, e.next_token_id)
            for e in command.entries if e.HasField("prompt_logprobs")}


def verify_rows(command: target_pb2.VerifyCommand, vocab_size: int,
                proposed: dict[int, list[int]] | None = None) -> list[VerifyRow]:
    """proposed: what a hosted draft proposed first (VerifyCommand.propose), by sequence; an
    entry with num_proposed verifies the first num_proposed of its sequence's tokens there."""
    return [_verify_row(entry, vocab_size, proposed) for entry in command.entries]


def _verify_row(entry: target_pb2.VerifyEntry, vocab_size: int,
                proposed: dict[int, list[int]] | None) -> VerifyRow:
    from batchspec.runtime import logprobs

    drafts = list(entry.draft_token_ids)
    if entry.num_proposed:
        if drafts or entry.token_masks:
            raise errors.InvalidArgument(
                f"sequence {entry.seq_id}: an entry that verifies a hosted proposal "
                "(num_proposed) carries no draft_token_ids or token_masks")
        if proposed is None:
            raise errors.InvalidArgument(
                f"sequence {entry.seq_id}: num_proposed without a propose in the command")
        drafts = proposed.get(entry.seq_id, [])[:entry.num_proposed]
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
            masks = token_masks(list(entry.token_masks), vocab_size)
        except ValueError as raised:
            raise errors.InvalidArgument(f"sequence {entry.seq_id}: {raised}") from raised
    params = sampling(entry.sampling, vocab_size)
    counts = None
    if params.penalized:
        counts = dict(entry.output_token_counts)
        if any(not 0 <= t < vocab_size for t in counts):
            raise errors.InvalidArgument(
                f"sequence {entry.seq_id}: output_token_counts names a token outside the "
                f"vocabulary [0, {vocab_size})")
    return VerifyRow(seq_id=entry.seq_id, expected_cache_len=entry.expected_cache_len,
                     append_token_ids=list(entry.append_token_ids),
                     draft_token_ids=drafts, sampling=params, num_top=num_top,
                     token_masks=masks, output_counts=counts,
                     continuation=list(entry.continuation_token_ids),
                     ignore_eos=entry.ignore_eos)


def token_masks(masks: list[bytes], vocab_size: int):
    """Wire masks (bit t % 8 of byte t // 8 allows token t) as [len(masks), vocab] bools.
    Raises ValueError for a mask too short for the vocabulary or allowing no token."""
    import torch

    need = (vocab_size + 7) // 8
    if any(len(m) < need for m in masks):
        raise ValueError(f"a token mask is shorter than the vocabulary's {need} bytes")
    raw = torch.frombuffer(bytearray(b"".join(m[:need] for m in masks)),
                           dtype=torch.uint8).reshape(len(masks), need)
    bits = (raw[..., None] >> torch.arange(8, dtype=torch.uint8)) & 1
    allowed = bits.reshape(len(masks), need * 8)[:, :vocab_size].bool()
    if not allowed.any(dim=1).all():
        raise ValueError("a token mask allows no token")
    return allowed


def verify_result(outcomes: list[VerifiedRow], spent: cache_pb2.CommandTiming,
                  rounds: list[list[tuple[int, int]]] | None = None) -> target_pb2.VerifyResult:
    """rounds: per outcome, (drafts, accepted) of each round (VerifyCommand.rounds)."""
    return target_pb2.VerifyResult(timing=spent, entries=[
        target_pb2.VerifyResultEntry(seq_id=o.seq_id, num_accepted=o.num_accepted,
                                     output_token_ids=o.output_token_ids, cache_len=o.cache_len,
                                     logprobs=logprobs_messages(o.logprobs or []),
                                     features=None if o.features is None
                                     else features_message(o.features),
                                     round_drafts=[d for d, _ in run],
                                     round_accepted=[a for _, a in run])
        for o, run in zip(outcomes, rounds or [[]] * len(outcomes))])


def feature_prefixes(command: target_pb2.FeaturesCommand) -> list[list[int]]:
    return [list(e.token_ids) for e in command.entries]


def features_result(values) -> target_pb2.FeaturesResult:
    """values: per entry a [positions, width] tensor."""
    return target_pb2.FeaturesResult(features=[features_message(f) for f in values])


# ---- the drafts -----------------------------------------------------------------------------
def propose_rows(command: draft_pb2.ProposeCommand) -> list[ProposeRow]:
    return [ProposeRow(e.seq_id, e.expected_cache_len, e.keep_len, list(e.append_token_ids),
                       sampling(e.sampling),
                       features_tensor(e.features, f"sequence {e.seq_id}")
                       if e.HasField("features") else None)
            for e in command.entries]


def propose_result(proposals: list[ProposedRow],
                   spent: cache_pb2.CommandTiming) -> draft_pb2.ProposeResult:
    return draft_pb2.ProposeResult(timing=spent, entries=[
        draft_pb2.ProposeResultEntry(seq_id=p.seq_id, draft_token_ids=p.draft_token_ids,
                                     cache_len=p.cache_len, cut=p.cut)
        for p in proposals])
