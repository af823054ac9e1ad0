"""Tiny random causal LMs built on the fly (no hub), for tests and `batchspec bench --quick`:
a Llama-style model (RoPE) and a GPT-2-style model (learned absolute positions), plus a draft
that agrees with its target only sometimes."""
import pathlib

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from batchspec.runtime import kvcache, models

VOCAB = 96
EOS = 3  # placeholder in the configs; save_pair picks a real one per model (pick_eos)


def llama(seed: int, vocab: int = VOCAB) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, initializer_range=0.2,
                         eos_token_id=EOS, bos_token_id=1, pad_token_id=EOS,
                         tie_word_embeddings=False)
    return LlamaForCausalLM(config).eval()


def gpt2(seed: int, vocab: int = VOCAB) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    config = GPT2Config(vocab_size=vocab, n_embd=64, n_layer=2, n_head=4, n_positions=256,
                        initializer_range=0.2, eos_token_id=EOS, bos_token_id=1)
    return GPT2LMHeadModel(config).eval()


BUILDERS = {"llama": llama, "gpt2": gpt2}


def noisy_copy(model, seed: int, scale: float):
    """The model with Gaussian noise on every weight: a draft that is right only sometimes."""
    draft = type(model)(model.config).eval()
    draft.load_state_dict(model.state_dict())
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in draft.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * scale * param.std())
    return draft


