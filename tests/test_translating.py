"""A draft of another tokenizer than the target's (draft_service.translating): its text maps
to the target's tokens exactly, its bookkeeping keeps both vocabularies in step, and through
the services the output is the target's, greedy and sampled."""
import concurrent.futures
import json
import pathlib
from collections import Counter

import filelock
import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from batchspec import errors
from batchspec.runtime import models, tiny
from batchspec.v1 import generate_pb2
from coordinator import fleet
from coordinator.clients import ModelInfo
from draft_service import retokenize, translating
from draft_service.retokenize import TokenTable

import tiny_models
from conftest import running_stack


class Pairs(dict):
    """arch -> (target dir, draft dir): a byte-level BPE target of arch and a character-level
    draft of the other architecture, trained on the same made-up text; each trained when
    first asked for, once a run: the suite's workers share `root`, and one trains a pair
    while the others wait for it."""

    def __init__(self, root: pathlib.Path):
        super().__init__()
        self.root = root

    def __missing__(self, arch):
        with filelock.FileLock(self.root / f"{arch}.lock"):
            made = self.root / f"{arch}.json"
            if not made.is_file():
                made.write_text(json.dumps(tiny_models.save_translating_pair(arch, self.root)))
            self[arch] = tuple(json.loads(made.read_text()))
        return self[arch]


@pytest.fixture(scope="session")
def pairs(tmp_path_factory, worker_id):
    # the workers of one run (pytest-xdist) share their base directory's parent
    if worker_id == "master":
        return Pairs(tmp_path_factory.mktemp("translating"))
    root = tmp_path_factory.getbasetemp().parent / "translating"
    root.mkdir(exist_ok=True)
    return Pairs(root)


@pytest.fixture(scope="session")
def tables(pairs):
    target_dir, draft_dir = pairs["llama"]
    return TokenTable.from_file(target_dir), TokenTable.from_file(draft_dir)


# ---- text between tokenizers --------------------------------------------------------------------
def test_each_id_of_a_byte_level_and_a_character_tokenizer_spells_its_text(tables):
    target, draft = tables
    text = "The old man paints a red box at night."
    for table in (target, draft):
        ids = table.encode(text)
        assert table.text_bytes(ids) == text.encode()
        table.check_exact(translating.PROBE_TEXT)
    assert len(target.encode(text)) < len(draft.encode(text)) == len(text)
    eos = target.encode(tiny.EOS_TEXT)
    assert len(eos) == 1 and target.bytes_of[eos[0]] == tiny.EOS_TEXT.encode()


