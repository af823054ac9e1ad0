"""The pure verification and sampling functions, on hand-built tensors (100.0 marks the
wanted token)."""
import math
import os

import numpy as np
import pytest
import torch

from batchspec.params import SamplingParams
from batchspec.runtime import gguf_blocks, sampling


def logits_for(token_rows, vocab=8):
    """[batch, T, vocab] logits whose argmax at each position is the given token."""
    out = torch.zeros(len(token_rows), len(token_rows[0]), vocab)
    for b, row in enumerate(token_rows):
        for t, token in enumerate(row):
            out[b, t, token] = 100.0
    return out


def test_verification_accepts_the_matching_prefix_then_the_targets_choice():
    drafts = torch.tensor([[1, 2, 3], [1, 5, 3], [4, 2, 3]])
    choices = logits_for([[1, 2, 3, 7], [1, 2, 3, 7], [1, 2, 3, 7]]).argmax(-1)
    result = sampling.verify_choices(drafts, choices)
    assert result.num_accepted.tolist() == [3, 1, 0]
    outputs = [row[:n + 1] for row, n in zip(result.output_token_ids.tolist(),
                                             result.num_accepted.tolist())]
    assert outputs == [[1, 2, 3, 7], [1, 2], [1]]  # bonus 7 only when all three match


def test_verification_rejects_after_a_mismatch_even_if_later_drafts_match():
    drafts = torch.tensor([[1, 9, 3]])
    result = sampling.verify_choices(drafts, torch.tensor([[1, 2, 3, 4]]))
    assert result.num_accepted.tolist() == [1]


def test_greedy_rows_choose_the_argmax_and_sampled_rows_only_kept_tokens():
    logits = torch.log(torch.tensor([[[0.5, 0.3, 0.15, 0.05]]])).repeat(3, 1, 1)
    params = [SamplingParams(), SamplingParams(temperature=1.0, top_k=2, seed=1),
              SamplingParams(temperature=1.0, top_p=0.7, seed=2)]
    seen = [set() for _ in params]
    for position in range(300):
        chosen = sampling.choose(logits, params, [position] * 3)[:, 0].tolist()
        for row, token in zip(seen, chosen):
            row.add(token)
    assert seen == [{0}, {0, 1}, {0, 1}]  # top_k 2 and top_p 0.7 both keep tokens 0 and 1


def test_a_sampled_choice_depends_only_on_seed_and_position():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(1, 4, 50, generator=gen)
    row = SamplingParams(temperature=0.9, top_p=0.95, seed=11)
    alone = sampling.choose(logits, [row], [20])
    # the same row next to others, its positions asked one at a time
    mates = torch.randn(2, 4, 50, generator=gen)
    batch = torch.cat([mates[:1], logits, mates[1:]])
    params = [SamplingParams(temperature=1.0, seed=3), row, SamplingParams()]
    together = sampling.choose(batch, params, [5, 20, 7])
    assert torch.equal(together[1], alone[0])
    one_by_one = [int(sampling.choose(logits[:, t:t + 1], [row], [20 + t])[0, 0])
                  for t in range(4)]
    assert one_by_one == alone[0].tolist()
    # a row read for fewer positions keeps its choices there
    assert sampling.choose(logits, [row], [20], lengths=[2])[0, :2].tolist() == \
        alone[0, :2].tolist()
    others = {tuple(sampling.choose(logits, [SamplingParams(temperature=0.9, top_p=0.95,
                                                            seed=s)], [20])[0].tolist())
              for s in range(12, 20)}
    assert len(others) > 1  # another seed, other tokens


