"""`batchspec bench`: batchspec against what a user would otherwise run, side by side, in one run.

Every method decodes the same prompts with the same model pair, dtype, device and
max_new_tokens. One counting rule for all: generated tokens up to and including the first EOS,
at most max_new_tokens; only generation is timed (no I/O or display inside timed regions).
The exact-match reference is method 1, the target alone at batch 1.
"""
import argparse
import concurrent.futures
import contextlib
import dataclasses
import datetime
import json
import logging
import os
import pathlib
import platform
import signal
import subprocess
import sys
import tempfile
import time

from batchspec import cliargs
from batchspec_tools.bench import closed_loop, llamacpp
from coordinator.config import EngineConfig
from coordinator.local_draft import LOCAL_NGRAM

log = logging.getLogger("batchspec_tools.bench.run")

METHODS = {
    "hf_stock_batch1": "0a. stock transformers: the target alone, batch 1, unpatched model "
                       "(what a transformers user runs)",
    "hf_stock_batched": "0b. stock transformers: batched, left-padded, unpatched model",
    "hf_batch1": "1. target alone, batch 1 (HF generate, with batchspec's CPU linear kernels)",
    "hf_batched": "2. target alone, batched (HF generate, left-padded, batchspec's kernels)",
    "hf_assisted": "3. HF assisted generation (batch 1)",
    "engine_grouped": "5. batchspec engine in-process, cohorts formed by equal length (EXSPEC), "
                      "kept together so each service reuses their batch",
    "grpc": "6. batchspec over gRPC processes, the model draft alone",
    "grpc_ngram": "7. batchspec over gRPC, the n-gram draft alone (prompt lookup, no model)",
    "grpc_router": "8. batchspec over gRPC, the model and n-gram drafts chosen per sequence "
                   "(the default of `batchspec serve`)",
    "grpc_router_predicted": "8b. as 8, with --step-aside off: the goodput policy's "
                             "predictions alone decide, measured delivery is not consulted",
    "grpc_target_only": "9. batchspec over gRPC with no draft: plain batched decoding through "
                        "the same services (what the serving path costs)",
    "llamacpp": "10. llama.cpp's server (PyPI xllamacpp) on the same GGUF file, plain: what a "
                "CPU user would otherwise run (its own 4-bit kernels, activations in 8 bits: "
                "not the float32 model, so no exactness); closed-loop clients only",
    "llamacpp_ngram": "10b. as 10, with llama.cpp's own n-gram speculation (ngram_mod)",
}
# Methods run only when asked for by name (--methods): they need llama.cpp's server
LLAMACPP = tuple(llamacpp.METHODS)
# The drafts each gRPC method's coordinator uses, and the flags it adds.
GRPC_DRAFTS = {"grpc": ("model",), "grpc_ngram": ("ngram",), "grpc_router": ("model", "ngram"),
               "grpc_router_predicted": ("model", "ngram"), "grpc_target_only": ()}
GRPC_FLAGS = {"grpc_router_predicted": ("--step-aside", "off")}
USES_BATCH = {"hf_stock_batched", "hf_batched", "engine_grouped", *GRPC_DRAFTS}
# Where a run's wall time went, in report order. prefill: admitting prompts into both caches;
# draft, verify: the services' compute; realign: the services' time on unaligned rows, masks and
# copies into a left-padded batch (taken out of draft and verify); rpc: round trips minus
# compute; coordinator: the rest (scheduling, bookkeeping, streaming).
BREAKDOWN = ("prefill", "draft", "verify", "realign", "rpc", "coordinator")
USES_K = {"hf_assisted", "engine_grouped",
          *(m for m, drafts in GRPC_DRAFTS.items() if drafts)}


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    target: str = "smollm2"
    draft: str | None = None  # default: the packaged distilled draft
    draft_layers: int | None = None
    draft_host: str = "target"  # the gRPC methods' model draft: in the target, or own
    num_prompts: int = 82
    max_new_tokens: int = 64
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    ks: tuple[int, ...] = (EngineConfig.num_draft_tokens,)
    methods: tuple[str, ...] = tuple(m for m in METHODS if m not in LLAMACPP)
    out: str = "bench-out"
    quick: bool = False
    min_draft_confidence: float = EngineConfig.min_draft_confidence
    draft_policy: str = EngineConfig.draft_policy  # methods 4-6
    step_aside: bool = EngineConfig.step_aside  # the gRPC methods' coordinators
    # Poisson arrival rates (requests per second) for the arrival-driven load over gRPC
    arrival_rates: tuple[float, ...] = ()
    load_batch_size: int = 32  # the coordinator's --batch-size under that load
    # closed-loop clients: at each of these concurrencies, every gRPC method of `methods` serves
    # the prompt set to C clients that each send their next request when the last one ends
    # (instead of the batch sweep for those methods)
    concurrency: tuple[int, ...] = ()
    step_logs: str | None = None  # a directory: each gRPC run's coordinator logs its steps
    dtype: str = "auto"  # of both models, in every method (models.load_causal_lm)
    # the served model draft's --dtype (None: as `batchspec serve` gives it, see
    # models.draft_service_dtype); the in-process methods keep `dtype`
    draft_dtype: str | None = None
    # where both models run, in every method (the services' --device; the n-gram draft has none)
    device: str = "cpu"
    prompts: str | None = None  # a JSONL file of {"prompt": ...}; default: the packaged set
    by_category: bool = False  # run the sweep once per prompt category, side by side
    # run the whole sweep this many times, in turn, and report each setting's median run:
    # a machine whose speed drifts then moves every method alike
    repeat: int = 1
    # sampled requests in the closed-loop runs (temperature 0: greedy); request i is seeded i
    temperature: float = 0.0
    top_p: float = 1.0
    # instead of the sweep: a free model's steps stage by stage (batchspec_tools.bench.overhead)
    overhead: bool = False
    # instead of the sweep: a feature head decoding in one process (bench.head_check)
    head_check: bool = False

    def __post_init__(self):
        unknown = set(self.methods) - set(METHODS)
        if unknown:
            raise ValueError(f"unknown methods {sorted(unknown)}; choose from {list(METHODS)}")
        if min(self.batch_sizes) < 1 or min(self.ks) < 1 or self.max_new_tokens < 1:
            raise ValueError("batch sizes, K and max_new_tokens must be >= 1")
        if self.repeat < 1 or self.num_prompts < 1:
            raise ValueError("--repeat and --num-prompts must be >= 1")
        if not cliargs.writable_dir(self.out):
            raise ValueError(f"--out {self.out}: cannot write a report there")
        if any(rate <= 0 for rate in self.arrival_rates) or self.load_batch_size < 1:
            raise ValueError("arrival rates must be > 0 and --load-batch-size >= 1")
        if any(c < 1 for c in self.concurrency):
            raise ValueError("--concurrency takes client counts >= 1")
        if self.by_category and (self.arrival_rates or self.concurrency):
            raise ValueError("--arrival-rates and --concurrency load the whole prompt set: run "
                             "them without --by-category")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError("--temperature must be >= 0 and --top-p in (0, 1]")
        if self.temperature > 0 and not self.head_check and (
                not self.concurrency or self.arrival_rates or set(
                self.methods) - set(GRPC_DRAFTS) - set(LLAMACPP)):
            raise ValueError("--temperature samples in the closed-loop runs: give --concurrency "
                             "and only gRPC methods (--methods grpc_router,grpc_target_only, "
                             "...) or llama.cpp's, without --arrival-rates")
        if set(self.methods) & set(LLAMACPP):
            self._check_llamacpp()
        if self.overhead and (self.quick or self.concurrency or self.arrival_rates
                              or self.temperature > 0 or self.by_category or self.prompts):
            raise ValueError("--overhead serves its own free model and prompts: give it only "
                             "--max-new-tokens, --repeat, --draft-host and --out")
        if self.head_check and (self.overhead or self.concurrency or self.arrival_rates
                                or len(self.ks) != 1):
            raise ValueError("--head-check decodes at batch 1 with one --ks: give it --draft, "
                             "--ks, --prompts, --num-prompts, --max-new-tokens and, to sample, "
                             "--temperature and --top-p")
        if self.head_check:
            from batchspec.runtime import models

            if not models.is_feature_head(self.draft or models.SMOLLM2_EAGLE):
                raise ValueError(f"--head-check drafts with a feature head: --draft "
                                 f"{self.draft!r} is not one (e.g. {models.SMOLLM2_EAGLE})")
        if self.prompts is not None and not pathlib.Path(self.prompts).is_file():
            raise ValueError(f"--prompts {self.prompts}: no such file")
        from batchspec.runtime import models

        for spec in () if self.quick else (self.target, self.draft):  # --quick: tiny models
            if spec is not None:
                models.check_spec(spec)
        models.check_device(self.device)
        models.check_present(self.device)

    def _check_llamacpp(self) -> None:
        if not self.concurrency or self.device != "cpu":
            raise ValueError("the llama.cpp methods serve closed-loop clients on the CPU: give "
                             "--concurrency (and no --device)")
        if not llamacpp.available():
            raise ValueError("the llama.cpp methods need llama.cpp's server: pip install "
                             "xllamacpp")
        llamacpp.gguf_path(self.target)  # ValueError for a target that is no GGUF file


