"""Grouped-query attention with a mask over several query tokens: the folded form gives what
transformers' own SDPA path gives, without repeating the key/value heads."""
import pytest
import torch
from transformers.integrations import sdpa_attention

from batchspec.runtime import attention, kvcache, tiny


def _masked_verify_logits(model, prompts: list[list[int]], new: list[list[int]]):
    """Left-padded prompts, then several new tokens per row over the cache (a verify)."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
        added = torch.tensor(new)
        mask = torch.cat([mask, torch.ones_like(added)], dim=1)
        positions = positions[:, -1:] + 1 + torch.arange(added.shape[1])[None, :]
        return model(input_ids=added, attention_mask=mask, position_ids=positions,
                     use_cache=True,
                     **kvcache.with_cache(model, kvcache.returned_cache(out))).logits


def test_grouped_attention_equals_repeated_heads_and_copies_no_cache(monkeypatch):
    stock = tiny.llama(seed=0)
    assert stock.config.num_attention_heads > stock.config.num_key_value_heads  # grouped
    grouped = tiny.llama(seed=0)
    assert attention.install(grouped)
    assert grouped.config._attn_implementation == attention.NAME
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16]]
    new = [[20, 21, 22, 23], [24, 25, 26, 27], [28, 29, 30, 31]]
    want = _masked_verify_logits(stock, prompts, new)

    def no_repeat(*args):
        raise AssertionError("the key/value heads were repeated")

    monkeypatch.setattr(sdpa_attention, "repeat_kv", no_repeat)
    got = _masked_verify_logits(grouped, prompts, new)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(AssertionError, match="repeated"):
        _masked_verify_logits(stock, prompts, new)  # the stock path does copy them


def test_models_without_sdpa_or_grouping_keep_their_attention():
    eager = tiny.llama(seed=0)
    eager.set_attn_implementation("eager")
    assert not attention.install(eager)
    assert eager.config._attn_implementation == "eager"
    gpt2 = tiny.gpt2(seed=0)  # no key/value groups: SDPA as transformers runs it
    stock = tiny.gpt2(seed=0)
    assert attention.install(gpt2)
    prompts, new = [[5, 6, 7], [8]], [[9, 10], [11, 12]]
    torch.testing.assert_close(_masked_verify_logits(gpt2, prompts, new),
                               _masked_verify_logits(stock, prompts, new))


def test_rows_split_where_a_call_costs_less_than_the_padded_queries_it_saves():
    # one row verifying five tokens among rows decoding one: three calls over long caches
    assert attention.split_rows([1] * 7 + [5] + [1] * 8, groups=3, cached=256) == [
        (0, 7), (7, 8), (8, 16)]
    # every row alike, or caches too short for a call to pay: one call
    assert attention.split_rows([5] * 16, groups=3, cached=256) == [(0, 16)]
    assert attention.split_rows([1, 5, 1, 5], groups=3, cached=8) == [(0, 4)]
    # scattered wide rows: neighbours are merged rather than called one by one
    runs = attention.split_rows([5, 1] * 8, groups=3, cached=256)
    assert runs[0][0] == 0 and runs[-1][1] == 16 and len(runs) < 16