def test_gumbel_noise_is_standard_gumbel_and_keyed_by_position():
    noise = torch.from_numpy(sampling.gumbel(7, np.arange(40)[:, None], np.arange(5000)))
    assert noise.shape == (40, 5000) and bool(torch.isfinite(noise).all())
    assert abs(noise.mean().item() - 0.5772) < 0.01  # Euler's constant
    assert abs(noise.var().item() - math.pi ** 2 / 6) < 0.05
    assert noise.max().item() <= sampling.G_MAX + 1e-5
    # a cell's variable depends on (seed, position, token) alone, not on what else is asked
    assert torch.equal(torch.from_numpy(sampling.gumbel(7, [13], np.arange(5000))), noise[13])
    assert sampling.gumbel(7, 13, 4321) == noise[13, 4321]
    assert not torch.equal(noise[13], noise[14])
    assert not torch.equal(torch.from_numpy(sampling.gumbel(8, [13], np.arange(5000))),
                           noise[13])
    assert np.array_equal(sampling.gumbel(2**64 - 1, [3], np.arange(10)),
                          sampling.gumbel(2**64 - 1, [3], np.arange(10)))  # any uint64 seed
    # neighbouring cells are not correlated
    assert abs(np.corrcoef(noise[:, :-1].flatten(), noise[:, 1:].flatten())[0, 1]) < 0.02
    assert abs(np.corrcoef(noise[:-1].flatten(), noise[1:].flatten())[0, 1]) < 0.02


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (0.8, 0.95), (0.3, 1.0), (5.0, 1.0),
                                               (1.0, 0.999)])
def test_gumbel_max_is_the_argmax_over_the_whole_vocabulary(temperature, top_p):
    """The sampler computes noise only for tokens that can win; its choice is the argmax of
    logit / temperature + g over the whole support of p', for peaked and flat distributions
    alike, and for a row alone as in a batch of rows of other settings."""
    generator = torch.Generator().manual_seed(5)
    vocab = 3000
    for scale in (0.5, 4.0, 12.0):
        logits = torch.randn(1, 6, vocab, generator=generator) * scale
        params = SamplingParams(temperature=temperature, top_p=top_p, seed=int(scale * 10))
        support = sampling.rows_logprobs(logits, [params])[0] > float("-inf")
        noise = torch.from_numpy(sampling.gumbel(params.seed, np.arange(40, 46)[:, None],
                                                 np.arange(vocab)))
        whole = (logits[0] / temperature + noise).masked_fill(~support, float("-inf"))
        whole = whole.argmax(-1)
        assert torch.equal(sampling.choose(logits, [params], [40])[0], whole)
        others = torch.randn(3, 6, vocab, generator=generator) * scale
        mates = [SamplingParams(temperature=1.0, top_k=7, seed=1), SamplingParams(),
                 SamplingParams(temperature=0.7, top_p=0.5, seed=2)]
        batch = sampling.choose(torch.cat([others[:2], logits, others[2:]]),
                                mates[:2] + [params] + mates[2:], [9, 9, 40, 9])
        assert torch.equal(batch[2], whole)


def test_sampled_choices_follow_the_processed_distribution():
    """Over 20k seeds the first choice's frequencies match p' within a total-variation
    tolerance of 0.015 (the expected TV of 20k samples over 6 outcomes is about 0.008)."""
    p = torch.tensor([0.05, 0.30, 0.10, 0.25, 0.20, 0.10])
    logits = (p.log() * 0.8)[None, None]  # temperature 0.8 gives p back
    trials = 20_000
    chosen = torch.tensor([int(sampling.choose(logits, [SamplingParams(temperature=0.8, seed=s)],
                                               [9])[0, 0]) for s in range(trials)])
    observed = torch.bincount(chosen, minlength=6).float() / trials
    assert 0.5 * (observed - p).abs().sum().item() < 0.015, observed