@dataclasses.dataclass
class Workload:
    target: str
    draft: str
    draft_layers: int | None
    prompts: list[list[int]]
    max_new_tokens: int
    eos_token_ids: list[int]
    # adaptive draft length (methods 3 to 6 alike; None: the server's default)
    min_draft_confidence: float | None = None
    draft_policy: str = EngineConfig.draft_policy  # methods 4-6
    dtype: str = "auto"
    categories: list[str] = dataclasses.field(default_factory=list)  # one per prompt
    device: str = "cpu"  # of both models, in every method
    draft_dtype: str | None = None  # the served model draft's (BenchConfig.draft_dtype)
    sampling: dict = dataclasses.field(default_factory=dict)  # temperature, top_p; {}: greedy
    step_aside: bool = EngineConfig.step_aside  # the gRPC methods' coordinators
    draft_host: str = "target"  # the model draft: hosted by the target service, or "own"

    def request_fields(self, i: int) -> dict:
        """GenerateRequest fields of prompt i's request: its sampling settings, seeded i."""
        return dict(self.sampling, seed=i) if self.sampling else {}

    @property
    def draft_service_dtype(self) -> str:
        """The --dtype the served model draft is started with (auto where `dtype` is
        float32 and no draft_dtype is given, as `batchspec serve` does)."""
        from batchspec.runtime import models

        return models.draft_service_dtype(self.dtype, self.draft_dtype)

    def split(self) -> dict[str, "Workload"]:
        """{category: the workload of its prompts}, in first-seen order."""
        names = list(dict.fromkeys(self.categories))
        return {name: dataclasses.replace(
            self, prompts=[p for p, c in zip(self.prompts, self.categories) if c == name],
            categories=[name] * self.categories.count(name)) for name in names}


@dataclasses.dataclass
class Run:
    """What one method produced in one setting."""

    outputs: list[list[int]]
    seconds: float
    num_drafted: int = 0
    num_accepted: int = 0
    num_steps: int = 0  # sequence-steps: one per sequence per target pass it took part in
    realigned_share: float | None = None
    breakdown: dict | None = None


