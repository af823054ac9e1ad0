"""Structured output: a constrained answer is, token for token, what the target alone decodes
under the same grammar (transformers `generate` with the grammar as a logits processor), with
every draft kind, over gRPC and through the official `openai` client; sampling under the mask
draws from the target's masked distribution."""
import json

import grpc
import llguidance
import openai
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoConfig, AutoModelForCausalLM

from batchspec.params import SamplingParams
from batchspec.runtime import sampling
from batchspec.runtime.rows import VerifyRow
from batchspec.v1 import generate_pb2
from batchspec_tools.bench.grammar_mask import GrammarMask
from coordinator.grammar import Grammars, ResponseFormat, allows
from target_service import verifier

import tiny_models
from conftest import running_stack

CHARS = '{}[]":,.-0123456789abcdefghijklmnopqrstuvwxyz'
MERGES = [("t", "r"), ("tr", "u"), ("tru", "e"), ("{", '"'), ('"', ":"), ('"', ","), ("o", "k")]
TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "tag", "n"],
          "properties": {"ok": {"type": "boolean"}, "tag": {"enum": ["red", "green"]},
                         "n": {"type": "integer", "minimum": 0, "maximum": 99}},
          "x-guidance": {"whitespace_flexible": False}}  # the tiny model would pad forever


def make_json_tokenizer(out, eos: int) -> str:
    """A byte-level BPE tokenizer over the tiny models' vocabulary that can write JSON:
    characters, a few merges, the model's end-of-sequence token at its own id."""
    pieces = ["Ġ", "Ċ", *CHARS, *(a + b for a, b in MERGES)]
    ids = [i for i in range(tiny_models.VOCAB) if i != eos]
    vocab = dict(zip(pieces, ids)) | {"</s>": eos}
    specials = ["</s>"] + [f"<x{i}>" for i in ids[len(pieces):]]
    vocab |= {name: int(name[2:-1]) for name in specials[1:]}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=MERGES))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(specials)
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "chat_template.jinja").write_text(TEMPLATE)
    return str(out)


@pytest.fixture(scope="module")
def eos(model_dirs):
    return AutoConfig.from_pretrained(model_dirs["llama"][0]).eos_token_id


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory, eos):
    return make_json_tokenizer(tmp_path_factory.mktemp("json-tokenizer"), eos)


@pytest.fixture(scope="module")
def target(model_dirs):
    return AutoModelForCausalLM.from_pretrained(model_dirs["llama"][0])


@pytest.fixture(scope="module", params=[("model",), ("ngram",)], ids=["model", "ngram"])
def stack(model_dirs, tokenizer_dir, request):
    target_dir, draft_dir = model_dirs["llama"]
    with running_stack(target_dir, draft_dir, tokenizer=tokenizer_dir, http_port=0,
                       drafts=request.param) as running:
        yield running


def grammar_mask(tokenizer_dir, grammar: str, prompt_len: int, eos: int) -> GrammarMask:
    """The reference's constraint, built from the tokenizer file by llguidance itself."""
    text = open(f"{tokenizer_dir}/tokenizer.json").read()
    lltok = llguidance.LLTokenizer(text, n_vocab=tiny_models.VOCAB, eos_token=eos)
    return GrammarMask(llguidance.LLMatcher(lltok, grammar), prompt_len)


def reference(target, tokenizer_dir, grammar, prompt, eos, max_new_tokens):
    with torch.no_grad():
        out = target.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens,
                              do_sample=False, eos_token_id=eos, pad_token_id=eos,
                              attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              logits_processor=[grammar_mask(tokenizer_dir, grammar,
                                                             len(prompt), eos)])
    tokens = out[0, len(prompt):].tolist()
    return tokens[:tokens.index(eos) + 1] if eos in tokens else tokens


def grpc_generate(stack, **fields):
    responses = list(stack.stub().Generate(generate_pb2.GenerateRequest(**fields), timeout=60))
    return [t for r in responses for t in r.token_ids], responses[-1]


