"""The coordinator's configuration: frozen dataclasses, and every command-line flag that sets
them, declared once here with its default taken from the dataclass. `batchspec coordinator`
adds all of them; `batchspec serve` adds the ones it passes on and forwards them to the
coordinator it starts (`forward`), so a flag, its help and its default exist in one place."""
import argparse
import dataclasses
import pathlib

from batchspec import cliargs, security
from coordinator import membership
from coordinator.scheduler import CohortPolicy

DEFAULT_PORT = 50051


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    # K, the most tokens a step drafts. With the goodput policy each row, greedy or sampled,
    # drafts what pays (0 to K); a seeded request's tokens never depend on what was drafted.
    num_draft_tokens: int = 4
    # "goodput": per row and step, the K with the most expected tokens per second (0: plain
    # decoding), from the services' measured costs and each row's acceptance;
    # "fixed": every row drafts num_draft_tokens.
    draft_policy: str = "goodput"
    # With the goodput policy: cohorts decode plainly where drafted steps have measured slower
    # than plain ones for cohorts of their size and class, greedy or with a sampled row
    # (coordinator/evidence.py).
    step_aside: bool = True
    # Each row's model draft is cut before its first token at which the draft's
    # probability of its whole draft so far falls below this; a row may verify none (0: off).
    # None: drafts whose probabilities track acceptance (ModelInfo.calibrated) are cut where
    # a token stops paying for itself at the step's shape (goodput.break_even_confidence).
    min_draft_confidence: float | None = None
    # Draft for the next cohort while the target verifies this one, so both services work at
    # once: "on", "off", or "auto": on unless both services run on CPU (then they share the
    # host's cores, and running both at once slows each down).
    overlap: str = "auto"
    cohort_policy: CohortPolicy = CohortPolicy()
    max_num_seqs: int = 64  # sequences stepped concurrently (the pool)
    max_queue: int = 1024  # requests waiting for a pool slot; beyond it RESOURCE_EXHAUSTED
    reconnect_backoff_s: tuple[float, float] = (0.2, 5.0)  # first and longest retry delay
    # Prompt tokens per prefill command (a longer prompt goes alone): bounds how long one
    # command runs, so a slow prefill is not taken for a hung service, and lets decoding steps
    # interleave with a large admission.
    max_prefill_tokens: int = 16384
    # A longer prompt is fed to the target this many tokens a step, each chunk between the
    # other sequences' steps: a running stream waits at most about one chunk's prefill for its
    # next token, however long the prompts that arrive (0: a prompt in one command).
    prefill_chunk_tokens: int = 256
    # A cohort whose step calls no draft and verifies none (no draft up, none planned, or the
    # evidence stepped it aside), with no row under a grammar and no request waiting, decodes up
    # to this many tokens a row in one verify command (VerifyCommand.plain_steps), never more
    # than a row has left nor, aside, than the evidence lets before its next probe: a command's
    # fixed cost is paid once for them (1: one).
    plain_steps: int = 4
    # A cohort whose drafts the target's hosted draft proposes or a lookup's line gives (no
    # row drafting with another kind or under a grammar, no request waiting) runs up to this
    # many rounds of drafting and verifying in one verify command (VerifyCommand.rounds), never
    # more than every row's tokens left allow at K + 1 a round (1: one a command).
    draft_rounds: int = 4

    def __post_init__(self):
        if not 1 <= self.num_draft_tokens <= 32:
            raise ValueError("num_draft_tokens must be in [1, 32]")
        if self.overlap not in ("auto", "on", "off"):
            raise ValueError("overlap must be 'auto', 'on' or 'off'")
        if self.draft_policy not in ("goodput", "fixed"):
            raise ValueError("draft_policy must be 'goodput' or 'fixed'")
        if self.min_draft_confidence is not None and not 0.0 <= self.min_draft_confidence <= 1.0:
            raise ValueError("min_draft_confidence must be in [0, 1]")
        if self.max_num_seqs < 1 or self.max_queue < 0:
            raise ValueError("max_num_seqs must be >= 1 and max_queue >= 0")
        if self.max_prefill_tokens < 1:
            raise ValueError("max_prefill_tokens must be >= 1")
        if self.prefill_chunk_tokens < 0:
            raise ValueError("prefill_chunk_tokens must be >= 0")
        if not 1 <= self.plain_steps <= 64:
            raise ValueError("plain_steps must be in [1, 64]")
        if not 1 <= self.draft_rounds <= 64:
            raise ValueError("draft_rounds must be in [1, 64]")