def main(argv=None) -> int:
    from batchspec.server import parse_config

    config = parse_config(build_parser(), sys.argv[1:] if argv is None else argv,
                          config_from_args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s bench %(message)s")
    # stopped with SIGTERM (kill, a CI's timeout), unwind as on Ctrl-C, so that the services
    # it started are stopped too (by default the signal ends it at once and leaves them)
    signal.signal(signal.SIGTERM, _stop)
    if config.overhead:
        paths = write_overhead(config)
    elif config.head_check:
        paths = write_head_check(config)
    else:
        paths = write_report(run(config), pathlib.Path(config.out))
    print("\n".join(f"wrote {p}" for p in paths))
    return 0


def _stop(signum, frame):
    raise SystemExit(128 + signum)


def build_parser() -> argparse.ArgumentParser:
    from batchspec.runtime import models

    parser = cliargs.parser("batchspec bench", __doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true",
                        help="a small subset on tiny random models, well under a minute")
    parser.add_argument("--target", default="smollm2", help="target model")
    parser.add_argument("--draft", default=None,
                        help="the draft model of the grpc methods (a model, or a shipped draft: "
                             "smollm2-draft, smollm2-eagle); default: the best shipped for the "
                             "target")
    parser.add_argument("--draft-layers", type=int, default=None,
                        help="keep only the draft's first N layers")
    parser.add_argument("--num-prompts", type=int, default=82,
                        help="prompts to run (categories taken in turn)")
    parser.add_argument("--max-new-tokens", type=int, default=64,
                        help="most tokens generated per prompt")
    parser.add_argument("--batch-sizes", default=None,
                        help="batch sizes to sweep, comma-separated (default 1,2,4,8,16,32; "
                             "with --quick 1,4)")
    parser.add_argument("--ks", default=None,
                        help="K values (with the goodput policy: the most a step drafts; "
                             f"default {EngineConfig.num_draft_tokens}; with --quick 2,4)")
    parser.add_argument("--draft-policy", choices=("goodput", "fixed"),
                        default=EngineConfig.draft_policy,
                        help="batchspec's draft length: goodput (the default of `serve`) or "
                             "fixed K")
    parser.add_argument("--draft-host", choices=("target", "own"), default="target",
                        help="the gRPC methods' model draft: hosted by the target service "
                             "(as `serve` runs it; its proposals ride in the verify) or in a "
                             "draft service of its own")
    parser.add_argument("--step-aside", choices=("on", "off"),
                        default="on" if EngineConfig.step_aside else "off",
                        help="the gRPC methods' --step-aside (on, as `serve`: decode plainly "
                             "where drafted steps measure slower; off: the policy alone "
                             "decides, which with --draft-policy fixed drafts every step)")
    parser.add_argument("--arrival-rates", default="",
                        help="also run an arrival-driven load over gRPC: Poisson arrivals at "
                             "these rates (requests/s, comma-separated), batchspec against "
                             "the same server decoding with the target alone; reports "
                             "throughput, TTFT and ITL p50/p99")
    parser.add_argument("--concurrency", default="",
                        help="serve the prompt set to C closed-loop clients (each sends its "
                             "next request when its last one ends) at each of these "
                             "concurrencies (comma-separated), for every gRPC method of "
                             "--methods, taken in turn; with --repeat, medians and their "
                             "spread; reports throughput, TTFT and ITL p50/p99, each "
                             "method over grpc_target_only (the same server without drafts), "
                             "and each process's CPU seconds")
    parser.add_argument("--step-logs", default=None,
                        help="a directory where each gRPC run's coordinator writes its "
                             "--step-log (METHOD-cC-rROUND.jsonl for closed-loop clients, "
                             "METHOD-bB-kK-rROUND.jsonl for batch runs)")
    parser.add_argument("--prompts", default=None,
                        help="JSONL file of {\"prompt\": ..., \"category\": ...} chat prompts "
                             "(default: the packaged benchmark prompts; the packaged "
                             "copy-heavy set is batchspec_tools/data/category_prompts.jsonl)")
    parser.add_argument("--repeat", type=int, default=1,
                        help="run the whole sweep N times in turn and report each setting's "
                             "median run (its tok/s of every run kept in results.json); with "
                             "--overhead, N rounds of its kinds of steps in turns")
    parser.add_argument("--by-category", action="store_true",
                        help="run every method once per prompt category and report each "
                             "category's speed and acceptance apart")
    parser.add_argument("--dtype", default=models.AUTO, choices=models.DTYPE_CHOICES,
                        help="dtype of both models in every method; `exact` then compares with "
                             "the target alone at batch 1 in the same dtype")
    parser.add_argument("--draft-dtype", default=None, choices=models.DTYPE_CHOICES,
                        help="the served model draft's dtype, as `batchspec serve "
                             "--draft-dtype` (default: what serve gives it)")
    parser.add_argument("--device", default="cpu",
                        help="where both models run in every method, the services included "
                             "(cpu, cuda, cuda:N, xpu[:N], mps); the n-gram draft needs none")
    parser.add_argument("--load-batch-size", type=int, default=32,
                        help="the coordinator's --batch-size under the arrival-driven load")
    parser.add_argument("--methods", default=",".join(BenchConfig.methods),
                        help="methods to run, comma-separated (default: all but llama.cpp's, "
                             "which need `pip install xllamacpp`; the report lists them)")
    parser.add_argument("--out", default="bench-out", help="report directory")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="sample the closed-loop runs' requests at this temperature "
                             "(request i seeded i; exactness then against the plain server's "
                             "answers; with --head-check, prompt i seeded i); default: greedy")
    parser.add_argument("--top-p", type=float, default=1.0,
                        help="the sampled requests' top_p")
    parser.add_argument("--overhead", action="store_true",
                        help="instead of the sweep: the served stack over a model that costs "
                             "almost nothing, plain, drafted (K = 4, all accepted) and four "
                             "plain steps a command at 1 and 16 clients, each stage of a step "
                             "in ms (coordinator, each RPC, service work, forwards); with "
                             "--max-new-tokens")
    parser.add_argument("--head-check", action="store_true",
                        help="instead of the sweep: a feature head (--draft, default "
                             "smollm2-eagle) drafting --ks tokens for its target in one process "
                             "at batch 1, as the services do (greedy, or at --temperature): "
                             "acceptance by draft position, tokens per target pass, the head's "
                             "cost per drafted token, features on the wire (--draft-dtype: the "
                             "head's, default float32)")
    parser.add_argument("--min-draft-confidence", type=float,
                        default=EngineConfig.min_draft_confidence,
                        help="cut greedy drafts where the draft's confidence falls below "
                             "this (also given to HF assisted generation); 0: always draft K; "
                             "default: the server's (see batchspec serve --help; 0 for HF)")
    return parser


def numbers(text: str, flag: str, kind=int) -> tuple:
    """A flag's comma-separated numbers of `kind`; ValueError naming the flag otherwise."""
    try:
        return tuple(kind(x) for x in text.split(",") if x)
    except ValueError:
        what = "whole numbers" if kind is int else "numbers"
        raise ValueError(f"{flag} takes {what}, comma-separated, not {text!r}") from None


def config_from_args(args) -> BenchConfig:
    batch_sizes = numbers(args.batch_sizes, "--batch-sizes") if args.batch_sizes else \
        (1, 4) if args.quick else (1, 2, 4, 8, 16, 32)
    ks = numbers(args.ks, "--ks") if args.ks else (2, 4) if args.quick else \
        (EngineConfig.num_draft_tokens,)
    if args.quick:
        return BenchConfig(target="tiny", num_prompts=8, max_new_tokens=12,
                           batch_sizes=batch_sizes, ks=ks, out=args.out, quick=True,
                           by_category=args.by_category, repeat=args.repeat,
                           methods=tuple(m for m in args.methods.split(",") if m),
                           draft_policy=args.draft_policy,
                           arrival_rates=numbers(args.arrival_rates, "--arrival-rates",
                                                 float),
                           load_batch_size=args.load_batch_size, dtype=args.dtype,
                           concurrency=numbers(args.concurrency, "--concurrency"),
                           step_logs=args.step_logs,
                           device=args.device, temperature=args.temperature,
                           top_p=args.top_p, overhead=args.overhead,
                           min_draft_confidence=args.min_draft_confidence,
                           draft_host=args.draft_host)
    return BenchConfig(target=args.target, draft=args.draft, draft_layers=args.draft_layers,
                       num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens,
                       batch_sizes=batch_sizes, ks=ks,
                       methods=tuple(m for m in args.methods.split(",") if m), out=args.out,
                       min_draft_confidence=args.min_draft_confidence,
                       draft_policy=args.draft_policy, step_aside=args.step_aside == "on",
                       arrival_rates=numbers(args.arrival_rates, "--arrival-rates", float),
                       load_batch_size=args.load_batch_size, dtype=args.dtype,
                       prompts=args.prompts, by_category=args.by_category,
                       repeat=args.repeat, concurrency=numbers(args.concurrency, "--concurrency"),
                       step_logs=args.step_logs, device=args.device,
                       draft_dtype=args.draft_dtype, temperature=args.temperature,
                       top_p=args.top_p, overhead=args.overhead, head_check=args.head_check,
                       draft_host=args.draft_host)