def test_a_draft_sampling_with_the_same_noise_is_accepted_by_coupling():
    """Drafts drawn from q with the target's noise: the output is the target's own choice
    whatever q is (drafter invariance), and a draft is accepted at least (1 - TV) / (1 + TV)
    of the time (the Gumbel coupling's bound), far more often than an independent draw."""
    p = torch.tensor([0.05, 0.30, 0.10, 0.25, 0.20, 0.10])
    q = torch.tensor([0.10, 0.25, 0.10, 0.30, 0.15, 0.10])
    tv = 0.5 * (p - q).abs().sum().item()
    trials, accepted, independent = 4000, 0, 0
    for seed in range(trials):
        params = [SamplingParams(temperature=1.0, seed=seed)]
        draft = sampling.choose(q.log()[None, None], params, [4])[0]
        choices = sampling.choose(p.log()[None, None].repeat(1, 2, 1), params, [4])
        result = sampling.verify_choices(draft[None], choices)
        assert int(result.output_token_ids[0, 0]) == int(choices[0, 0])
        accepted += int(result.num_accepted)
        shifted = sampling.choose(q.log()[None, None], params, [5])[0]  # other noise
        independent += int(shifted[0] == choices[0, 0])
    assert accepted / trials >= (1 - tv) / (1 + tv) - 0.02, accepted / trials
    assert accepted > 1.5 * independent


def test_processed_logprobs_applies_temperature_top_k_and_top_p():
    logits = torch.log(torch.tensor([[[0.5, 0.3, 0.15, 0.05]]])).repeat(3, 1, 1)
    probs = sampling.processed_logprobs(logits, torch.tensor([1.0, 1.0, 1.0]),
                                        torch.tensor([2, 0, 0]),
                                        torch.tensor([1.0, 0.7, 1.0])).exp()
    torch.testing.assert_close(probs[0, 0], torch.tensor([0.625, 0.375, 0.0, 0.0]))
    torch.testing.assert_close(probs[1, 0], torch.tensor([0.625, 0.375, 0.0, 0.0]))  # 0.5 < 0.7
    torch.testing.assert_close(probs[2, 0], torch.tensor([0.5, 0.3, 0.15, 0.05]))
    hot = sampling.processed_logprobs(logits[:1], torch.tensor([0.5]), torch.tensor([0]),
                                      torch.tensor([1.0])).exp()
    torch.testing.assert_close(hot[0, 0], torch.tensor([0.25, 0.09, 0.0225, 0.0025]) / 0.365)


def test_processed_logprobs_handles_several_positions_per_row():
    logits = torch.randn(3, 5, 11, generator=torch.Generator().manual_seed(3))
    args = torch.tensor([0.4, 0.7, 1.3]), torch.tensor([0, 4, 0]), torch.tensor([1.0, 1.0, 0.9])
    probs = sampling.processed_logprobs(logits, *args).exp()
    assert probs.shape == (3, 5, 11)
    torch.testing.assert_close(probs.sum(-1), torch.ones(3, 5))
    assert ((probs[1] > 0).sum(-1) == 4).all()  # top_k 4 at every position
    for t in range(5):  # each position matches the single-position computation
        single = sampling.processed_logprobs(logits[:, t:t + 1], *args).exp()
        torch.testing.assert_close(probs[:, t:t + 1], single)


def test_a_row_with_fewer_drafts_is_verified_as_if_alone():
    """Ragged rows (different K per row): padding a row's drafts out to the group's K changes
    nothing."""
    gen = torch.Generator().manual_seed(3)
    vocab, width = 6, 4
    for trial in range(50):
        n = trial % (width + 1)  # the row's real drafts, 0..K
        choices = torch.randint(vocab, (1, width + 1), generator=gen)
        drafts = torch.where(torch.rand(1, width, generator=gen) < 0.7, choices[:, :width],
                             torch.randint(vocab, (1, width), generator=gen))
        padded = sampling.verify_choices(drafts, choices, num_drafts=torch.tensor([n]))
        alone = sampling.verify_choices(drafts[:, :n], choices[:, :n + 1])
        k = int(alone.num_accepted)
        assert int(padded.num_accepted) == k <= n
        assert padded.output_token_ids[0, :k + 1].tolist() == \
            alone.output_token_ids[0, :k + 1].tolist()