@dataclasses.dataclass(frozen=True)
class CoordinatorConfig:
    targets: tuple[str, ...]
    drafts: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    tokenizer: str | None = None
    engine: EngineConfig = EngineConfig()
    max_new_tokens: int = 4096
    connect_timeout_s: float = 60.0
    # a service that leaves a command unanswered this long (whatever the request deadlines)
    # is taken for hung and dropped like a lost one
    stall_timeout_s: float = 120.0
    grace_s: float = 10.0
    metrics_port: int | None = None  # Prometheus /metrics; None: off, 0: a free port
    tls: security.ServerTls | None = None  # TLS on the public API
    peer_tls: security.ClientTls | None = None  # (mutual) TLS to the model services
    api_key_file: str | None = None  # clients must send `authorization: Bearer <key>`
    # the OpenAI-compatible HTTP edge and its chat page; None: off, 0: a free port
    http_port: int | None = None
    step_log: str | None = None  # a file that gets one JSON line per step; None: off
    # seconds between two reads of the dns:, file: and k8s: replica sources
    membership_interval_s: float = 2.0

    def __post_init__(self):
        if not self.targets:
            raise ValueError("at least one --target is needed")
        for spec in self.targets + self.drafts:
            membership.parse_source(spec)  # ValueError on a malformed one
        for spec in self.targets:
            if isinstance(membership.parse_source(spec), membership.Local):
                raise ValueError(f"--target {spec}: the coordinator runs only an n-gram draft "
                                 "in its own process; a target is a service")
        if self.membership_interval_s <= 0:
            raise ValueError("membership_interval_s must be > 0")
        cliargs.check_ports(("port", self.port), ("http_port", self.http_port),
                            ("metrics_port", self.metrics_port))
        if self.max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        if self.stall_timeout_s <= 0 or self.connect_timeout_s <= 0:
            raise ValueError("stall_timeout_s and connect_timeout_s must be > 0")
        if self.grace_s < 0:
            raise ValueError("grace_s must be >= 0")
        if self.api_key_file is not None:
            security.read_api_key(self.api_key_file)
        if self.step_log is not None and not pathlib.Path(self.step_log).parent.is_dir():
            raise ValueError(f"step_log {self.step_log}: no such directory to write it in")

    def peer_credentials(self):
        return self.peer_tls.credentials() if self.peer_tls else None


@dataclasses.dataclass(frozen=True)
class Flag:
    """One command-line flag: its names, help, default and parsing (argparse's keywords)."""

    names: tuple[str, ...]
    help: str
    default: object = None
    type: object = None
    choices: tuple | None = None

    @property
    def dest(self) -> str:
        return self.names[0].lstrip("-").replace("-", "_")

    def add_to(self, parser) -> None:
        keywords = {"default": self.default, "help": self.help, "dest": self.dest}
        if self.type is not None:
            keywords["type"] = self.type
        if self.choices is not None:
            keywords["choices"] = self.choices
        parser.add_argument(*self.names, **keywords)


# What a client sees of the coordinator: where it listens, the API key, and its metrics.
PUBLIC_FLAGS = (
    Flag(("--port",), "gRPC port of the public API (0: a free one)", DEFAULT_PORT, int),
    Flag(("--http-port",), "also serve the OpenAI-compatible HTTP API (/v1/chat/completions, "
         "/v1/completions, /v1/models) and a chat page (/) on this port (0: a free one; HTTPS "
         "with --tls-cert, the same API key)", CoordinatorConfig.http_port, int),
    Flag(("--api-key-file",), "file holding the API key clients must send as 'authorization: "
         "Bearer <key>' (health stays open)", CoordinatorConfig.api_key_file),
    Flag(("--metrics-port",), "serve Prometheus metrics on this port, at /metrics (0: a free "
         "one)", CoordinatorConfig.metrics_port, int),
)