# ---- the workload ------------------------------------------------------------------------------
def build_workload(config: BenchConfig, scratch: pathlib.Path) -> Workload:
    workload = _workload(config, scratch)
    if config.temperature > 0:
        workload.sampling = {"temperature": config.temperature, "top_p": config.top_p}
    workload.step_aside = config.step_aside
    workload.draft_host = config.draft_host
    return workload


def _workload(config: BenchConfig, scratch: pathlib.Path) -> Workload:
    from batchspec.runtime import models

    if config.quick:
        import random

        from batchspec.runtime import tiny

        target, draft = tiny.save_pair("llama", scratch)
        rng = random.Random(0)
        prompts = [[rng.randrange(4, tiny.VOCAB) for _ in range(rng.randint(3, 20))]
                   for _ in range(config.num_prompts)]
        # half of them repeat themselves, as copy-heavy prompts do
        prompts = [p * 3 if i % 2 else p for i, p in enumerate(prompts)]
        eos = models.eos_token_ids(models.load_causal_lm(target))
        return Workload(target, draft, None, prompts, config.max_new_tokens, eos,
                        config.min_draft_confidence, config.draft_policy,
                        categories=["repeating" if i % 2 else "random"
                                    for i in range(len(prompts))], device=config.device)
    from batchspec.runtime.models import chat_ids, load_tokenizer
    from batchspec_tools.data import bench_prompts

    tokenizer = load_tokenizer(config.target)
    rows = bench_prompts(config.num_prompts, config.prompts)
    prompts = [chat_ids(tokenizer, r["prompt"]) for r in rows]
    draft = config.draft or models.best_shipped_draft(config.target) or models.SMOLLM2_DRAFT
    target_model = models.load_causal_lm(config.target)
    return Workload(config.target, draft, config.draft_layers, prompts, config.max_new_tokens,
                    models.eos_token_ids(target_model), config.min_draft_confidence,
                    config.draft_policy, config.dtype, [r["category"] for r in rows],
                    config.device, config.draft_dtype)


def truncate_at_eos(tokens: list[int], eos: set[int], limit: int) -> list[int]:
    out = []
    for token in tokens[:limit]:
        out.append(token)
        if token in eos:
            break
    return out


# ---- methods 1-3: Hugging Face -----------------------------------------------------------------
class PassCounter:
    """Counts forward calls of a model (each call: one target pass over its batch)."""

    def __init__(self, model):
        self.calls = 0
        self.handle = model.register_forward_hook(self._hook)

    def _hook(self, *_):
        self.calls += 1

    def close(self):
        self.handle.remove()


def run_hf(models_, workload: Workload, method: str, batch_size: int, k: int) -> Run:
    import torch

    target, draft = models_["stock" if "stock" in method else "target"], models_["draft"]
    eos = set(workload.eos_token_ids)
    pad = workload.eos_token_ids[0] if workload.eos_token_ids else 0
    outputs, counter = [], PassCounter(target)
    size = batch_size if method.endswith("batched") else 1
    kwargs = {}
    if method == "hf_assisted":
        draft.generation_config.num_assistant_tokens = k
        draft.generation_config.num_assistant_tokens_schedule = "constant"
        draft.generation_config.assistant_confidence_threshold = \
            workload.min_draft_confidence or 0.0
        kwargs["assistant_model"] = draft
    started = time.perf_counter()
    rows_passes = 0
    with torch.inference_mode():
        for i in range(0, len(workload.prompts), size):
            batch = workload.prompts[i:i + size]
            width = max(map(len, batch))
            ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch],
                               device=target.device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch],
                                device=target.device)
            before = counter.calls
            out = target.generate(input_ids=ids, attention_mask=mask, do_sample=False,
                                  max_new_tokens=workload.max_new_tokens, pad_token_id=pad,
                                  eos_token_id=workload.eos_token_ids, **kwargs)
            rows_passes += (counter.calls - before) * len(batch)
            outputs += [truncate_at_eos(row, eos, workload.max_new_tokens)
                        for row in out[:, width:].tolist()]
    seconds = time.perf_counter() - started
    counter.close()
    return Run(outputs, seconds, num_steps=rows_passes)


# ---- methods 4-5: the engine in-process ------------------------------------------------------
def run_engine(runners, workload: Workload, batch_size: int, k: int) -> Run:
    from batchspec_tools.bench.inprocess import InProcessDraft, InProcessTarget
    from coordinator.engine import Engine
    from coordinator.scheduler import CohortPolicy

    count = len(workload.prompts)
    engine = Engine(InProcessTarget(runners["target"], "target"),
                    [[InProcessDraft(runners["draft"], "draft")]],
                    EngineConfig(num_draft_tokens=k, draft_policy=workload.draft_policy,
                                 overlap="off",  # both models in this one process
                                 draft_rounds=1,  # (its target hosts no draft: see inprocess)
                                 min_draft_confidence=workload.min_draft_confidence,
                                 cohort_policy=CohortPolicy(batch_size=batch_size),
                                 max_num_seqs=count, max_queue=count),
                    workload.eos_token_ids)
    started = time.perf_counter()
    handles = [engine.submit(p, workload.max_new_tokens) for p in workload.prompts]
    # Stepped on this thread, which ran every other method's torch work: a second thread
    # running torch costs ~15% on CPU (see batchspec.runtime.compute).
    while engine.pool.load():
        engine.step()
    outputs = [drain(h) for h in handles]
    seconds = time.perf_counter() - started
    engine.stop()
    s = engine.stats
    seqs = [h.seq for h in handles]
    breakdown = {"prefill": s.prefill_seconds,
                 "draft": s.draft_compute_seconds, "verify": s.verify_compute_seconds,
                 "realign": s.realign_seconds,
                 "rpc": (s.draft_seconds - s.draft_compute_seconds)
                 + (s.verify_seconds - s.verify_compute_seconds),
                 "coordinator": seconds - s.draft_seconds - s.verify_seconds - s.prefill_seconds}
    return Run(outputs, seconds, sum(q.stats.num_drafted_tokens for q in seqs),
               sum(q.stats.num_accepted_tokens for q in seqs),
               sum(q.stats.num_target_forward_passes for q in seqs),
               s.num_realigned_steps / max(1, s.num_steps), normalise(breakdown, seconds))