def greedy_ignoring_eos(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The target alone at batch 1: plain greedy decoding that treats EOS as an ordinary token
    (the reference for requests with ignore_eos)."""
    return decode_ignoring_eos(model, prompt, max_new_tokens,
                               lambda logits, position: int(logits[0, -1].argmax()))


@torch.no_grad()
def decode_ignoring_eos(model, prompt: list[int], max_new_tokens: int, choose) -> list[int]:
    """The target alone at batch 1, one token a forward over its KV cache, EOS an ordinary
    token: choose(logits [1, 1, vocab], position of the token chosen) -> token id."""
    tokens, out = [], model(torch.tensor([prompt], device=model.device), use_cache=True)
    for _ in range(max_new_tokens):
        if tokens:  # the last token chosen, fed: no forward after the last one
            out = model(torch.tensor([tokens[-1:]], device=model.device), use_cache=True,
                        **kvcache.with_cache(model, kvcache.returned_cache(out)))
        tokens.append(choose(out.logits[:, -1:], len(prompt) + len(tokens)))
    return tokens


def pick_eos(model, rate: float = 0.04) -> int:
    """A token the model picks greedily about `rate` of the time: as EOS it gives early stops
    in some requests but not all."""
    generator = torch.Generator().manual_seed(7)
    inputs = torch.randint(4, VOCAB, (64, 16), generator=generator)
    with torch.no_grad():
        picks = model(inputs).logits.argmax(-1).flatten()
    freq = torch.bincount(picks, minlength=VOCAB).float() / picks.numel()
    return int((freq - rate).abs().argmin())


def save_pair(arch: str, root: pathlib.Path, noise: float = 0.08) -> tuple[str, str]:
    """Save a (target, draft) pair of `arch` under root; returns their directories."""
    target = BUILDERS[arch](seed=0)
    draft = noisy_copy(target, seed=1, scale=noise)
    eos = pick_eos(target)
    paths = []
    for name, model in (("target", target), ("draft", draft)):
        path = root / f"{arch}-{name}"
        model.config.eos_token_id = eos
        model.generation_config.eos_token_id = eos
        models.save_model(model, path)
        paths.append(str(path))
    return paths[0], paths[1]



# ---- a pair of two tokenizers ---------------------------------------------------------------
EOS_TEXT = "<eos>"
_WORDS = {"subject": ["the cat", "a dog", "the old man", "my sister", "the bird", "a robot"],
          "verb": ["sees", "likes", "finds", "chases", "paints", "calls"],
          "object": ["the ball", "a red box", "the moon", "her friend", "the garden",
                     "a small fish"],
          "end": [".", " today.", " again.", " at night."]}


def corpus(count: int, seed: int = 0) -> list[str]:
    """`count` short documents of made-up sentences: text two tiny models of different
    tokenizers can both learn, so that one drafts what the other writes, often but not
    always."""
    import random

    rng = random.Random(seed)
    docs = []
    for _ in range(count):
        sentences = [" ".join([rng.choice(_WORDS["subject"]), rng.choice(_WORDS["verb"]),
                               rng.choice(_WORDS["object"])]) + rng.choice(_WORDS["end"])
                     for _ in range(rng.randint(2, 4))]
        docs.append(" ".join(s[0].upper() + s[1:] for s in sentences))
    return docs


def byte_bpe_tokenizer(texts: list[str], vocab_size: int):
    """A GPT-2-style byte-level BPE tokenizer trained on texts, with EOS_TEXT as a special
    token."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tokenizer


def character_tokenizer(texts: list[str]):
    """A character-level tokenizer of the characters in texts, with EOS_TEXT special."""
    from tokenizers import AddedToken, Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel

    chars = sorted(set("".join(texts)))
    tokenizer = Tokenizer(WordLevel({c: i for i, c in enumerate(["<unk>"] + chars)},
                                    unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    tokenizer.add_special_tokens([AddedToken(EOS_TEXT, special=True)])
    return tokenizer


def train_on(model, tokenizer, texts: list[str], steps: int, seed: int = 0, length: int = 48):
    """Train `model` for `steps` batches of `length`-token windows of texts (each followed
    by EOS) under `tokenizer`. Returns the model, in eval mode."""
    eos = tokenizer.token_to_id(EOS_TEXT)
    ids = [t for text in texts for t in tokenizer.encode(text).ids + [eos]]
    data = torch.tensor(ids)
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    with torch.enable_grad():  # whatever the calling thread's mode (services turn it off)
        for _ in range(steps):
            starts = torch.randint(0, len(data) - length - 1, (32,), generator=generator)
            batch = torch.stack([data[s:s + length] for s in starts.tolist()])
            loss = model(batch, labels=batch).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    return model.eval()


def save_translating_pair(arch: str, root: pathlib.Path, steps: int = 300) -> tuple[str, str]:
    """(target dir, draft dir): a target of `arch` with a byte-level BPE tokenizer and a draft
    of the other architecture with a character-level one, both trained a little on the same
    text (corpus), each saved with its tokenizer. Their ids mean different text: the draft
    serves the target through translation (draft_service.translating)."""
    from transformers import PreTrainedTokenizerFast

    texts = corpus(400)
    target_tokens = byte_bpe_tokenizer(texts, vocab_size=320)
    draft_tokens = character_tokenizer(texts)
    other = "gpt2" if arch == "llama" else "llama"
    paths = []
    for name, build, tokenizer, seed in (("target", BUILDERS[arch], target_tokens, 0),
                                         ("draft", BUILDERS[other], draft_tokens, 1)):
        torch.manual_seed(seed)
        model = train_on(build(seed, vocab=tokenizer.get_vocab_size()), tokenizer, texts,
                         steps, seed)
        eos = tokenizer.token_to_id(EOS_TEXT)
        model.config.eos_token_id = model.generation_config.eos_token_id = eos
        path = root / f"{arch}-{name}-{'bpe' if name == 'target' else 'chars'}"
        models.save_model(model, path)
        PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=EOS_TEXT,
                                unk_token="<unk>" if name == "draft" else None
                                ).save_pretrained(path)
        paths.append(str(path))
    return paths[0], paths[1]


def save_one_layer_target(root: pathlib.Path) -> str:
    """A Llama-style target of one layer: a feature head can equal it (save_feature_head)."""
    target = llama(seed=3)
    target.model.layers = target.model.layers[:1]
    target.config.num_hidden_layers = 1
    target.config.layer_types = target.config.layer_types[:1] \
        if getattr(target.config, "layer_types", None) else None
    eos = pick_eos(target)
    target.config.eos_token_id = target.generation_config.eos_token_id = eos
    path = root / "llama1-target"
    models.save_model(target, path)
    return str(path)


def save_feature_head(target_dir: str, out: pathlib.Path, *, exact: bool = False) -> str:
    """A feature-level draft head for the target in target_dir, untrained, over the whole
    vocabulary: started from the target's last layer
    (batchspec.runtime.feature_head.FeatureHead.init_from_target). exact (a one-layer
    target): the head reads only its token's embedding through that layer, so it computes
    what the target computes and proposes the target's own distribution."""
    from batchspec.runtime import feature_head, models

    target = models.load_causal_lm(target_dir)
    head = feature_head.build_head(target, list(range(int(target.config.vocab_size))),
                                   models.max_context_len(target))
    head.init_from_target(target)
    if exact:
        if target.config.num_hidden_layers != 1:
            raise ValueError("only a one-layer target has an exact head")
        width = head.feature_width
        head.body.layers[0].load_state_dict(target.model.layers[0].state_dict())
        with torch.no_grad():
            head.fuse.weight.zero_()
            head.fuse.weight[:, :width] = torch.eye(width)
    feature_head.save_head(out, head, {"base_model": target_dir,
                                       "feature_width": head.feature_width,
                                       "training": {"command": "untrained (tests)"}})
    return str(out)


def save_gguf(root: pathlib.Path, seed: int = 5) -> str:
    """The tiny Llama-style target written as a GGUF file the way llama.cpp writes one: q and k
    rows permuted for its rotary layout, every linear weight in Q4_1, the embedding and the
    output head in Q8_0, norms in float32, a vocabulary of made-up words. Returns the file's
    path."""
    import gguf

    model = llama(seed)
    config = model.config
    path = root / "tiny-llama.Q4_1.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(float(getattr(config, "rope_theta", 10000.0) or 10000.0))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(pick_eos(model))
    # a vocabulary of made-up words, so that llama.cpp loads the file too (it needs one)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<unk>", "<s>", "</s>"] + [f"\u2581w{i}" for i in range(3, VOCAB)])
    writer.add_token_scores([0.0] * VOCAB)
    writer.add_token_types([2, 3, 3] + [1] * (VOCAB - 3))  # unknown, control, normal
    writer.add_unk_token_id(0)

    def add(name: str, weight: torch.Tensor, kind) -> None:
        data = weight.detach().float().numpy()
        if kind != gguf.GGMLQuantizationType.F32:
            data = gguf.quants.quantize(data, kind)
        writer.add_tensor(name, data, raw_dtype=kind)

    def permuted(weight: torch.Tensor, heads: int) -> torch.Tensor:  # llama.cpp's q/k layout
        rows = weight.shape[0]
        return weight.reshape(heads, 2, rows // heads // 2, -1).swapaxes(1, 2).reshape(rows, -1)

    q4, q8, f32 = (gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0,
                   gguf.GGMLQuantizationType.F32)
    add("token_embd.weight", model.model.embed_tokens.weight, q8)
    add("output_norm.weight", model.model.norm.weight, f32)
    add("output.weight", model.lm_head.weight, q8)
    for i, layer in enumerate(model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        add(f"blk.{i}.attn_norm.weight", layer.input_layernorm.weight, f32)
        add(f"blk.{i}.ffn_norm.weight", layer.post_attention_layernorm.weight, f32)
        add(f"blk.{i}.attn_q.weight", permuted(attn.q_proj.weight, config.num_attention_heads),
            q4)
        add(f"blk.{i}.attn_k.weight", permuted(attn.k_proj.weight, config.num_key_value_heads),
            q4)
        add(f"blk.{i}.attn_v.weight", attn.v_proj.weight, q4)
        add(f"blk.{i}.attn_output.weight", attn.o_proj.weight, q4)
        add(f"blk.{i}.ffn_gate.weight", mlp.gate_proj.weight, q4)
        add(f"blk.{i}.ffn_up.weight", mlp.up_proj.weight, q4)
        add(f"blk.{i}.ffn_down.weight", mlp.down_proj.weight, q4)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)