# How the coordinator decodes and what it admits.
ENGINE_FLAGS = (
    Flag(("--batch-size",), "most sequences per step (one cohort)", CohortPolicy.batch_size, int),
    Flag(("--num-draft-tokens", "-k"), "most tokens a step drafts per sequence (K)",
         EngineConfig.num_draft_tokens, int),
    Flag(("--draft-policy",), "goodput: per sequence and step the K (0 to -k) with the most "
         "expected tokens per second, from measured costs and acceptance; fixed: always -k",
         EngineConfig.draft_policy, str, ("goodput", "fixed")),
    Flag(("--overlap",), "draft for the next cohort while the target verifies this one; auto: "
         "unless both services run on CPU", EngineConfig.overlap, str, ("auto", "on", "off")),
    Flag(("--step-aside",), "with the goodput policy, cohorts decode plainly wherever drafted "
         "steps have measured slower than plain ones for cohorts of their size and class "
         "(greedy, or with a sampled row) (on), or "
         "the policy's predictions alone decide (off)", "on" if EngineConfig.step_aside else "off",
         str, ("on", "off")),
    Flag(("--min-draft-confidence",), "cut each row's model draft where the draft's "
         "probability of it falls below this (0: off; default: a calibrated draft is cut where "
         "a token stops paying for itself, others never)", EngineConfig.min_draft_confidence,
         float),
    Flag(("--max-num-seqs",), "sequences in the pool", EngineConfig.max_num_seqs, int),
    Flag(("--max-queue",), "requests that may wait for the pool before RESOURCE_EXHAUSTED",
         EngineConfig.max_queue, int),
    Flag(("--max-prefill-tokens",), "prompt tokens per prefill command (a longer prompt goes "
         "alone)", EngineConfig.max_prefill_tokens, int),
    Flag(("--prefill-chunk-tokens",), "while other sequences decode, feed a longer prompt to "
         "the target this many tokens a step, between their steps, and admit no more than "
         "this many prompt tokens a step (0: whole prompts)",
         EngineConfig.prefill_chunk_tokens, int),
    Flag(("--plain-steps",), "tokens a row a cohort that drafts nothing (no draft up, none "
         "planned, or stepped aside) decodes in one command while no request waits (1: one a "
         "command)",
         EngineConfig.plain_steps, int),
    Flag(("--draft-rounds",), "rounds of drafting and verifying a cohort drafted by the "
         "target's hosted draft or the n-gram lookup runs in one command while no request "
         "waits (1: one a command)",
         EngineConfig.draft_rounds, int),
    Flag(("--max-new-tokens",), "largest max_new_tokens a request may ask for",
         CoordinatorConfig.max_new_tokens, int),
    Flag(("--stall-timeout",), "seconds a service may leave a command unanswered before it is "
         "taken for hung and dropped", CoordinatorConfig.stall_timeout_s, float),
    Flag(("--grace",), "seconds to finish in-flight requests on SIGTERM",
         CoordinatorConfig.grace_s, float),
    Flag(("--step-log",), "append one JSON line per step to this file: each row's draft kind, "
         "drafts, accepted and committed tokens, and where the step's time went (prefills, "
         "draft, verify, realignment)", CoordinatorConfig.step_log),
)

# Only `batchspec coordinator` takes these (`serve` wires its own services on loopback).
CONNECTION_FLAGS = (
    Flag(("--host",), "address to bind", CoordinatorConfig.host),
    Flag(("--tokenizer",), "tokenizer.json or a directory holding it (enables text prompts)",
         CoordinatorConfig.tokenizer),
    Flag(("--connect-timeout",), "seconds to wait for the services at start-up",
         CoordinatorConfig.connect_timeout_s, float),
    Flag(("--membership-interval",), "seconds between two reads of the dns:, file: and k8s: "
         "replica sources", CoordinatorConfig.membership_interval_s, float),
)


def add_flags(parser, flags) -> None:
    for flag in flags:
        flag.add_to(parser)


def forward(args: argparse.Namespace, flags) -> list[str]:
    """The command line that gives a coordinator the values `args` holds for `flags`
    (those left unset, None, are left out)."""
    argv = []
    for flag in flags:
        value = getattr(args, flag.dest)
        if value is not None:
            argv += [flag.names[0], str(value)]
    return argv


def engine_config_from_args(args) -> EngineConfig:
    return EngineConfig(num_draft_tokens=args.num_draft_tokens,
                        draft_policy=args.draft_policy, overlap=args.overlap,
                        step_aside=args.step_aside == "on",
                        min_draft_confidence=args.min_draft_confidence,
                        cohort_policy=CohortPolicy(batch_size=args.batch_size),
                        max_num_seqs=args.max_num_seqs, max_queue=args.max_queue,
                        max_prefill_tokens=args.max_prefill_tokens,
                        prefill_chunk_tokens=args.prefill_chunk_tokens,
                        plain_steps=args.plain_steps, draft_rounds=args.draft_rounds)


def peer_tls_from_args(args) -> security.ClientTls | None:
    """The model services' CA and the certificate shown to them: --client-cert/--client-key,
    else the public --tls-cert/--tls-key."""
    if args.client_cert is None and args.client_key is None and args.tls_ca is not None:
        return security.client_tls(args.tls_ca, args.tls_cert, args.tls_key)
    return security.client_tls(args.tls_ca, args.client_cert, args.client_key)


def config_from_args(args) -> CoordinatorConfig:
    return CoordinatorConfig(targets=split_addresses(args.target),
                             drafts=split_addresses(args.draft), host=args.host,
                             port=args.port, tokenizer=args.tokenizer,
                             engine=engine_config_from_args(args),
                             max_new_tokens=args.max_new_tokens,
                             connect_timeout_s=args.connect_timeout,
                             stall_timeout_s=args.stall_timeout, grace_s=args.grace,
                             metrics_port=args.metrics_port, http_port=args.http_port,
                             tls=security.server_tls(args.tls_cert, args.tls_key),
                             peer_tls=peer_tls_from_args(args), api_key_file=args.api_key_file,
                             step_log=args.step_log,
                             membership_interval_s=args.membership_interval)


def split_addresses(values: list[str]) -> tuple[str, ...]:
    """Repeated --target/--draft values, each possibly comma-separated: replica sources."""
    return tuple(a.strip() for v in values for a in v.split(",") if a.strip())
