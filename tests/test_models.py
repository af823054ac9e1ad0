"""Loading the default target: its GGUF file is converted once into the user cache."""
import pathlib

import torch
from transformers import AutoModelForCausalLM

from batchspec.runtime import models, tiny


def test_a_gguf_model_is_converted_once_and_loads_the_same_model(tmp_path, monkeypatch):
    """What the default target's file goes through (tiny.save_gguf writes a file of the same
    layout and block kinds)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    source = models.resolve(tiny.save_gguf(tmp_path))
    path = models.converted_gguf(source)
    assert pathlib.Path(path).parent == tmp_path / "cache" / "batchspec" / "models"
    assert (pathlib.Path(path) / models.CONVERTED_MARK).is_file()
    with monkeypatch.context() as patched:  # found again without reading the GGUF file
        patched.setattr(AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: (_ for _ in ()).throw(AssertionError("parsed again")))
        assert models.converted_gguf(source) == path
    reference = AutoModelForCausalLM.from_pretrained(source.path, gguf_file=source.gguf_file,
                                                     dtype=torch.float32)
    converted = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    expected, got = reference.state_dict(), converted.state_dict()
    assert expected.keys() == got.keys()
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    assert models.eos_token_ids(converted) == models.eos_token_ids(reference)
    assert models.max_context_len(converted) == models.max_context_len(reference)
    ids = torch.tensor([[1, 90, 19, 26, 35]])
    with torch.inference_mode():
        assert torch.equal(converted(ids).logits, reference(ids).logits)


def test_without_a_writable_cache_the_gguf_file_is_parsed_as_before(tmp_path, monkeypatch):
    blocked = tmp_path / "not-a-directory"
    blocked.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocked))
    assert models.converted_gguf(models.resolve(models.SMOLLM2)) is None


def test_the_shipped_drafts_are_found_and_the_best_is_the_default_for_smollm2():
    from batchspec.runtime import draft_model, feature_head
    from batchspec_tools import cli

    path = models.model_path(models.SMOLLM2_DRAFT)
    assert draft_model.is_draft_dir(path)
    manifest = draft_model.read_manifest(path)
    assert manifest["base_model"] == models.SMOLLM2 and manifest["num_layers"] >= 1
    head = draft_model.read_manifest(models.model_path(models.SMOLLM2_EAGLE))
    assert feature_head.is_head_manifest(head) and head["base_model"] == models.SMOLLM2
    assert head["training"]["command"].startswith("batchspec distill --kind feature")
    # serve's default draft for the default target is the best shipped one (the order the
    # served benchmarks measured), not a cut of layers; a named one is taken as named
    assert cli.pick_draft(models.SMOLLM2, None, None) == (models.BEST_SHIPPED[models.SMOLLM2][0],
                                                          None)
    assert models.best_shipped_draft(models.SMOLLM2) == models.SMOLLM2_EAGLE
    assert cli.pick_draft(models.SMOLLM2, models.SMOLLM2_DRAFT, None) == (
        models.SMOLLM2_DRAFT, None)
    assert cli.pick_draft("some/other-model", None, None) == ("some/other-model",
                                                              cli.DEFAULT_DRAFT_LAYERS)


def test_a_models_vocabulary_digest_reads_its_token_ids_meaning(tmp_path):
    """ModelInfo.vocabulary: the same for a GGUF file and the tokenizer.json written from it,
    and for a draft directory (its base model's); another vocabulary, another digest; none
    for a model without tokenizer files."""
    from batchspec.runtime import tiny

    gguf = tiny.save_gguf(tmp_path)
    digest = models.vocabulary_digest(gguf)
    assert digest and models.vocabulary_digest(gguf) == digest
    exported = tmp_path / "exported"
    models.export_tokenizer(gguf, exported)
    assert models.vocabulary_digest(str(exported)) == digest
    head = tiny.save_feature_head(gguf, tmp_path / "head")
    assert models.vocabulary_digest(str(head)) == digest
    tiny.llama(0).save_pretrained(tmp_path / "no-tokenizer")
    assert models.vocabulary_digest(str(tmp_path / "no-tokenizer")) == ""
    assert models.vocabulary_digest(models.SMOLLM2) == \
        models.vocabulary_digest(models.SMOLLM2_EAGLE) != digest


def test_a_draft_of_its_targets_own_vocabulary_is_known_without_reading_it(monkeypatch,
                                                                           tmp_path):
    """The shipped head indexes its base model's vocabulary: `serve` knows the pair shares
    one (a hosted draft) without parsing the GGUF file's 49k tokens, and reads a model's
    tokens once however often it asks."""
    reads = []

    def no_reading(path):
        reads.append(path)
        raise AssertionError("read the tokens of " + str(path))

    monkeypatch.setattr(models, "_gguf_tokens", no_reading)
    models.vocabulary_digest.cache_clear()
    assert not models.other_tokenizer(models.SMOLLM2_EAGLE, models.SMOLLM2)
    assert models.hostable_draft(models.SMOLLM2_EAGLE, models.SMOLLM2) and not reads
    from batchspec.runtime import tiny

    gguf = tiny.save_gguf(tmp_path)
    monkeypatch.undo()
    real = models._gguf_tokens
    monkeypatch.setattr(models, "_gguf_tokens", lambda path: reads.append(path) or real(path))
    assert models.vocabulary_digest(gguf) == models.vocabulary_digest(gguf) != ""
    assert len(reads) == 1