def sorted_reference(logits, temperature, top_k, top_p):
    """processed_logprobs written out with a full sort of every position."""
    scaled = logits.double() / temperature[:, None, None]
    vocab = scaled.shape[-1]
    sorted_logits, order = scaled.sort(dim=-1, descending=True)
    ranks = torch.arange(vocab)
    k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))
    keep = ranks[None, None, :] < k[:, None, None]
    probs = sorted_logits.masked_fill(~keep, float("-inf")).softmax(-1)
    keep = keep & (probs.cumsum(-1) - probs < top_p[:, None, None])
    kept = sorted_logits.masked_fill(~keep, float("-inf")).log_softmax(-1)
    return torch.empty_like(scaled).scatter_(-1, order, kept).float()


def test_processed_logprobs_equal_a_full_sort_for_peaked_and_flat_distributions():
    """The partial sort (the few most likely first, more only where the set runs further)
    keeps exactly the tokens a full sort keeps, for sets of a few tokens and of thousands."""
    gen = torch.Generator().manual_seed(5)
    for scale in (8.0, 3.0, 0.3):  # peaked to nearly flat
        logits = torch.randn(4, 3, 5000, generator=gen) * scale
        for top_k, top_p in ((0, 0.95), (3, 1.0), (100, 0.9), (0, 0.999), (4000, 0.5)):
            args = (torch.tensor([0.8, 1.0, 0.8, 1.3]), torch.tensor([top_k] * 4),
                    torch.tensor([top_p, top_p, 1.0, top_p]))
            ours, reference = sampling.processed_logprobs(logits, *args), \
                sorted_reference(logits, *args)
            assert torch.equal(torch.isinf(ours), torch.isinf(reference)), (scale, top_k, top_p)
            torch.testing.assert_close(ours.exp(), reference.exp(), atol=1e-6, rtol=1e-4)


def test_choices_over_a_drafts_own_vocabulary_equal_those_over_the_whole():
    """A draft that scores only its vocabulary (logits over token_ids) chooses what it would
    choose over the whole vocabulary with every other token at -inf: greedy, top-p, top-k,
    temperature 1 alike, the noise going by token."""
    generator = torch.Generator().manual_seed(11)
    vocab, own = 500, torch.tensor(sorted(torch.randperm(500, generator=generator)[:120]
                                          .tolist()))
    params = [SamplingParams(), SamplingParams(temperature=1.0, seed=4),
              SamplingParams(temperature=0.8, top_p=0.9, seed=5),
              SamplingParams(temperature=1.2, top_k=5, seed=6)]
    for scale in (0.3, 3.0, 10.0):
        compact = torch.randn(4, 3, len(own), generator=generator) * scale
        whole = torch.full((4, 3, vocab), float("-inf"))
        whole[..., own] = compact
        chosen = sampling.choose(compact, params, [7, 8, 9, 10], token_ids=own)
        assert torch.equal(chosen, sampling.choose(whole, params, [7, 8, 9, 10]))
        assert bool(torch.isin(chosen, own).all())


@pytest.mark.skipif(not gguf_blocks.load() and not os.environ.get("CI"),
                    reason="the CPU kernels cannot be built here (no compiler)")