PROMPTS = [[5, 9, 14, 3], [40, 41, 42, 43, 44, 45], [7], [60, 12, 60, 12, 60, 12, 60, 12]]
FORMATS = [("json_schema", json.dumps(SCHEMA)), ("regex", "(red|green|blue)-[0-9]{1,3}"),
           ("json_object", "")]


@pytest.mark.parametrize("kind,value", FORMATS)
def test_constrained_greedy_is_the_targets_own_answer_under_the_grammar(
        stack, target, tokenizer_dir, eos, kind, value):
    grammar = Grammars(open(f"{tokenizer_dir}/tokenizer.json").read(), tiny_models.VOCAB,
                       [eos]).compile(ResponseFormat(kind, value)).text
    fmt = generate_pb2.ResponseFormat(**{kind: value or True})
    drafted = accepted = 0
    examples = Tokenizer.from_file(f"{tokenizer_dir}/tokenizer.json").encode(
        '{"ok":false,"tag":"green","n":7} {"ok":true,"tag":"red","n":12}').ids
    for prompt in PROMPTS + [examples]:  # examples: a lookup drafts from them
        expected = reference(target, tokenizer_dir, grammar, prompt, eos, 40)
        got, last = grpc_generate(stack, prompt_token_ids=prompt, max_new_tokens=40,
                                  response_format=fmt)
        assert got == expected, prompt
        drafted += last.stats.num_drafted_tokens
        accepted += last.stats.num_accepted_tokens
        if kind != "json_object":  # these formats finish well within 40 tokens
            assert last.finish_reason == generate_pb2.FINISH_REASON_STOP
    if kind == "json_schema":  # drafts were verified under the masks, and some accepted
        assert drafted > 0 and accepted > 0


def test_the_official_client_gets_json_that_validates(stack):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{stack.http_port}/v1", api_key="unused",
                           max_retries=0)
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA,
                                                  "strict": True}}
    messages = [{"role": "user", "content": "is the sky red"}]
    whole = client.chat.completions.create(model="batchspec", messages=messages, max_tokens=40,
                                           temperature=0, response_format=fmt)
    text = whole.choices[0].message.content
    answer = json.loads(text)
    assert set(answer) == {"ok", "tag", "n"} and answer["tag"] in ("red", "green")
    assert isinstance(answer["ok"], bool) and 0 <= answer["n"] <= 99
    streamed = client.chat.completions.create(model="batchspec", messages=messages,
                                              max_tokens=40, temperature=0, response_format=fmt,
                                              stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == text
    sampled = client.chat.completions.create(model="batchspec", messages=messages, max_tokens=40,
                                             temperature=1.0, seed=3, n=4, response_format=fmt)
    for choice in sampled.choices:
        assert set(json.loads(choice.message.content)) == {"ok", "tag", "n"}


@pytest.mark.parametrize("fmt,needle", [
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "json_schema.schema"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "wat"}}}, "cannot be used"),
    ({"type": "grammar"}, "must be"),
    ({"type": "json_object", "schema": {}}, "takes no schema")])
def test_a_bad_format_is_refused_with_400(stack, fmt, needle):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{stack.http_port}/v1", api_key="unused",
                           max_retries=0)
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model="batchspec", max_tokens=5, response_format=fmt,
                                       messages=[{"role": "user", "content": "hi"}])
    assert needle in str(caught.value)


