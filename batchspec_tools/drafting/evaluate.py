"""`batchspec evaluate-draft`: how good a draft is for a target, on held-out chat prompts.

- agreement: teacher-forced on the target's own greedy answers to the benchmark prompts (which
  no draft is trained on), the share of answer positions where the draft's argmax is the
  target's token;
- sampled agreement (--temperature, --top-p): on the same answers, the share of positions where
  the draft's seeded sample is the target's (both Gumbel-max samples with the noise of one
  seed and that position, as the services draw them: batchspec.runtime.sampling), which is
  how often a sampled request accepts a draft token there;
- cost: the median time of one decode step (one token, batch 1, a 200-token cache) of the
  draft over that of the target, measured the same way in the same process, both with the CPU
  kernel plans the services use (batchspec.runtime.fastlinear.tune).
"""
import json
import logging
import os
import pathlib
import shlex
import statistics
import sys
import time

from batchspec import cliargs
from batchspec_tools import data
from batchspec_tools.data import read_jsonl

log = logging.getLogger("batchspec.evaluate")


def target_answers(target, tokenizer, prompts: list[str], max_new_tokens: int,
                   batch_size: int = 16) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, greedy answer ids up to EOS) for each prompt."""
    from batchspec.runtime.models import chat_ids
    from batchspec_tools.drafting.distill import answer_batches

    ids = [chat_ids(tokenizer, p) for p in prompts]
    pairs = []
    for start, answers in answer_batches(target, ids, max_new_tokens, batch_size):
        pairs += zip(ids[start:start + len(answers)], answers)
    return pairs


def agreement(draft, pairs) -> float:
    import torch

    matches = total = 0
    with torch.inference_mode():
        for prompt_ids, answer in pairs:
            logits = draft(torch.tensor([prompt_ids + answer])).logits[0]
            predicted = logits[len(prompt_ids) - 1:len(prompt_ids) + len(answer) - 1].argmax(-1)
            matches += int((predicted == torch.tensor(answer)).sum())
            total += len(answer)
    return matches / max(1, total)


def sampled_agreement(target, draft, pairs, params) -> float:
    """The share of answer positions where the draft's seeded choice under `params` (a
    SamplingParams; pair i seeded i) is the target's, both teacher-forced on the answers."""
    import dataclasses

    import torch

    from batchspec.runtime import sampling

    matches = total = 0
    with torch.inference_mode():
        for i, (prompt_ids, answer) in enumerate(pairs):
            ids = torch.tensor([prompt_ids + answer])
            span = slice(len(prompt_ids) - 1, len(prompt_ids) + len(answer) - 1)
            row = [dataclasses.replace(params, seed=i)]
            first = [len(prompt_ids)]  # the position of the answer's first token
            wanted = sampling.choose(target(ids).logits[:, span], row, first)
            drafted = sampling.choose(draft(ids).logits[:, span], row, first)
            matches += int((wanted == drafted).sum())
            total += len(answer)
    return matches / max(1, total)


def decode_step_seconds(model, context: int = 200, repeats: int = 40) -> float:
    import torch

    from batchspec.runtime import kvcache

    with torch.inference_mode():
        vocab = min(1000, model.config.vocab_size)  # any ids the embedding holds
        out = model(torch.randint(0, vocab, (1, context)), use_cache=True)
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            step = model(torch.tensor([[5]]), use_cache=True,
                         **kvcache.with_cache(model, kvcache.returned_cache(out)))
            times.append(time.perf_counter() - started)
            out = step
    return statistics.median(times)


def training_pairs(directory: str, max_new_tokens: int, every: int = 14):
    """(prompt ids, answer ids) of every `every`-th sequence a `distill` directory trained on,
    answers cut to max_new_tokens: how well a draft fits its own training data."""
    from batchspec_tools.drafting.distill import DATA_FILE

    path = pathlib.Path(directory) / DATA_FILE
    if not path.is_file():
        raise SystemExit(f"evaluate-draft: {path} not found (not a distill directory?)")
    rows = read_jsonl(path)
    return [(r["input_ids"], r["output_ids"][:max_new_tokens]) for r in rows[::every]
            if r["output_ids"]]