def test_the_cpu_kernel_chooses_what_the_torch_sampler_chooses():
    """gumbel_max's one C++ pass a row (on a CPU) and its torch operations choose the same
    token for every row: peaked, flat and tied logits (whole numbers), every kind of
    setting, rows of different settings together, over the vocabulary or a draft's own.
    Ties at a top-k set's end are where the two may differ (torch's topk keeps tied tokens
    in no set order); the kernel keeps the lower tokens, so top-k 1 is the first argmax."""
    assert gguf_blocks.load(), "the CPU kernels must be built where CI runs"
    generator = torch.Generator().manual_seed(3)
    vocab = 6000
    settings = [(1.0, 0, 1.0), (0.8, 0, 0.95), (0.6, 0, 0.9), (1.0, 40, 1.0), (0.7, 20, 0.8),
                (0.3, 0, 1.0), (5.0, 0, 1.0), (1.0, 0, 0.999), (1.2, 0, 0.5), (1.0, 1, 1.0),
                (1.0, 5000, 0.99)]
    own = torch.randperm(vocab, generator=generator)[:900].sort().values
    positions = np.arange(24, dtype=np.uint64) * 7 + 3
    tied = torch.randint(-3, 3, (24, vocab), generator=generator).float()
    for logits in (torch.randn(24, vocab, generator=generator) * 0.3,
                   torch.randn(24, vocab, generator=generator) * 4.0,
                   torch.randn(24, vocab, generator=generator) * 15.0, tied):
        params = [SamplingParams(temperature=t, top_k=0 if logits is tied else k, top_p=p,
                                 seed=1000 * i + r)
                  for r in range(3) for i, (t, k, p) in enumerate(settings)][:24]
        native = sampling.gumbel_max(logits, params, positions)
        assert torch.equal(native, sampling.gumbel_max_torch(logits, params, positions))
        mine = logits[:, own].contiguous()
        assert torch.equal(sampling.gumbel_max(mine, params, positions, own),
                           sampling.gumbel_max_torch(mine, params, positions, own))
    first = [SamplingParams(temperature=1.0, top_k=1, seed=s) for s in range(24)]
    assert torch.equal(sampling.gumbel_max(tied, first, positions), tied.argmax(-1))
    # a grammar's forbidden tokens (-inf), a top-k past the vocabulary, a top-p of one token
    masked = torch.randn(5, vocab, generator=generator) * 3
    masked[0, :] = float("-inf")
    masked[0, 77] = 1.0
    masked[1, :] = float("-inf")
    masked[1, [5, 9, 12]] = torch.tensor([1.0, 2.0, 0.5])
    masked[2, ::2] = float("-inf")
    edges = [SamplingParams(temperature=0.8, top_p=0.95, seed=1),
             SamplingParams(temperature=0.8, top_k=40, top_p=0.9, seed=2),
             SamplingParams(temperature=0.7, top_k=vocab + 5, top_p=0.99, seed=4),
             SamplingParams(temperature=0.9, top_p=1e-9, seed=5),
             SamplingParams(temperature=1.0, top_k=3000, top_p=0.999999, seed=6)]
    chosen = sampling.gumbel_max(masked, edges, positions[:5])
    assert torch.equal(chosen, sampling.gumbel_max_torch(masked, edges, positions[:5]))
    assert chosen[0] == 77 and chosen[3] == masked[3].argmax()


def test_a_temperature_below_the_greedy_bound_decodes_greedily():
    """Logits over a temperature of 1e-40 leave float32's range (a sampler would see inf and
    NaN); below 1e-5 a request decodes greedily, and just above it samples."""
    logits = torch.randn(2, 3, 500, generator=torch.Generator().manual_seed(2)) * 5
    tiny = [SamplingParams(temperature=1e-40, seed=3), SamplingParams(temperature=1e-6, seed=4)]
    assert all(p.greedy for p in tiny)
    assert torch.equal(sampling.choose(logits, tiny, [5, 9]), logits.argmax(-1))
    assert not SamplingParams(temperature=2e-5, seed=1).greedy


@pytest.mark.skipif(not gguf_blocks.load() and not os.environ.get("CI"),
                    reason="the CPU kernels cannot be built here (no compiler)")
def test_the_cpu_kernel_refuses_malformed_rows_with_a_clear_error():
    logits = torch.zeros(2, 10)
    temperature, top_k, top_p = sampling.settings([SamplingParams(temperature=0.8)] * 2)
    ids = torch.zeros(2, dtype=torch.long)
    choose = torch.ops.batchspec_gguf.gumbel_choose
    with pytest.raises(RuntimeError, match="one contiguous setting per row"):
        choose(logits, temperature[:1], top_k, top_p, ids, ids, None)
    with pytest.raises(RuntimeError, match="temperature > 0"):
        choose(logits, torch.zeros(2), top_k, top_p, ids, ids, None)
    with pytest.raises(RuntimeError, match="token_ids must be"):
        choose(logits, temperature, top_k, top_p, ids, ids, torch.arange(3))
    with pytest.raises(RuntimeError, match="contiguous float32"):
        choose(logits.double(), temperature, top_k, top_p, ids, ids, None)
