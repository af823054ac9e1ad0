"""The pure verification functions, on hand-built tensors (100.0 marks the wanted token)."""
import torch

from batchspec.runtime import probs_wire, sampling


def logits_for(token_rows, vocab=8):
    """[batch, T, vocab] logits whose argmax at each position is the given token."""
    out = torch.zeros(len(token_rows), len(token_rows[0]), vocab)
    for b, row in enumerate(token_rows):
        for t, token in enumerate(row):
            out[b, t, token] = 100.0
    return out


def test_greedy_accepts_the_matching_prefix_then_the_target_token():
    drafts = torch.tensor([[1, 2, 3], [1, 5, 3], [4, 2, 3]])
    target = logits_for([[1, 2, 3, 7], [1, 2, 3, 7], [1, 2, 3, 7]])
    result = sampling.greedy_verify(drafts, target)
    assert result.num_accepted.tolist() == [3, 1, 0]
    outputs = [row[:n + 1] for row, n in zip(result.output_token_ids.tolist(),
                                             result.num_accepted.tolist())]
    assert outputs == [[1, 2, 3, 7], [1, 2], [1]]  # bonus 7 only when all three match


def test_greedy_rejects_after_a_mismatch_even_if_later_drafts_match():
    drafts = torch.tensor([[1, 9, 3]])
    result = sampling.greedy_verify(drafts, logits_for([[1, 2, 3, 4]], vocab=10))
    assert result.num_accepted.tolist() == [1]


def test_rejection_sample_with_one_hot_distributions_is_greedy():
    drafts = torch.tensor([[1, 5, 3]])
    target_probs = logits_for([[1, 2, 3, 7]]).softmax(-1).round()
    draft_probs = torch.nn.functional.one_hot(drafts, 8).float()
    result = sampling.rejection_sample(drafts, draft_probs, target_probs,
                                       torch.full((1, 3), 0.999), torch.tensor([0.5]))
    assert result.num_accepted.tolist() == [1]
    assert result.output_token_ids[0, :2].tolist() == [1, 2]


def test_rejection_sample_accepts_by_ratio_and_resamples_from_the_residual():
    vocab = 4
    q = torch.tensor([[[0.5, 0.5, 0.0, 0.0]]])  # draft picked token 0 with q = 0.5
    p = torch.tensor([[[0.25, 0.25, 0.5, 0.0], [0.0, 0.0, 0.0, 1.0]]])
    drafts = torch.tensor([[0]])
    # p/q = 0.5: u = 0.4 accepts, u = 0.6 rejects.
    accepted = sampling.rejection_sample(drafts, q, p, torch.tensor([[0.4]]), torch.tensor([0.3]))
    assert accepted.num_accepted.tolist() == [1]
    assert accepted.output_token_ids[0].tolist() == [0, 3]  # bonus from p[1]
    rejected = sampling.rejection_sample(drafts, q, p, torch.tensor([[0.6]]), torch.tensor([0.3]))
    assert rejected.num_accepted.tolist() == [0]
    # residual max(0, p - q) = [0, 0, 0.5, 0]: only token 2 can be recovered
    assert rejected.output_token_ids[0, 0].item() == 2
    assert vocab == p.shape[-1]


def test_zero_residual_falls_back_to_p_without_dividing_by_zero():
    # p <= q everywhere (rounding can do this to a rejected row): max(0, p - q) is all zero.
    q = torch.tensor([[[0.0, 1.0, 0.0]]])
    p = torch.tensor([[[0.0, 0.5, 0.0], [1.0, 0.0, 0.0]]])
    result = sampling.rejection_sample(torch.tensor([[1]]), q, p, torch.tensor([[0.9]]),
                                       torch.tensor([0.5]))
    assert result.num_accepted.tolist() == [0]
    assert result.output_token_ids[0, 0].item() == 1  # sampled from p itself


def test_inverse_cdf_never_returns_a_zero_weight_token():
    weights = torch.tensor([[0.0, 0.3, 0.0, 0.7, 0.0]]).repeat(3, 1)
    picked = sampling.sample_inverse_cdf(weights, torch.tensor([1e-12, 0.3, 1.0]))
    assert picked.tolist() == [1, 1, 3]


def test_processed_probs_applies_temperature_top_k_and_top_p():
    logits = torch.log(torch.tensor([[[0.5, 0.3, 0.15, 0.05]]])).repeat(4, 1, 1)
    probs = sampling.processed_probs(logits, torch.tensor([0.0, 1.0, 1.0, 1.0]),
                                     torch.tensor([0, 2, 0, 0]), torch.tensor([1.0, 1.0, 0.7, 1.0]))
    assert probs[0, 0].tolist() == [1.0, 0.0, 0.0, 0.0]  # greedy: one-hot argmax
    torch.testing.assert_close(probs[1, 0], torch.tensor([0.625, 0.375, 0.0, 0.0]))
    torch.testing.assert_close(probs[2, 0], torch.tensor([0.625, 0.375, 0.0, 0.0]))  # 0.5 < 0.7
    torch.testing.assert_close(probs[3, 0], torch.tensor([0.5, 0.3, 0.15, 0.05]))