def test_grpc_refuses_a_format_with_ignore_eos_or_a_bad_regex(stack):
    for fields in ({"ignore_eos": True, "response_format": generate_pb2.ResponseFormat(
                    json_object=True)},
                   {"response_format": generate_pb2.ResponseFormat(regex="(unclosed")}):
        with pytest.raises(grpc.RpcError) as caught:
            grpc_generate(stack, prompt_token_ids=[5], max_new_tokens=5, **fields)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_forbidden_draft_is_cut_for_greedy_rows_and_kept_for_sampled_ones(tokenizer_dir, eos):
    """The coordinator's masks: one per output position, the draft cut before the first
    forbidden token, and the matcher left where it was."""
    grammars = Grammars(open(f"{tokenizer_dir}/tokenizer.json").read(), tiny_models.VOCAB, [eos])
    tok = Tokenizer.from_file(f"{tokenizer_dir}/tokenizer.json")
    constraint = grammars.compile(ResponseFormat("regex", "(red|green)-[0-9]")).start()
    drafts = tok.encode("re").ids + tok.encode("x").ids + tok.encode("d").ids
    masks, allowed = constraint.masks(drafts)
    assert allowed == 2 and len(masks) == len(drafts) + 1
    assert allows(masks[0], tok.token_to_id("r")) and not allows(masks[0], tok.token_to_id("x"))
    assert all(m == b"\xff" * len(m) for m in masks[3:])  # past the forbidden one: never used
    assert constraint.masks([])[0][0] == masks[0]  # rolled back to where it was
    constraint.advance(tok.encode("red-").ids)
    digits, _ = constraint.masks([])
    assert [t for t in range(tiny_models.VOCAB) if allows(digits[0], t)] == \
        sorted(tok.token_to_id(d) for d in "0123456789")
    constraint.advance(tok.encode("7").ids)
    assert [t for t in range(tiny_models.VOCAB) if allows(constraint.masks([])[0][0], t)] == [eos]


def test_sampling_under_a_mask_draws_from_the_targets_masked_distribution():
    """Drafts drawn from q (near the target's unmasked distribution, so with mass on
    forbidden tokens), verified against masked
    logits: the first output is distributed as the target's softmax renormalised on the
    allowed tokens, and no forbidden token is ever output."""
    torch.manual_seed(0)
    vocab, n = 8, 6000
    logits = torch.randn(vocab)
    allowed = torch.tensor([1, 0, 1, 1, 0, 1, 0, 1], dtype=torch.bool)
    q_logits = (logits + 0.7 * torch.randn(vocab))[None, None]  # a draft near the target
    mask = torch.stack([allowed, torch.ones(vocab, dtype=torch.bool)])
    first, accepted = [], 0
    for seed in range(n):
        params = SamplingParams(temperature=1.0, seed=seed)
        draft = sampling.choose(q_logits, [params], [0])[0]
        rows = [VerifyRow(seed, 0, [0], draft.tolist(), params, token_masks=mask)]
        constrained = verifier.masked(logits.expand(1, 2, vocab), rows)
        result = verifier.accept(rows, draft[None], constrained, torch.tensor([1]))
        first.append(int(result.output_token_ids[0, 0]))
        accepted += int(result.num_accepted[0])
    freq = torch.bincount(torch.tensor(first), minlength=vocab).float() / n
    expected = torch.softmax(logits.masked_fill(~allowed, float("-inf")), -1)
    assert freq[~allowed].sum() == 0
    assert (freq - expected).abs().max() < 0.025
    assert accepted > 0.2 * n  # drafts were accepted, too


def test_a_greedy_row_is_filled_with_the_grammars_forced_tokens(tokenizer_dir, eos):
    grammars = Grammars(open(f"{tokenizer_dir}/tokenizer.json").read(), tiny_models.VOCAB, [eos])
    tok = Tokenizer.from_file(f"{tokenizer_dir}/tokenizer.json")
    constraint = grammars.compile(ResponseFormat("regex", "(red|green)-[0-9]")).start()
    assert constraint.cut([], 4)[2] == []  # "r" or "g": nothing is forced yet
    masks, allowed, forced = constraint.cut(tok.encode("gx").ids, 3)
    assert allowed == 1 and tok.decode(forced) == "ree" and len(masks) == 5
    assert [t for t in range(tiny_models.VOCAB) if allows(masks[1], t)] == forced[:1]
    assert constraint.cut(tok.encode("g").ids, 0) == (masks[:2], 1, [])  # rolled back