def evaluate(target_spec: str, draft_spec: str, *, num_layers: int | None = None,
             max_new_tokens: int = 64, num_prompts: int | None = None,
             training_data: str | None = None, temperature: float = 0.0,
             top_p: float = 1.0, loaded: tuple | None = None) -> dict:
    """The draft's agreement with the target and their step costs. loaded: what
    load_models(target_spec, draft_spec, num_layers) returned (else loaded here)."""
    target, draft, tokenizer = loaded or load_models(target_spec, draft_spec, num_layers)
    if training_data:
        pairs = training_pairs(training_data, max_new_tokens)
    else:
        prompts = [r["prompt"] for r in data.bench_prompts(num_prompts)]
        pairs = target_answers(target, tokenizer, prompts, max_new_tokens)
    from batchspec.runtime import cache_dir, fastlinear

    for model in (target, draft):  # the kernel plans the services and the benchmark use
        fastlinear.tune(model, cache_dir.kernel_plans_file())
    target_s, draft_s = decode_step_seconds(target), decode_step_seconds(draft)
    sampled = {}
    if temperature > 0:
        from batchspec.params import SamplingParams

        params = SamplingParams(temperature=temperature, top_p=top_p)
        sampled = {"temperature": temperature, "top_p": top_p,
                   "sampled_agreement": round(sampled_agreement(target, draft, pairs, params), 4)}
    return {**sampled,"target": target_spec, "draft": draft_spec, "draft_num_layers": num_layers,
            "prompts": training_data or "benchmark",
            "num_prompts": len(pairs), "num_answer_tokens": sum(len(a) for _, a in pairs),
            "greedy_agreement": round(agreement(draft, pairs), 4),
            "target_step_ms": round(target_s * 1000, 2), "draft_step_ms": round(draft_s * 1000, 2),
            "draft_cost_ratio": round(draft_s / target_s, 4)}


def load_models(target_spec: str, draft_spec: str, num_layers: int | None = None) -> tuple:
    """(target, draft, the target's tokenizer); OSError where one cannot be loaded (a hub id
    not fetched, a directory with no model)."""
    from batchspec.runtime import models

    return (models.load_causal_lm(target_spec),
            models.load_causal_lm(draft_spec, num_layers=num_layers),
            models.load_tokenizer(target_spec))


def build_parser():
    parser = cliargs.parser("batchspec evaluate-draft", __doc__)
    parser.add_argument("--target", default="smollm2", help="target model")
    parser.add_argument("--draft", required=True, help="draft model dir (or any --model value)")
    parser.add_argument("--num-layers", type=cliargs.positive_int, default=None,
                        help="keep only the draft's first N layers (plain models only)")
    parser.add_argument("--max-new-tokens", type=cliargs.positive_int, default=64,
                        help="most tokens of each target answer")
    parser.add_argument("--num-prompts", type=cliargs.positive_int, default=None,
                        help="default: all")
    parser.add_argument("--training-data", default=None, metavar="DIR",
                        help="measure agreement on every 14th sequence a distill directory "
                             "trained on, instead of the held-out benchmark prompts")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="also measure agreement of seeded samples at this temperature "
                             "(what a sampled request accepts)")
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="the sampled agreement's top_p")
    parser.add_argument("--record", action="store_true",
                        help="store the result in the draft directory's manifest")
    return parser


def main(argv=None) -> int:
    parser = build_parser()
    argv_list = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv_list)
    from batchspec.runtime import draft_model, models
    from batchspec_tools.drafting.distill import DATA_FILE

    for flag, spec in (("--target", args.target), ("--draft", args.draft)):
        if spec in ("ngram", "none", "auto"):
            parser.error(f"{flag} {spec}: not a model (evaluate-draft measures a model draft)")
        try:
            models.check_spec(spec)
        except ValueError as error:
            parser.error(f"{flag}: {error}")
    if args.num_layers is not None and models.is_draft_directory(args.draft):
        parser.error("--num-layers: a distilled draft directory fixes its own number of layers")
    if args.training_data and not (pathlib.Path(args.training_data) / DATA_FILE).is_file():
        parser.error(f"--training-data {args.training_data}: no {DATA_FILE} there (not a "
                     f"distill directory?)")
    draft_dir = models.model_path(args.draft)
    if args.record and args.training_data:
        parser.error("--record stores the held-out figure in the manifest; it does not go "
                     "with --training-data")
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        parser.error("--temperature must be >= 0 and --top-p in (0, 1]")
    if args.record and not draft_model.is_draft_dir(draft_dir):
        parser.error(f"--record needs a distilled draft directory, not {args.draft!r}")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s evaluate %(message)s")
    try:
        loaded = load_models(args.target, args.draft, args.num_layers)
    except OSError as error:
        print(f"evaluate-draft: cannot load the models: {error}", file=sys.stderr)
        return 1
    result = evaluate(args.target, args.draft, num_layers=args.num_layers,
                      max_new_tokens=args.max_new_tokens, num_prompts=args.num_prompts,
                      training_data=args.training_data, temperature=args.temperature,
                      top_p=args.top_p, loaded=loaded)
    print(json.dumps(result, indent=2))
    if args.record:
        manifest = pathlib.Path(draft_dir) / draft_model.MANIFEST
        record = json.loads(manifest.read_text())
        record["evaluation"] = {
            **result, "command": "batchspec evaluate-draft " + shlex.join(argv_list),
            "date": f"{time.strftime('%Y-%m-%d')}, {os.cpu_count()} CPU cores, float32"}
        manifest.write_text(json.dumps(record, indent=2))
    return 0