def drain(handle) -> list[int]:
    tokens = []
    while True:
        event = handle.events.get()
        if event.error is not None:
            raise event.error
        tokens += event.token_ids
        if event.finish is not None:
            return tokens


def normalise(breakdown: dict, seconds: float) -> dict:
    """Seconds -> shares of wall time. Realignment happens inside draft and verify, so it is
    taken out of them to keep the shares adding up to one."""
    out = dict(breakdown)
    out["draft"] = max(0.0, out["draft"] - out["realign"] / 2)
    out["verify"] = max(0.0, out["verify"] - out["realign"] / 2)
    return {key: round(max(0.0, value) / seconds, 4) for key, value in out.items()}


# ---- method 6: three processes -----------------------------------------------------------------
def service_commands(workload: Workload) -> list[tuple[str, str, list[str]]]:
    """(role, module, its flags) of each service a GrpcStack starts, in GrpcStack.SERVICES
    order: the target and the model draft on the workload's device (the n-gram draft runs in
    the coordinator's process, as `batchspec serve` runs it); a model draft of another
    tokenizer than the target's translating to the target's tokens. With draft_host "target"
    (as `serve`) the target hosts a model draft of its vocabulary: no draft service."""
    from batchspec.runtime import models

    device = ["--device", workload.device]
    target = ["--model", workload.target, "--dtype", workload.dtype, *device]
    if hosts_draft(workload):
        return [("target", "target_service", target + [
            "--draft-model", workload.draft, "--draft-dtype", workload.draft_service_dtype]
            + (["--draft-num-layers", str(workload.draft_layers)]
               if workload.draft_layers else []))]
    layers = ["--num-layers", str(workload.draft_layers)] if workload.draft_layers else []
    return [("target", "target_service", target),
            ("model", "draft_service",
             ["--model", workload.draft, "--dtype", workload.draft_service_dtype, *device,
              *layers, *models.translation_flags(workload.draft, workload.target)])]


def hosts_draft(workload: Workload) -> bool:
    """Whether the workload's target service hosts its model draft (see service_commands)."""
    from batchspec.runtime import models

    return workload.draft_host == "target" and models.hostable_draft(workload.draft,
                                                                     workload.target)


class GrpcStack:
    """Target and model draft services as processes (started once); a coordinator per
    setting, running the n-gram draft itself where a method uses it."""

    SERVICES = ("target", "model")

    def __init__(self, workload: Workload, together: bool = False):
        """together: start the three services at once (tiny models, whose kernel timing is
        negligible); else one after the other, each timing its CPU kernels on a quiet CPU."""
        from batchspec_tools.processes import free_port

        self.procs, self.logs = [], []
        self.coordinator_pid: int | None = None  # while a coordinator runs (see coordinator)
        services = service_commands(workload)
        self.roles = [role for role, _, _ in services]  # the processes', in order
        self.ports = {role: free_port() for role in self.roles}
        self.metrics = {role: free_port() for role in self.roles}
        self.ports.setdefault("model", self.ports["target"])  # a draft the target hosts
        try:
            for role, module, extra in services:
                self._start(role, module, extra)
                if not together:
                    self._wait(role)
            for role, _, _ in services if together else ():
                self._wait(role)
        except BaseException:  # a service failed (its log kept), or the bench was stopped
            self._stop_services()
            raise

    def _start(self, role: str, module: str, extra: list[str]) -> None:
        # its log kept, so a service that dies at start says why
        log = tempfile.NamedTemporaryFile(prefix=f"batchspec-bench-{role}-", suffix=".log",
                                          delete=False)
        self.procs.append(subprocess.Popen(
            [sys.executable, "-m", module, "--port", str(self.ports[role]),
             "--metrics-port", str(self.metrics[role])] + extra,
            stdout=subprocess.DEVNULL, stderr=log))
        log.close()
        self.logs.append(log.name)

    def _wait(self, role: str) -> None:
        from batchspec_tools.processes import wait_healthy

        name = "TargetService" if role == "target" else "DraftService"
        try:
            wait_healthy(f"127.0.0.1:{self.ports[role]}", f"batchspec.v1.{name}", 600,
                         self.procs)
        except RuntimeError as error:
            log = self.logs[self.roles.index(role)]
            tail = pathlib.Path(log).read_text(errors="replace")[-1500:]
            raise RuntimeError(f"{error} (the {role} service; its log {log} "
                               f"ends:\n{tail})") from error

    @contextlib.contextmanager
    def coordinator(self, workload: Workload, batch_size: int, k: int,
                    drafts: tuple[str, ...] = ("model",), extra: tuple[str, ...] = ()):
        """A coordinator process over the running services: yields (port, metrics port).
        drafts: "model" and/or "ngram" (local:ngram); none: the target alone (plain batched
        decoding, the same server otherwise); extra: more coordinator flags."""
        from batchspec_tools.processes import free_port, wait_healthy

        port, metrics_port = free_port(), free_port()
        command = [sys.executable, "-m", "coordinator",
                   "--target", f"127.0.0.1:{self.ports['target']}", "--port", str(port),
                   # with no draft K is moot (0 for the target alone), but must be valid
                   "--batch-size", str(batch_size), "-k", str(max(k, 1)),
                   "--max-num-seqs", str(max(64, len(workload.prompts))),
                   "--draft-policy", workload.draft_policy,
                   "--metrics-port", str(metrics_port), *extra]
        if not workload.step_aside and "--step-aside" not in extra:
            command += ["--step-aside", "off"]
        if workload.min_draft_confidence is not None:
            command += ["--min-draft-confidence", str(workload.min_draft_confidence)]
        for role in drafts:
            command += ["--draft", LOCAL_NGRAM if role == "ngram"
                        else f"127.0.0.1:{self.ports[role]}"]
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_healthy(f"127.0.0.1:{port}", "batchspec.v1.Coordinator", 120, [process])
            self.coordinator_pid = process.pid
            yield port, metrics_port
        finally:
            self.coordinator_pid = None
            process.terminate()
            process.wait(timeout=30)

    def cpu_seconds(self) -> dict[str, float | None]:
        """CPU seconds each process has used so far: the services by role and the running
        coordinator (None where not readable; see processes.cpu_seconds)."""
        from batchspec_tools.processes import cpu_seconds

        pids = {role: proc.pid for role, proc in zip(self.roles, self.procs)}
        if self.coordinator_pid is not None:
            pids["coordinator"] = self.coordinator_pid
        return {role: cpu_seconds(pid) for role, pid in pids.items()}

    def run(self, workload: Workload, batch_size: int, k: int,
            drafts: tuple[str, ...] = ("model",), extra: tuple[str, ...] = ()) -> Run:
        import grpc

        from batchspec.v1 import generate_pb2, generate_pb2_grpc

        count = len(workload.prompts)
        with self.coordinator(workload, batch_size, k, drafts, extra) as (port, metrics_port):
            before = {r: scrape(self.metrics[r]) for r in self.roles}
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = generate_pb2_grpc.CoordinatorStub(channel)

                def one(prompt):
                    responses = list(stub.Generate(generate_pb2.GenerateRequest(
                        prompt_token_ids=prompt, max_new_tokens=workload.max_new_tokens),
                        timeout=3600))
                    return [t for r in responses for t in r.token_ids], responses[-1].stats

                started = time.perf_counter()
                with concurrent.futures.ThreadPoolExecutor(count) as pool:
                    results = list(pool.map(one, workload.prompts))
                seconds = time.perf_counter() - started
            coord = scrape(metrics_port)
            after = {r: scrape(self.metrics[r]) for r in self.roles}
        # a hosted draft's proposes run inside the target's verifies: counted there
        spent = {r: after[r].get(f'command_seconds_sum{{command="{c}"}}', 0)
                 - before[r].get(f'command_seconds_sum{{command="{c}"}}', 0)
                 if r in after else 0.0
                 for r, c in (("target", "verify"), ("model", "propose"))}
        # the n-gram lookups run in the coordinator: counted in its draft time, as "rpc"
        compute = {"target": spent["target"], "draft": spent["model"]}
        draft_rt, verify_rt = coord.get("draft_seconds_sum", 0), coord.get("verify_seconds_sum", 0)
        prefill_rt = coord.get("prefill_seconds_sum", 0)
        breakdown = {"prefill": prefill_rt, "draft": compute["draft"], "verify": compute["target"],
                     "realign": coord.get("realign_seconds_sum", 0),
                     "rpc": (draft_rt - compute["draft"]) + (verify_rt - compute["target"]),
                     "coordinator": seconds - draft_rt - verify_rt - prefill_rt}
        steps = coord.get("grouped_steps_total", 0) + coord.get("realigned_steps_total", 0)
        stats = [s for _, s in results]
        return Run([t for t, _ in results], seconds, sum(s.num_drafted_tokens for s in stats),
                   sum(s.num_accepted_tokens for s in stats),
                   sum(s.num_target_forward_passes for s in stats),
                   coord.get("realigned_steps_total", 0) / max(1, steps),
                   normalise(breakdown, seconds))

    def _stop_services(self):
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            proc.wait(timeout=30)

    def close(self):
        self._stop_services()
        for log in self.logs:  # kept only when a service died at start (named in the error)
            pathlib.Path(log).unlink(missing_ok=True)


