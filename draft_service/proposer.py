"""The draft's K-step proposal loop over a group."""

import torch

from batchspec import errors
from batchspec.runtime import runner as runner_lib
from batchspec.runtime import sampling
from batchspec.runtime.rows import ProposedRow, ProposeRow


def propose(runner: runner_lib.ModelRunner, rows: list[ProposeRow], num_drafts: int, *,
            realign: bool, min_confidence: float = 0.0):
    """Draft up to num_drafts tokens per row: one forward for the appended tokens, then one per
    draft but the last. Cache on return: keep_len + appended + drafted - 1 positions, drafted
    being the forwards run (the last draft is never fed; it is cached next step if accepted).

    Each draft is the draft's choice (sampling.choose): its argmax for a greedy row, for a
    sampled row the Gumbel-max sample of its own processed distribution with the noise of the
    request's seed and the draft's position, which the target's choice there shares.

    min_confidence > 0 cuts each row's draft before its first token at which the draft's
    confidence in the whole draft so far (the product of each position's top probability, the
    softmax of its logits, which tracks how often the target accepts all of them, greedy or
    sampled) falls below min_confidence; a row may propose nothing. The forwards stop once
    every row is cut. Draft-side information only, so outputs are unchanged."""
    check_options(num_drafts, min_confidence)
    specs = [runner_lib.RowSpec(r.seq_id, r.expected_cache_len, r.keep_len, r.append_token_ids)
             for r in rows]
    runner.check_features([(r.seq_id, r.append_token_ids) for r in rows],
                          {r.seq_id: r.features for r in rows if r.features is not None})
    group = runner.open_group(specs, realign=realign, extra_positions=num_drafts - 1)
    # a feature head reads the target's features of the appended tokens, then its own
    features = torch.stack([r.features for r in rows]) if runner.reads_features else None
    params = [r.sampling for r in rows]
    next_input = torch.tensor([r.append_token_ids for r in rows])
    first_position = [r.keep_len + len(r.append_token_ids) for r in rows]
    drafts = []
    cut = _Cut(rows, num_drafts, min_confidence)
    # every step in one call where the runner has the loop
    looped = runner.draft_loop is not None and group.draft_steps(
        next_input, num_drafts, params, cut.sure, cut.min_confidence, features)
    for j, (token_ids, sure) in enumerate(zip(*(t.unbind(1) for t in looped or ()))):
        if cut.open_any:
            cut.after(j, sure)
        drafts.append(token_ids)
    for j in range(0 if looped else num_drafts):  # the last draft is never fed
        logits = group.step(next_input, num_logits=1, features=features)  # [batch, 1, vocab]
        if features is not None:
            features = group.hidden[:, -1:]
        token_ids = sampling.choose(logits, params, [p + j for p in first_position],
                                    token_ids=runner.logit_token_ids)[:, 0]
        if cut.open_any:
            cut.after(j, top_probability(logits[:, -1].float()))
        drafts.append(token_ids)
        next_input = token_ids[:, None]
        if cut.done:
            break
    cache_lens = [p + len(drafts) - 1 for p in first_position]
    runner.store([r.seq_id for r in rows], group.rows_after(cache_lens))
    stacked = torch.stack(drafts, dim=1).tolist()  # [batch, forwards run]
    proposals = [ProposedRow(r.seq_id, d[:n], c, n < num_drafts)
                 for r, d, c, n in zip(rows, stacked, cache_lens, cut.lengths)]
    return proposals, group


def check_options(num_drafts: int, min_confidence: float) -> None:
    """Refuse a proposal's settings out of range (InvalidArgument)."""
    if num_drafts < 1:
        raise errors.InvalidArgument("num_draft_tokens must be >= 1")
    if not 0.0 <= min_confidence <= 1.0:
        raise errors.InvalidArgument(
            f"min_draft_confidence must be in [0, 1], not {min_confidence}")


def top_probability(logits: torch.Tensor) -> torch.Tensor:
    """[batch, vocab] logits -> [batch] probability of the argmax token. The draft's
    confidence at a position, for sampled rows too: the target accepts a seeded sample where
    its own choice with the same noise is the draft's, which tracks how peaked the draft is
    (this), not how probable the sampled token alone was."""
    return 1.0 / torch.exp(logits - logits.max(-1, keepdim=True).values).sum(-1)


class _Cut:
    """Where each row's draft ends under min_confidence (see `propose`)."""

    def __init__(self, rows: list[ProposeRow], num_drafts: int, min_confidence: float):
        self.lengths = [num_drafts] * len(rows)  # invariant: a row's draft is d[:length]
        self.min_confidence = min_confidence
        self.sure = torch.ones(len(rows))  # the product of each row's drafts' confidences
        self.open = [min_confidence > 0.0] * len(rows)  # rows not cut yet

    @property
    def open_any(self) -> bool:
        return any(self.open)

    @property
    def done(self) -> bool:
        """Every row is cut: no further forward is needed."""
        return self.min_confidence > 0.0 and not self.open_any

    def after(self, j: int, probabilities: torch.Tensor) -> None:
        """Weigh draft j of every row, given the draft's confidence there [batch]."""
        self.sure *= probabilities.float().cpu()
        for i in torch.nonzero(self.sure < self.min_confidence).flatten().tolist():
            if self.open[i]:
                self.lengths[i] = j
                self.open[i] = False
