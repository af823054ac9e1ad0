"""The model services' own types of a command's rows: what a verify or a proposal takes and
gives per sequence. `wire.py` converts them from and to protobuf; the verifier
(target_service/verifier.py) and the proposer (draft_service/proposer.py) compute with them.
No torch here (the n-gram draft serves without it): tensors are only annotated."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

from batchspec.params import SamplingParams

if TYPE_CHECKING:
    import torch

    from batchspec.runtime.logprobs import TokenLogprobs


@dataclasses.dataclass(frozen=True)
class VerifyRow:
    seq_id: int
    expected_cache_len: int
    append_token_ids: list[int]  # committed tokens not yet cached (normally the last one)
    draft_token_ids: list[int]  # this row's drafted tokens (0..K)
    sampling: SamplingParams
    num_top: int | None = None  # log-probabilities of the outputs (and num_top alternatives)
    # structured output: [K + 1, vocab] True where a token may be output j; None: any token
    token_masks: torch.Tensor | None = None
    # with a presence or frequency penalty: {token id: times output} before the first output
    output_counts: dict[int, int] | None = None
    # a verify of rounds: what a lookup's draft goes on with after draft_token_ids
    continuation: list[int] = dataclasses.field(default_factory=list)
    ignore_eos: bool = False  # it goes on past an end-of-sequence token (rounds go on)


@dataclasses.dataclass(frozen=True)
class VerifiedRow:
    seq_id: int
    num_accepted: int
    output_token_ids: list[int]  # accepted drafts + the recovered or bonus token
    cache_len: int
    logprobs: list[TokenLogprobs] | None = None  # one per output token
    # [positions cached by this verify, hidden] their features (with keep_features)
    features: torch.Tensor | None = None


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
class ProposedRow:
    seq_id: int
    draft_token_ids: list[int]
    cache_len: int
    cut: bool = False  # min_confidence ended it before num_drafts
