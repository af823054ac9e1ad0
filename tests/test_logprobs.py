"""Log-probabilities: the target's own, for accepted draft tokens and target tokens alike,
for the prompt (scored at admission) and through both edges, against the target alone."""
import pytest
import torch
from transformers import AutoModelForCausalLM

from batchspec.v1 import generate_pb2
from coordinator.text import TextCodec

import tiny_models
from conftest import running_stack

TOL = 1e-4


def reference_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """[len - 1, vocab]: row i is the target alone's log-distribution of token i + 1."""
    with torch.no_grad():
        logits = model(torch.tensor([token_ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def check(scored, token_ids: list[int], reference: torch.Tensor, num_top: int) -> None:
    """scored[i] (a TokenLogprob) is token_ids[i] under reference[i]."""
    assert len(scored) == len(token_ids) == len(reference)
    for entry, token, row in zip(scored, token_ids, reference):
        assert entry.token_id == token
        assert abs(entry.logprob - row[token].item()) < TOL
        top = row.topk(num_top)
        assert len(entry.top_token_ids) == num_top
        assert torch.allclose(torch.tensor(list(entry.top_logprobs)), top.values, atol=TOL)
        for token_id, value in zip(entry.top_token_ids, entry.top_logprobs):
            assert abs(row[token_id].item() - value) < TOL  # ties may come in either order


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_logprobs_are_the_targets_for_drafted_and_target_tokens(model_dirs, arch):
    target_dir, draft_dir = model_dirs[arch]
    model = AutoModelForCausalLM.from_pretrained(target_dir)
    prompts = [[5, 6, 7, 8, 9, 5, 6], [11, 12], [20, 21, 22, 23]]
    with running_stack(target_dir, draft_dir, batch_size=3, num_draft_tokens=3) as stack:
        stub = stack.stub()
        calls = [stub.Generate(generate_pb2.GenerateRequest(
            prompt_token_ids=p, max_new_tokens=24, ignore_eos=True,
            logprobs=generate_pb2.LogprobsOptions(num_top=3),
            prompt_logprobs=generate_pb2.LogprobsOptions(num_top=2)), timeout=120)
            for p in prompts]
        accepted = 0
        for prompt, call in zip(prompts, calls):
            responses = list(call)
            tokens = [t for r in responses for t in r.token_ids]
            assert tokens == tiny_models.reference_greedy(model, prompt, 24, ignore_eos=True)
            assert all(len(r.logprobs) == len(r.token_ids) for r in responses)
            accepted += sum(r.num_accepted_draft_tokens for r in responses)
            reference = reference_logprobs(model, prompt + tokens)
            check([lp for r in responses for lp in r.logprobs], tokens,
                  reference[len(prompt) - 1:], 3)
            assert all(not r.prompt_logprobs for r in responses[1:])  # the first only
            check(responses[0].prompt_logprobs, prompt[1:], reference[:len(prompt) - 1], 2)
        assert accepted > 0  # accepted draft tokens were among those checked


def test_sampled_tokens_carry_their_logprob_before_temperature(model_dirs):
    target_dir, draft_dir = model_dirs["llama"]
    model = AutoModelForCausalLM.from_pretrained(target_dir)
    prompt = [5, 6, 7]
    with running_stack(target_dir, draft_dir, batch_size=1, num_draft_tokens=2) as stack:
        responses = list(stack.stub().Generate(generate_pb2.GenerateRequest(
            prompt_token_ids=prompt, max_new_tokens=16, ignore_eos=True, temperature=0.7,
            top_k=5, seed=3, logprobs=generate_pb2.LogprobsOptions(num_top=0)), timeout=120))
    tokens = [t for r in responses for t in r.token_ids]
    check([lp for r in responses for lp in r.logprobs], tokens,
          reference_logprobs(model, prompt + tokens)[len(prompt) - 1:], 0)


def test_too_many_alternatives_are_refused(model_dirs):
    import grpc

    target_dir, draft_dir = model_dirs["gpt2"]
    with running_stack(target_dir, draft_dir) as stack:
        with pytest.raises(grpc.RpcError) as caught:
            list(stack.stub().Generate(generate_pb2.GenerateRequest(
                prompt_token_ids=[5, 6], max_new_tokens=2,
                logprobs=generate_pb2.LogprobsOptions(num_top=21))))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "at most 20" in caught.value.details()


# ---- the HTTP edge, through the official openai client ----------------------------------------
@pytest.fixture(scope="module")
def http_stack(model_dirs, tmp_path_factory):
    from test_http import make_chat_tokenizer

    tokenizer_dir = make_chat_tokenizer(tmp_path_factory.mktemp("logprobs-tokenizer"))
    target_dir, draft_dir = model_dirs["llama"]
    with running_stack(target_dir, draft_dir, tokenizer=tokenizer_dir, http_port=0,
                       drafts=("model", "ngram")) as stack:
        stack.codec = TextCodec(tokenizer_dir)
        stack.model = AutoModelForCausalLM.from_pretrained(target_dir)
        yield stack


def openai_client(stack):
    import openai

    return openai.OpenAI(base_url=f"http://127.0.0.1:{stack.http_port}/v1", api_key="unused",
                         max_retries=0)


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_through_the_openai_client(http_stack, stream):
    from test_http import CHAT

    codec, model = http_stack.codec, http_stack.model
    prompt = codec.encode_chat([(m["role"], m["content"]) for m in CHAT])
    tokens = tiny_models.reference_greedy(model, prompt, 20)
    reference = reference_logprobs(model, prompt + tokens)[len(prompt) - 1:]
    answer = openai_client(http_stack).chat.completions.create(
        model="batchspec", messages=CHAT, max_tokens=20, temperature=0, logprobs=True,
        top_logprobs=4, stream=stream)
    if stream:
        content = [e for chunk in answer if chunk.choices and chunk.choices[0].logprobs
                   for e in chunk.choices[0].logprobs.content]
    else:
        content = answer.choices[0].logprobs.content
    assert [e.token for e in content] == [codec.token_text(t) for t in tokens]
    for entry, token, row in zip(content, tokens, reference):
        assert abs(entry.logprob - row[token].item()) < TOL
        assert entry.bytes == list(entry.token.encode())
        top = row.topk(4)
        assert [t.token for t in entry.top_logprobs][:1] == [codec.token_text(
            top.indices[0].item())]
        assert torch.allclose(torch.tensor([t.logprob for t in entry.top_logprobs]),
                              top.values, atol=TOL)


@pytest.mark.parametrize("stream", [False, True])
def test_completions_echo_scores_the_prompt_as_lm_eval_asks(http_stack, stream):
    """What evaluation harnesses send: the prompt as token ids, echo, logprobs 1, one token."""
    codec, model = http_stack.codec, http_stack.model
    prompt = codec.encode("the robot learns to paint a red moon")
    answer = openai_client(http_stack).completions.create(
        model="batchspec", prompt=[prompt], max_tokens=1, temperature=0, logprobs=1,
        echo=True, stream=stream)
    chunks = list(answer) if stream else [answer]
    text = "".join(c.choices[0].text for c in chunks)
    logprobs = {key: [v for c in chunks for v in getattr(c.choices[0].logprobs, key)]
                for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    [generated] = tiny_models.reference_greedy(model, prompt, 1)
    everything = prompt + [generated]
    reference = reference_logprobs(model, everything)
    assert text == codec.decode(prompt, skip_special_tokens=False) + codec.decode([generated])
    assert logprobs["tokens"] == [codec.token_text(t) for t in everything]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    for value, top, token, row in zip(logprobs["token_logprobs"][1:],
                                      logprobs["top_logprobs"][1:], everything[1:], reference):
        assert abs(value - row[token].item()) < TOL
        [(best, best_value)] = top.items()
        assert best == codec.token_text(row.argmax().item())
        assert abs(best_value - row.max().item()) < TOL
    lengths = [len(t) for t in logprobs["tokens"]]
    assert logprobs["text_offset"] == [sum(lengths[:i]) for i in range(len(lengths))]


def test_logprob_fields_are_checked(http_stack):
    import openai

    client = openai_client(http_stack)
    with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs"):
        client.chat.completions.create(model="batchspec", messages=[
            {"role": "user", "content": "hello"}], max_tokens=2, top_logprobs=2)
    with pytest.raises(openai.BadRequestError, match="at most 20"):
        client.completions.create(model="batchspec", prompt="hello", max_tokens=2,
                                  logprobs=21)
