"""The draft's K-step proposal loop over a group."""
import dataclasses

import torch

from batchspec import errors
from batchspec.params import SamplingParams
from batchspec.runtime import probs_wire, sampling
from batchspec.runtime import runner as runner_lib
from batchspec.runtime.sampling import sampling_uniforms

DRAFT_STREAM = 0


@dataclasses.dataclass(frozen=True)
class ProposeRow:
    seq_id: int
    expected_cache_len: int
    keep_len: int
    append_token_ids: list[int]  # committed tokens after keep_len, ending with the last one
    sampling: SamplingParams
    # a feature head: the target's features of the position before each appended token
    # [len(append_token_ids), width]; None for other drafts
    features: torch.Tensor | None = None


@dataclasses.dataclass(frozen=True)
class Proposal:
    seq_id: int
    draft_token_ids: list[int]
    draft_probs: list[tuple[list[int], bytes]]  # wire form per drafted token; empty if greedy
    cache_len: int
    cut: bool = False  # min_confidence ended it before num_drafts


def propose(runner: runner_lib.ModelRunner, rows: list[ProposeRow], num_drafts: int, *,
            realign: bool, min_confidence: float = 0.0):
    """Draft up to num_drafts tokens per row: one forward for the appended tokens, then one per
    draft but the last. Cache on return: keep_len + appended + drafted - 1 positions, drafted
    being the forwards run (the last draft is never fed; it is cached next step if accepted).

    min_confidence > 0 cuts each greedy row's draft before its first token at which the
    draft's probability of the whole draft so far (the product of its tokens' probabilities,
    which tracks how often the target accepts all of them) falls below min_confidence; a row
    may propose nothing. The forwards stop once every row is cut. Sampled rows are never cut
    (their drafts are what the rejection sampler weighs). Draft-side information only, so
    outputs are unchanged."""
    if num_drafts < 1:
        raise errors.InvalidArgument("num_draft_tokens must be >= 1")
    if not 0.0 <= min_confidence <= 1.0:
        raise errors.InvalidArgument(
            f"min_draft_confidence must be in [0, 1], not {min_confidence}")
    specs = [runner_lib.RowSpec(r.seq_id, r.expected_cache_len, r.keep_len, r.append_token_ids)
             for r in rows]
    runner.check_features([(r.seq_id, r.append_token_ids) for r in rows],
                          {r.seq_id: r.features for r in rows if r.features is not None})
    group = runner.open_group(specs, realign=realign, extra_positions=num_drafts - 1)
    # a feature head reads the target's features of the appended tokens, then its own
    features = torch.stack([r.features for r in rows]) if runner.reads_features else None
    all_greedy = all(r.sampling.greedy for r in rows)
    next_input = torch.tensor([r.append_token_ids for r in rows])
    first_position = [r.keep_len + len(r.append_token_ids) for r in rows]
    drafts, wires = [], [[] for _ in rows]
    cut = _Cut(rows, num_drafts, min_confidence)
    for j in range(num_drafts):  # the last draft is never fed
        logits = group.step(next_input, num_logits=1, features=features)[:, -1]  # [batch, vocab]
        if features is not None:
            features = group.hidden[:, -1:]
        if all_greedy:
            token_ids = logits.argmax(-1)
        else:
            token_ids = sample_rows(rows, logits, [p + j for p in first_position], wires)
        drafts.append(token_ids)
        next_input = token_ids[:, None]
        if cut.after(j, logits):
            break
    cache_lens = [p + len(drafts) - 1 for p in first_position]
    runner.store([r.seq_id for r in rows], group.rows_after(cache_lens))
    stacked = torch.stack(drafts, dim=1).tolist()  # [batch, forwards run]
    proposals = [Proposal(r.seq_id, d[:n], w, c, n < num_drafts)
                 for r, d, w, c, n in zip(rows, stacked, wires, cache_lens, cut.lengths)]
    return proposals, group


class _Cut:
    """Where each row's draft ends under min_confidence (see `propose`)."""

    def __init__(self, rows: list[ProposeRow], num_drafts: int, min_confidence: float):
        self.lengths = [num_drafts] * len(rows)  # invariant: a row's draft is d[:length]
        self.min_confidence = min_confidence
        self.greedy = torch.tensor([r.sampling.greedy for r in rows])
        self.sure = torch.ones(len(rows))  # the product of each row's drafts' probabilities
        self.open = self.greedy & (min_confidence > 0.0)  # rows not cut yet

    def after(self, j: int, logits: torch.Tensor) -> bool:
        """Weigh draft j of every row; True when no further forward is needed."""
        if not bool(self.open.any()):
            return False
        self.sure *= top_probability(logits.float()).cpu()
        for i in torch.nonzero(self.open & (self.sure < self.min_confidence)).flatten().tolist():
            self.lengths[i] = j
            self.open[i] = False
        return bool(self.greedy.all()) and not bool(self.open.any())


def top_probability(logits: torch.Tensor) -> torch.Tensor:
    """[batch, vocab] logits -> [batch] probability of the argmax token."""
    return 1.0 / torch.exp(logits - logits.max(-1, keepdim=True).values).sum(-1)


def sample_rows(rows, logits, positions, wires) -> torch.Tensor:
    """Sample one draft token per row from its processed distribution, as sent on the wire."""
    probs = sampling.rows_probs(logits[:, None], [r.sampling for r in rows])[:, 0]  # [batch, vocab]
    chosen = []
    for i, row in enumerate(rows):
        if row.sampling.greedy:
            chosen.append(int(probs[i].argmax()))
            continue
        sent, token_ids, payload = probs_wire.wire_round_trip(probs[i])
        wires[i].append((token_ids, payload))
        u = sampling_uniforms(row.sampling.seed, [positions[i]], DRAFT_STREAM)
        chosen.append(int(sampling.sample_inverse_cdf(sent[None],
                                                      torch.tensor(u, device=sent.device))[0]))
    return torch.tensor(chosen)