def test_processed_probs_handles_several_positions_per_row():
    logits = torch.randn(3, 5, 11, generator=torch.Generator().manual_seed(3))
    probs = sampling.processed_probs(logits, torch.tensor([0.0, 0.7, 1.3]),
                                     torch.tensor([0, 4, 0]), torch.tensor([1.0, 1.0, 0.9]))
    assert probs.shape == (3, 5, 11)
    torch.testing.assert_close(probs.sum(-1), torch.ones(3, 5))
    assert ((probs[1] > 0).sum(-1) == 4).all()  # top_k 4 at every position
    for t in range(5):  # each position matches the single-position computation
        single = sampling.processed_probs(logits[:, t:t + 1], torch.tensor([0.0, 0.7, 1.3]),
                                          torch.tensor([0, 4, 0]), torch.tensor([1.0, 1.0, 0.9]))
        torch.testing.assert_close(probs[:, t:t + 1], single)


def test_wire_round_trip_is_what_the_verifier_decodes():
    probs = torch.softmax(torch.randn(1000, generator=torch.Generator().manual_seed(0)), -1)
    sent, token_ids, payload = probs_wire.wire_round_trip(probs)
    again = probs_wire.decode(token_ids, payload, 1000)
    assert torch.equal(sent, again)
    assert abs(float(sent.sum()) - 1) < 1e-5
    sparse = torch.zeros(1000)
    sparse[[3, 500]] = torch.tensor([0.25, 0.75])
    sent, token_ids, payload = probs_wire.wire_round_trip(sparse)
    assert token_ids == [3, 500] and len(payload) == 4
    assert sent[500].item() == 0.75


def test_speculative_sampling_reproduces_the_target_distribution():
    """Statistical test of the sampler alone: the first output token's distribution over
    200k trials matches p within a total-variation tolerance of 0.01 (the expected TV of
    200k samples over 6 outcomes is about 0.003)."""
    generator = torch.Generator().manual_seed(1234)
    vocab, trials, num_drafts = 6, 200_000, 2
    p_one = torch.tensor([0.05, 0.30, 0.10, 0.25, 0.20, 0.10])
    q_one = torch.tensor([0.40, 0.05, 0.25, 0.05, 0.05, 0.20])
    p = p_one.expand(trials, num_drafts + 1, vocab)
    q = q_one.expand(trials, num_drafts, vocab)
    drafts = torch.multinomial(q_one, trials * num_drafts, replacement=True,
                               generator=generator).reshape(trials, num_drafts)
    u = 1 - torch.rand(trials, num_drafts, generator=generator)
    final = 1 - torch.rand(trials, generator=generator)
    result = sampling.rejection_sample(drafts, q, p, u, final)
    first = result.output_token_ids[:, 0]
    observed = torch.bincount(first, minlength=vocab).float() / trials
    total_variation = 0.5 * (observed - p_one).abs().sum().item()
    assert total_variation < 0.01, (observed, total_variation)
    # and the sampler is not trivially resampling from p: some drafts are accepted
    assert 0 < result.num_accepted.float().mean().item() < num_drafts


def test_a_row_with_fewer_drafts_is_verified_as_if_alone():
    """Ragged rows (different K per row): padding a row's drafts out to the group's K changes
    nothing, greedy or sampled, for the same uniforms."""
    gen = torch.Generator().manual_seed(3)
    vocab, width = 6, 4
    for trial in range(50):
        n = trial % (width + 1)  # the row's real drafts, 0..K
        p = torch.softmax(torch.randn(1, width + 1, vocab, generator=gen), -1)
        q = torch.softmax(torch.randn(1, width, vocab, generator=gen), -1)
        drafts = torch.randint(vocab, (1, width), generator=gen)
        u = torch.rand(1, width, generator=gen).clamp_min(1e-6)
        final = torch.rand(1, generator=gen).clamp_min(1e-6)
        padded = sampling.rejection_sample(drafts, q, p, u, final, num_drafts=torch.tensor([n]))
        alone = sampling.rejection_sample(drafts[:, :n], q[:, :n], p[:, :n + 1], u[:, :n], final)
        k = int(alone.num_accepted)
        assert int(padded.num_accepted) == k
        assert same_prefix(padded, alone, k + 1)
        logits = torch.log(p)
        padded = sampling.greedy_verify(drafts, logits, num_drafts=torch.tensor([n]))
        alone = sampling.greedy_verify(drafts[:, :n], logits[:, :n + 1])
        k = int(alone.num_accepted)
        assert int(padded.num_accepted) == k <= n
        assert same_prefix(padded, alone, k + 1)


def same_prefix(a, b, n: int) -> bool:
    return a.output_token_ids[0, :n].tolist() == b.output_token_ids[0, :n].tolist()