def scrape(port: int) -> dict:
    """A service's metrics as {name-without-prefix{labels}: value}, model_name/role labels
    dropped and samples that then share a key added up."""
    from batchspec.metrics import scrape as read

    values = {}
    for name, labels, value in read(f"http://127.0.0.1:{port}/metrics"):
        kept = ",".join(f'{k}="{v}"' for k, v in labels.items()
                        if k not in ("model_name", "role"))
        key = name.split(":", 1)[-1] + (f"{{{kept}}}" if kept else "")
        values[key] = values.get(key, 0.0) + value
    return values


# ---- the sweep -------------------------------------------------------------------------------
def settings(config: BenchConfig) -> list[tuple[str, int, int]]:
    out = []
    for method in config.methods:
        if method in LLAMACPP or config.concurrency and method in GRPC_DRAFTS:
            continue  # served to closed-loop clients instead
        sizes = config.batch_sizes if method in USES_BATCH else (1,)
        ks = config.ks if method in USES_K else (0,)
        out += [(method, b, k) for b in sizes for k in ks]
    return out


def run(config: BenchConfig) -> dict:
    import torch
    from tqdm import tqdm

    from batchspec.runtime import calibration, models
    from batchspec.runtime import runner as runner_lib

    with tempfile.TemporaryDirectory() as scratch:
        workload = build_workload(config, pathlib.Path(scratch))
        placed = {"dtype": workload.dtype, "device": workload.device}
        target = models.load_causal_lm(workload.target, **placed)
        draft = models.load_causal_lm(workload.draft, num_layers=workload.draft_layers,
                                      **placed)
        hf = {"target": target, "draft": draft}
        if {"hf_stock_batch1", "hf_stock_batched"} & set(config.methods):
            hf["stock"] = models.load_causal_lm(workload.target, stock=True, **placed)
        make_runner = lambda m, n: runner_lib.ModelRunner(  # noqa: E731
            m, name=n, device=torch.device(workload.device),
            eos_token_ids=workload.eos_token_ids,
            max_context_len=models.max_context_len(target))
        runners = {"target": make_runner(target, workload.target),
                   "draft": make_runner(draft, workload.draft)}
        plan = [("hf_batch1", 1, 0)] + [s for s in settings(config) if s[0] != "hf_batch1"]
        warm_up(hf, runners, workload)
        if config.draft_policy == "goodput" and "engine_grouped" in config.methods:
            for name, runner in runners.items():  # what a service measures at its start-up
                runner.step_costs = calibration.measure_step_costs(runner,
                                                                  proposes=name == "draft")
        wants_grpc = (set(GRPC_DRAFTS) & set(config.methods) or config.arrival_rates
                      or config.concurrency)
        stack = GrpcStack(workload, together=config.quick) if wants_grpc else None
        parts = workload.split() if config.by_category else {None: workload}
        rows, load, serving = [], [], []
        try:
            for category, part in parts.items():
                reference, results = None, {}
                # the reference alone (not a method asked for) runs once
                rounds = [(i, s) for i in range(config.repeat) for s in plan
                          if i == 0 or s[0] in config.methods]
                for i, (method, batch_size, k) in tqdm(
                        rounds, desc=f"bench {category or ''}".strip(), unit="run"):
                    log = closed_loop.step_log(config, f"{method}-b{batch_size}-k{k}-r{i}",
                                               category)
                    result = run_one(method, batch_size, k, hf, runners, part, stack, log)
                    reference = reference or result.outputs
                    results.setdefault((method, batch_size, k), []).append(result)
                found = [summarise_runs(*setting, runs, reference)
                         for setting, runs in results.items()]
                add_ratios(found)
                rows += [dict(r, category=category) if category else r for r in found
                         if r["method"] in config.methods]
                if category is None:
                    for rate in tqdm(config.arrival_rates, desc="arrival load", unit="rate"):
                        load += arrival_load(stack, part, rate, config, reference)
                    serving = closed_loop.sweep(stack, part, config, reference, GRPC_DRAFTS,
                                               GRPC_FLAGS)
        finally:
            if stack:
                stack.close()
    served_draft = models.served_draft_dtype(workload.draft_service_dtype, workload.draft,
                                             workload.device)
    return {"config": dataclasses.asdict(config),
            "machine": {**machine(config.dtype, config.device),
                        "served_draft_dtype": served_draft},
            "num_prompts": len(workload.prompts), "target": workload.target,
            "draft": workload.draft, "rows": rows, "load": load, "serving": serving,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def arrival_load(stack, workload: Workload, rate: float, config: BenchConfig,
                 reference) -> list[dict]:
    """The same Poisson arrivals (seeded) against batchspec and against the same server
    decoding with the target alone; one row each."""
    import grpc

    from batchspec.v1 import generate_pb2_grpc
    from batchspec_tools.bench import arrivals

    offsets = arrivals.poisson_offsets(rate, len(workload.prompts), seed=int(rate * 1000))
    k = config.ks[-1]
    rows = []
    for method, drafts in (("grpc", ("model",)), ("grpc_target_only", ())):
        with stack.coordinator(workload, config.load_batch_size, k, drafts) as (port, _):
            with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
                stub = generate_pb2_grpc.CoordinatorStub(channel)
                traces, seconds = arrivals.run_load(stub, workload.prompts,
                                                    workload.max_new_tokens, offsets)
        row = {"method": method, "rate": rate, "batch_size": config.load_batch_size,
               "k": k if drafts else None, **arrivals.summarise(traces, seconds)}
        if reference:
            row["exact_match"] = arrivals.exact_share(traces, reference)
        rows.append(row)
    return rows


def warm_up(hf, runners, workload: Workload) -> None:
    """Plan the CPU linear kernels (the plans the services use too), then one short untimed
    pass through HF generate and the engine, so that the first timed method does not pay for
    lazy initialisation."""
    from batchspec.runtime import cache_dir, fastlinear

    for name, model in hf.items():  # the plans are for CPU kernels
        if name != "stock" and workload.device == "cpu":
            fastlinear.tune(model, cache_dir.kernel_plans_file())
    short = dataclasses.replace(workload, prompts=workload.prompts[:2], max_new_tokens=4)
    run_hf(hf, short, "hf_batch1", 1, 0)
    if "stock" in hf:
        run_hf(hf, short, "hf_stock_batch1", 1, 0)
    run_engine(runners, short, 2, 2)


def run_one(method, batch_size, k, hf, runners, workload, stack, log=()) -> Run:
    if method.startswith("hf_"):
        return run_hf(hf, workload, method, batch_size, k)
    if method in GRPC_DRAFTS:
        return stack.run(workload, batch_size, k, GRPC_DRAFTS[method],
                         GRPC_FLAGS.get(method, ()) + log)
    return run_engine(runners, workload, batch_size, k)


def summarise_runs(method, batch_size, k, runs: list[Run], reference) -> dict:
    """One setting's row from its repeated runs: the median run by time (the lower middle one
    of an even count), with every run's speed, and exact only if every run was."""
    rows = [summarise(method, batch_size, k, r, reference) for r in runs]
    by_time = sorted(range(len(runs)), key=lambda i: runs[i].seconds)
    row = rows[by_time[(len(runs) - 1) // 2]]
    if len(runs) > 1:
        row["tokens_per_s_runs"] = [r["tokens_per_s"] for r in rows]
        row["exact_match"] = min(r["exact_match"] for r in rows)
    return row


def summarise(method, batch_size, k, result: Run, reference) -> dict:
    tokens = sum(len(o) for o in result.outputs)
    exact = sum(o == r for o, r in zip(result.outputs, reference)) / len(reference)
    row = {"method": method, "batch_size": batch_size, "k": k or None,
           "seconds": round(result.seconds, 3), "num_tokens": tokens,
           "tokens_per_s": round(tokens / result.seconds, 2), "exact_match": round(exact, 4),
           "target_passes_per_token": round(result.num_steps / max(1, tokens), 4)}
    if result.num_drafted:
        row["acceptance_rate"] = round(result.num_accepted / result.num_drafted, 4)
        row["mean_acceptance_length"] = round(
            (result.num_accepted + result.num_steps) / max(1, result.num_steps), 3)
    elif method == "hf_assisted":
        # tokens per target decode pass (HF does not report acceptance itself)
        row["mean_acceptance_length"] = round(tokens / max(1, result.num_steps), 3)
    if result.realigned_share is not None:
        row["realigned_step_share"] = round(result.realigned_share, 4)
    if result.breakdown:
        row["time_share"] = result.breakdown
    return row


def add_ratios(rows: list[dict]) -> None:
    """Each row's speed over the target alone at batch 1 and over batched decoding at its
    batch size: with batchspec's kernels (vs_batch1, vs_batched) and, when measured, stock
    transformers (vs_stock_batch1, vs_stock_batched). The batch-1 yardstick is the faster of
    `generate` at batch 1 and batched `generate` given one row: the same work, measured twice,
    so a slow measurement of it never flatters a ratio."""
    for prefix, single, batched_method in (("", "hf_batch1", "hf_batched"),
                                           ("stock_", "hf_stock_batch1", "hf_stock_batched")):
        batch1 = max((r["tokens_per_s"] for r in rows if r["method"] == single
                      or (r["method"] == batched_method and r["batch_size"] == 1)), default=None)
        batched = {r["batch_size"]: r["tokens_per_s"] for r in rows
                   if r["method"] == batched_method}
        for row in rows:
            if batch1:
                row[f"vs_{prefix}batch1"] = round(row["tokens_per_s"] / batch1, 3)
            if row["batch_size"] in batched:
                row[f"vs_{prefix}batched"] = round(
                    row["tokens_per_s"] / batched[row["batch_size"]], 3)


def machine(dtype: str = "float32", device: str = "cpu") -> dict:
    import torch

    found = {"cpu_count": os.cpu_count(), "torch": torch.__version__,
             "threads": torch.get_num_threads(), "python": platform.python_version(),
             "platform": platform.platform(), "device": device, "dtype": dtype,
             "cpu": cpu_model()}
    if device.startswith("cuda"):
        found["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return found


def cpu_model() -> str:
    """The CPU's model name, as the kernel reports it (empty where it does not)."""
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


# ---- the report ------------------------------------------------------------------------------
def write_report(report: dict, out: pathlib.Path) -> list[pathlib.Path]:
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "results.json", out / "results.md"]
    paths[0].write_text(json.dumps(report, indent=2))
    paths[1].write_text(markdown(report))
    if report["rows"]:  # a closed-loop-only run has no batch sweep to plot
        paths.append(out / "throughput.png")
        plot(report, paths[2])
    return paths


def write_head_check(config: BenchConfig) -> list[pathlib.Path]:
    """Run `--head-check` and write its report (head_check.json) under config.out."""
    import json

    from batchspec.runtime import models
    from batchspec_tools.bench import head_check

    report = head_check.run(
        config.target, config.draft or models.SMOLLM2_EAGLE, prompts=config.prompts,
        num_prompts=config.num_prompts, max_new_tokens=config.max_new_tokens, k=config.ks[0],
        head_dtype=config.draft_dtype or "float32",
        min_confidence=config.min_draft_confidence or 0.0, temperature=config.temperature,
        top_p=config.top_p)
    out = pathlib.Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "head_check.json"
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    return [path]


def write_overhead(config: BenchConfig) -> list[pathlib.Path]:
    """Run `--overhead` and write its report (results.json, results.md) under config.out."""
    from batchspec.runtime import tiny
    from batchspec_tools.bench import overhead

    def start(model: str, prompts: list[list[int]]):
        workload = Workload(model, model, None, prompts, config.max_new_tokens, [tiny.EOS],
                            min_draft_confidence=0.0, draft_policy="fixed", dtype="float32",
                            device=config.device, draft_host=config.draft_host)
        return GrpcStack(workload, together=True), workload

    report = overhead.run(start, config.max_new_tokens, rounds=config.repeat)
    report.update(machine=machine(), date=datetime.datetime.now(
        datetime.timezone.utc).isoformat(timespec="seconds"))
    out = pathlib.Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    paths = [out / "results.json", out / "results.md"]
    paths[0].write_text(json.dumps(report, indent=2))
    paths[1].write_text(overhead.markdown(report))
    return paths


def served_draft_note(found: dict) -> str:
    """' (served draft bfloat16)' where the served model draft's dtype is not the models'."""
    served = found.get("served_draft_dtype")
    return f" (served draft {served})" if served not in (None, found["dtype"]) else ""


def sampled_note(config: dict) -> str:
    """How the closed-loop requests sampled, where they did."""
    if not config.get("temperature"):
        return ""
    return (f"; closed-loop requests sampled at temperature {config['temperature']:g}, top_p "
            f"{config['top_p']:g}, request i seeded i (exact: equal to the plain server's "
            "answers)")


def markdown(report: dict) -> str:
    cut = report["config"]["min_draft_confidence"]
    cut = "at break-even" if cut is None else cut
    lines = [f"# batchspec bench ({report['date']})", "",
             f"target `{report['target']}`, draft `{report['draft']}`, "
             f"{report['num_prompts']} prompts, max_new_tokens "
             f"{report['config']['max_new_tokens']}, {report['machine']['device']} "
             f"{report['machine']['dtype']}"
             + served_draft_note(report["machine"])
             + f", {report['machine']['threads']} threads, "
             f"draft policy {report['config'].get('draft_policy', 'fixed')}, "
             f"min_draft_confidence {cut} "
             "(K is the most drafted per step)"
             + (f"; each row the median of {report['config']['repeat']} runs taken in turn"
                if report["config"].get("repeat", 1) > 1 else "")
             + sampled_note(report["config"]), "",
             "| category | method | batch | K | tok/s | vs stock batched | vs stock batch 1 "
             "| vs batched | vs batch 1 | accept rate | accept len "
             "| target passes/tok | realigned steps "
             "| prefill / draft / verify / realign / rpc / coord "
             "| exact |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: "
             "| ---: | --- | ---: |"]
    fmt = lambda v, f="{:.2f}": "" if v is None else f.format(v)  # noqa: E731
    for r in report["rows"]:
        share = r.get("time_share")
        shares = " / ".join(f"{share[key]:.0%}" for key in
                            BREAKDOWN) if share else ""
        lines.append(
            f"| {r.get('category', 'all')} | {r['method']} | {r['batch_size']} | "
            f"{fmt(r['k'], '{}')} | "
            f"{r['tokens_per_s']:.1f} | {fmt(r.get('vs_stock_batched'))} | "
            f"{fmt(r.get('vs_stock_batch1'))} | {fmt(r.get('vs_batched'))} | "
            f"{fmt(r.get('vs_batch1'))} | "
            f"{fmt(r.get('acceptance_rate'))} | {fmt(r.get('mean_acceptance_length'))} | "
            f"{r['target_passes_per_token']:.2f} | "
            f"{fmt(r.get('realigned_step_share'), '{:.0%}')} | "
            f"{shares} | {r['exact_match']:.0%} |")
    lines += ["", "Methods: " + "; ".join(f"`{k}` = {v}" for k, v in METHODS.items()), "",
              "\"vs batch 1\" is against the faster of `generate` at batch 1 and batched "
              "`generate` at batch 1 (the same work, measured twice); \"vs batched\" against "
              "batched `generate` at the row's batch size (\"stock\": unpatched transformers).",
              ""]
    lines += closed_loop.markdown(report.get("serving", []))
    if report.get("load"):
        lines += ["## Arrival-driven load (Poisson arrivals, over gRPC)", "",
                  "`grpc_target_only` is the same server with no draft: plain batched decoding "
                  "under the same arrivals.", "",
                  "| method | rate (req/s) | batch | K | tok/s | TTFT p50 / p99 (ms) "
                  "| ITL p50 / p99 (ms) | exact |",
                  "| --- | ---: | ---: | ---: | ---: | --- | --- | ---: |"]
        for r in report["load"]:
            lines.append(f"| {r['method']} | {r['rate']:g} | {r['batch_size']} | "
                         f"{r['k'] or ''} | {r['tokens_per_s']:.1f} | "
                         f"{r['ttft_p50_ms']} / {r['ttft_p99_ms']} | "
                         f"{r['itl_p50_ms']} / {r['itl_p99_ms']} | "
                         f"{r.get('exact_match', 0):.0%} |")
        lines.append("")
    return "\n".join(lines)


def plot(report: dict, path: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    categories = list(dict.fromkeys(r.get("category") for r in report["rows"]))
    fig, axes = plt.subplots(1, len(categories), figsize=(8 * len(categories), 5),
                             squeeze=False)
    for ax, category in zip(axes[0], categories):
        rows = [r for r in report["rows"] if r.get("category") == category]
        for method in dict.fromkeys(r["method"] for r in rows):
            best = {}
            for r in rows:
                if r["method"] == method:
                    best[r["batch_size"]] = max(best.get(r["batch_size"], 0), r["tokens_per_s"])
            sizes = sorted(best)
            if method not in USES_BATCH:  # batch-1 methods: a flat reference line
                ax.axhline(best[1], linestyle="--", linewidth=1, label=METHODS[method],
                           color="grey" if method == "hf_batch1" else "tab:brown")
            else:
                ax.plot(sizes, [best[b] for b in sizes], marker="o", label=METHODS[method])
        ax.set_xscale("log", base=2)
        ax.set_xlabel("batch size")
        ax.set_ylabel("generated tokens / s (best K)")
        ax.set_title(f"{report['target']} on {report['machine']['device']}, "
                     f"{category or 'all'} ({report['num_prompts']} prompts in all)")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