def test_a_tokenizer_that_cannot_spell_its_text_is_refused(tmp_path):
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel

    words = Tokenizer(WordLevel({"<unk>": 0, "the": 1, "cat": 2}, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()  # spaces are not tokens: lost
    with pytest.raises(ValueError, match="cannot be mapped"):
        TokenTable(words, "words").check_exact("the cat")


def test_text_maps_to_whole_tokens_only():
    """to_tokens keeps the tokens that spell the text and drops the last (more text could
    change it); a character cut in half is not text yet."""
    assert retokenize.complete_text("café".encode()[:-1]) == ("caf", 3)
    assert retokenize.shared_boundaries([b"ab", b"c", b"de"], [b"a", b"b", b"cd", b"e"]) == \
        [(1, 2), (3, 4)]


def test_a_proposal_becomes_the_target_tokens_that_spell_it_but_the_last(tables):
    target, draft = tables
    record = translating.Record([])
    prompt = target.encode("The cat sees")
    feed = translating.rebase(record, 0, prompt, target, draft)
    assert feed.stream == draft.encode("The cat sees") and feed.pending == b""
    drafted = draft.encode(" the moon. A")
    tokens, inside = translating.proposal_tokens(feed, drafted, target, draft, limit=8)
    assert target.text_bytes(tokens) == b" the moon."[:len(target.text_bytes(tokens))]
    assert tokens == target.encode(" the moon. A")[:-1]
    assert inside and all(target.text_bytes(tokens[:i]) == draft.text_bytes(drafted[:j])
                          for i, j in inside)
    assert translating.proposal_tokens(feed, drafted, target, draft, limit=2)[0] == tokens[:2]


def test_a_sentencepiece_target_splits_a_proposal_as_it_follows_the_committed_text(tables):
    """A SentencePiece-style tokenizer writes a space before the first word of a text: the
    proposal is encoded after the committed text, so its words are split as the target
    would split them there, and a proposal that continues a word maps too."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    pieces = Tokenizer(models.BPE(unk_token="<unk>"))
    pieces.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    pieces.decoder = decoders.Metaspace(prepend_scheme="first")
    pieces.train_from_iterator(tiny.corpus(400), trainers.BpeTrainer(
        vocab_size=200, special_tokens=["<unk>"]))
    target, (_, draft) = TokenTable(pieces, "pieces"), tables
    assert target.text_bytes(target.encode("the moon")) == b" the moon"  # a space first
    committed = target.encode("The cat sees")
    feed = translating.rebase(translating.Record([]), 0, committed, target, draft)
    assert feed.context == b" The cat sees"
    tokens, _ = translating.proposal_tokens(feed, draft.encode(" the moon. A"), target, draft, 8)
    assert tokens == target.encode("The cat sees the moon. A")[len(committed):-1]
    assert target.text_bytes(tokens) == b" the moon."
    half = translating.rebase(translating.Record([]), 0, target.encode("The cat se"), target,
                              draft)
    tokens, _ = translating.proposal_tokens(half, draft.encode("es the ball"), target, draft, 8)
    assert target.text_bytes(tokens) == b"es the"  # the word's end, with no space before it


def test_a_proposal_must_continue_a_character_the_committed_text_cut_in_half(tables):
    target, draft = tables
    assert len(target.encode("é")) == 2  # two byte tokens: its corpus has no é
    half = target.encode("é")[:1]
    feed = translating.rebase(translating.Record([]), 0, target.encode("caf") + half,
                              target, draft)
    assert feed.pending == "é".encode()[:1]
    assert translating.proposal_tokens(feed, draft.encode(" the"), target, draft, 4) == ([], [])


def test_a_record_rolls_back_to_the_last_shared_boundary_and_feeds_the_text_after_it(tables):
    """After a rejection the draft keeps its cache up to the last boundary both
    tokenizations share within what is kept, and is fed the rest re-tokenized."""
    target, draft = tables
    committed = target.encode("The cat sees the ball.")
    record = translating.Record([])
    feed = translating.rebase(record, 0, committed[:-1], target, draft)
    record = translating.Record(committed[:-1], feed.stream, feed.anchors)
    keep = len(committed) - 3
    again = translating.rebase(record, keep, committed[keep:], target, draft)
    assert again.stream == draft.encode("The cat sees the ball.")
    shared = max(a for a in record.anchors if a[0] <= keep)
    assert again.keep >= shared[1] and again.stream[:again.keep] == record.draft_ids[:again.keep]
    assert all(target.text_bytes(committed[:t]) == draft.text_bytes(again.stream[:d])
               for t, d in again.anchors)


# ---- start-up -----------------------------------------------------------------------------------
def test_a_draft_of_another_tokenizer_is_refused_as_a_same_tokenizer_draft_and_served_translated(
        pairs, tmp_path):
    """By vocabulary (what each id spells), not by size: the coordinator refuses a draft
    whose ids mean other text, with a message that says how to serve it; served with the
    target's tokenizer it reports the target's vocabulary and is taken."""
    target_dir, draft_dir = pairs["llama"]
    target_vocabulary = models.vocabulary_digest(target_dir)
    assert models.vocabulary_digest(draft_dir) not in ("", target_vocabulary)
    target = ModelInfo("t", 320, [0], 256, 0, 0, vocabulary=target_vocabulary)
    own = ModelInfo("d", 27, [0], 256, 0, 0, vocabulary=models.vocabulary_digest(draft_dir))
    with pytest.raises(errors.FailedPrecondition, match="--target-tokenizer"):
        fleet.check_draft(own, target, "draft:1")
    same_size = ModelInfo("d", 320, [0], 256, 0, 0, vocabulary="another")
    with pytest.raises(errors.FailedPrecondition, match="do not share a tokenizer"):
        fleet.check_draft(same_size, target, "draft:1")
    from batchspec.runtime import service

    runner = translating.build_runner(service.ServiceConfig(
        model=draft_dir, target_tokenizer=str(pathlib.Path(target_dir) / "tokenizer.json")))
    assert runner.vocabulary == target_vocabulary and runner.vocab_size == 320
    with pytest.raises(errors.InvalidArgument, match="num_draft_tokens must be >= 1"):
        runner.propose([], 0)
    fleet.check_draft(ModelInfo("d", runner.vocab_size, [], 256, 0, 0,
                                vocabulary=runner.vocabulary), target, "draft:1")
    head = tiny_models.save_feature_head(target_dir, tmp_path / "head")  # reads target positions
    with pytest.raises(ValueError, match="reads the target's features"):
        translating.build_runner(service.ServiceConfig(
            model=head, target_tokenizer=str(pathlib.Path(target_dir) / "tokenizer.json")))


def test_serve_starts_a_draft_of_another_tokenizer_translating(pairs):
    from batchspec_tools import cli

    target_dir, draft_dir = pairs["llama"]
    args = cli.serve_parser().parse_args(["--target-model", target_dir,
                                          "--draft-model", draft_dir])
    command = cli.draft_command(args, draft_dir, 1234)
    assert command[command.index("--target-tokenizer") + 1] == \
        models.tokenizer_file(target_dir)
    same = cli.draft_command(cli.serve_parser().parse_args(
        ["--target-model", target_dir, "--draft-model", target_dir]), target_dir, 1234)
    assert "--target-tokenizer" not in same


# ---- through the services ---------------------------------------------------------------
PROMPTS = ["The cat sees", "A robot paints the moon. My sister", "The bird",
           "A dog chases a small fish again. The old man calls", "My sister likes the",
           "The cat", "A red", "The garden. The robot finds her friend at night. A dog"]


def generate(stack, prompt_ids, max_new_tokens, **sampling):
    responses = list(stack.stub().Generate(generate_pb2.GenerateRequest(
        prompt_token_ids=prompt_ids, max_new_tokens=max_new_tokens, ignore_eos=True,
        **sampling), timeout=120))
    return [t for r in responses for t in r.token_ids], responses[-1].stats


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_greedy_output_through_a_draft_of_another_tokenizer_is_the_targets(pairs, arch):
    """Batches of 1 and of 16 rows of different lengths: every output is the target's alone,
    drafts are accepted, and not all of them (ragged acceptance)."""
    target_dir, draft_dir = pairs[arch]
    model = AutoModelForCausalLM.from_pretrained(target_dir)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    prompts = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    prompts = (prompts * 2)[:16]
    lengths = [20 + 3 * (i % 5) for i in range(16)]
    with running_stack(target_dir, draft_dir, batch_size=16, num_draft_tokens=4,
                       drafts=("translating",),
                       target_tokenizer=str(pathlib.Path(target_dir) / "tokenizer.json")) \
            as stack:
        tokens, stats = generate(stack, prompts[0], 24)
        assert tokens == tiny_models.greedy_ignoring_eos(model, prompts[0], 24)
        drafted, accepted = stats.num_drafted_tokens, stats.num_accepted_tokens
        with concurrent.futures.ThreadPoolExecutor(16) as pool:
            results = list(pool.map(lambda a: generate(stack, *a), zip(prompts, lengths)))
        for prompt, length, (tokens, stats) in zip(prompts, lengths, results):
            assert tokens == tiny_models.greedy_ignoring_eos(model, prompt, length)
            drafted += stats.num_drafted_tokens
            accepted += stats.num_accepted_tokens
    assert 0 < accepted < drafted


def test_sampled_output_through_a_draft_of_another_tokenizer_is_the_targets(pairs):
    """At temperature 0.7 and top-p 0.9 the output follows the target's distribution (chi
    square against the target alone), seeded requests repeat, and sampled drafts are
    accepted: a row's draft is the draft's most likely text, kept where the target's seeded
    choice agrees."""
    from test_sampling_kinds import NUM_SAMPLES, assert_follows_the_target, sample

    target_dir, draft_dir = pairs["llama"]
    prompt = TokenTable.from_file(target_dir).encode("The cat sees")
    with running_stack(target_dir, draft_dir, drafts=("translating",), batch_size=16,
                       num_draft_tokens=3,
                       target_tokenizer=str(pathlib.Path(target_dir) / "tokenizer.json")) \
            as stack:
        results = sample(stack, range(NUM_SAMPLES), prompt)
        again = sample(stack, range(20), prompt)
    assert [r[0] for r in again] == [r[0] for r in results[:20]]
    drafted, accepted = sum(r[1] for r in results), sum(r[2] for r in results)
    assert drafted > 0 and accepted > 0, (drafted, accepted)
    assert_follows_the_target([r[0] for r in results], target_dir, prompt)


def test_rows_of_both_kinds_and_both_samplings_in_one_cohort_stay_exact(pairs, tmp_path):
    """The n-gram lookup and the draft of another tokenizer serve one cohort, greedy and
    sampled rows together: greedy rows are the target's alone, sampled ones follow its
    distribution, and both kinds had drafts accepted."""
    from test_sampling_kinds import (
        NUM_POSITIONS,
        NUM_SAMPLES,
        TEMPERATURE,
        TOP_P,
        assert_follows_the_target,
    )

    target_dir, draft_dir = pairs["gpt2"]
    table = TokenTable.from_file(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir)
    # a prompt that repeats itself: the lookup proposes the target's own continuation
    start = table.encode("The bird")
    prompt = start + tiny_models.greedy_ignoring_eos(model, start, 6) + start
    greedy_prompts = [table.encode(p) for p in PROMPTS]
    greedy = [tuple(tiny_models.greedy_ignoring_eos(model, p, 8)) for p in greedy_prompts]

    def one(stub, i):
        fields = {} if i % 4 == 0 else {"temperature": TEMPERATURE, "top_p": TOP_P, "seed": i}
        asked = greedy_prompts[i // 4 % len(PROMPTS)] if i % 4 == 0 else prompt
        responses = list(stub.Generate(generate_pb2.GenerateRequest(
            prompt_token_ids=asked, max_new_tokens=8 if i % 4 == 0 else NUM_POSITIONS,
            ignore_eos=True, **fields), timeout=120))
        return (i, tuple(t for r in responses for t in r.token_ids),
                responses[-1].stats.num_accepted_tokens)

    step_log = tmp_path / "steps.jsonl"
    with running_stack(target_dir, draft_dir, drafts=("ngram", "translating"), batch_size=16,
                       num_draft_tokens=3, step_log=str(step_log),
                       target_tokenizer=str(pathlib.Path(target_dir) / "tokenizer.json")) \
            as stack:
        with concurrent.futures.ThreadPoolExecutor(32) as pool:
            results = list(pool.map(lambda i: one(stack.stub(), i),
                                    range(4 * NUM_SAMPLES // 3)))
    greedy_rows = [r for r in results if r[0] % 4 == 0]
    sampled_rows = [r for r in results if r[0] % 4]
    assert all(tokens == greedy[i // 4 % len(PROMPTS)] for i, tokens, _ in greedy_rows)
    assert sum(a for _, _, a in greedy_rows) > 0 and sum(a for _, _, a in sampled_rows) > 0
    assert_follows_the_target([tokens for _, tokens, _ in sampled_rows[:NUM_SAMPLES]],
                              target_dir, prompt)
    steps = [json.loads(line) for line in step_log.read_text().splitlines()]
    accepted_by_kind = Counter()
    for step in steps:
        for kind, accepted in zip(step["kinds"], step["accepted"]):
            accepted_by_kind[kind] += accepted
    assert accepted_by_kind[0] > 0 and accepted_by_kind[1] > 0, accepted_by_kind
    assert any({0, 1} <= set(step["kinds"]) for step in steps)  # both kinds in one step


def test_a_long_record_keeps_recent_anchors_and_a_far_rollback_feeds_from_the_start(tables):
    target, draft = tables
    text = " ".join(tiny.corpus(12, seed=3))
    tokens = target.encode(text)
    assert len(tokens) > translating.ANCHOR_WINDOW + 50
    feed = translating.rebase(translating.Record([]), 0, tokens, target, draft)
    assert feed.anchors[0] == (0, 0) and len(feed.anchors) <= translating.ANCHOR_WINDOW + 2
    assert all(t >= len(tokens) - translating.ANCHOR_WINDOW for t, _ in feed.anchors[1:])
    record = translating.Record(tokens, feed.stream, feed.anchors)
    again = translating.rebase(record, 10, tokens[10:], target, draft)
    assert again.stream == draft.encode(text) and again.keep == len(again.stream) - 1
