"""The model-runner shared by the draft and the target service.

It hosts one causal LM and a KV cache per sequence, runs batched forwards over groups of
sequences, and rolls caches back. Invariants:

- `caches[seq_id].length` is the number of positions cached for the sequence; the coordinator
  names it in every command and a mismatch is refused (FailedPrecondition), never recomputed.
- A command either applies to every sequence it names or to none: everything is validated
  before any cache changes. A group forward never writes into stored caches (appending to a
  cache makes new tensors), so a failed command leaves every sequence as it was until `store`.
- Position ids are always explicit (real-token counts), so left padding never shifts them.
"""
import collections
import contextlib
import dataclasses
import functools
import time

import numpy as np
import torch

from batchspec import errors, packing
from batchspec.cachebook import CacheBook
from batchspec.runtime import (
    draft_loop,
    fastlinear,
    forward,
    kvcache,
    logprobs,
    sampling,
)


@dataclasses.dataclass
class SeqCache:
    """The cached positions of one sequence: one row of the batch it was last run in.

    Invariant: span_length(spans) == length, and the sequence is row `row`, columns
    [0, columns), of `home` (columns past the last span belonged to rejected drafts: they are
    not part of it). None of it is copied, and its own views are cut only when asked for.
    """

    home: list[kvcache.LayerKV] | None  # per layer [batch, kv_heads, >= columns, head_dim]
    length: int  # real positions
    spans: kvcache.Spans | None = None  # the columns holding them; None: columns [0, length)
    row: int = 0

    def __post_init__(self):
        if self.spans is None:
            self.spans = ((0, self.length),) if self.length else ()

    @property
    def columns(self) -> int:
        return self.spans[-1][1] if self.spans else 0

    @property
    def layers(self) -> list[kvcache.LayerKV] | None:
        """Per layer [1, kv_heads, columns, head_dim] views of its row (None when empty). Made
        on demand: a group that runs again as the batch it last ran as never needs them."""
        if self.home is None or not self.length:
            return None
        return kvcache.take_row(self.home, self.row, self.columns)


@dataclasses.dataclass(frozen=True)
class RowSpec:
    """One row of a group forward: roll back to keep_len, then feed append_token_ids."""

    seq_id: int
    expected_cache_len: int
    keep_len: int
    append_token_ids: list[int]


class ModelRunner(CacheBook):
    def __init__(self, model: torch.nn.Module, *, name: str, device: torch.device,
                 eos_token_ids: list[int], max_context_len: int, lean: bool = True):
        super().__init__(name=name, vocab_size=int(model.config.vocab_size),
                         eos_token_ids=eos_token_ids, max_context_len=max_context_len,
                         device=device)
        self.model = model.eval()
        self.caches: dict[int, SeqCache] = {}
        # Linear layers compute only the positions a step marks valid (fastlinear): a verify
        # pays for each row's real tokens, not for padding to its widest row.
        self.packs_positions = device.type == "cpu" and fastlinear.patched(model)
        # A feature-level draft head: every forward is fed the target's features of the
        # position before each token ([batch, T, feature_width]); 0 for other models.
        self.reads_features = int(getattr(model, "feature_width", 0))
        # The width of the features this model returns when asked (its hidden size).
        self.hidden_size = int(getattr(model.config, "hidden_size", 0) or 0)
        # the keyword its forward takes the KV cache by (it moves between releases)
        self.cache_keyword = kvcache.cache_keyword(model)
        # A feature head scores its own vocabulary only: group forwards return logits over
        # those tokens ([..., len(logit_token_ids)], in that order); None: the whole vocabulary.
        self.logit_token_ids = model.lm_head.token_ids if self.reads_features else None
        # the model's lean forward (None: transformers' own)
        self.lean_forward = forward.lean_forward(model) if lean else None

    @functools.cached_property
    def draft_loop(self) -> "draft_loop.DraftLoop | None":
        """The model's greedy draft steps in one C++ call (draft_loop), or None; built when a
        proposal first asks."""
        if self.lean_forward is None or self.device.type != "cpu":
            return None
        return draft_loop.DraftLoop.of(self.model, self.lean_forward, self.max_context_len)

    def prefill(self, entries: list[tuple[int, list[int]]],
                features: dict[int, torch.Tensor] | None = None) -> list[int]:
        """Cache the given tokens of new sequences, batched in right-padded chunks. A model
        that reads features is given each sequence's ([tokens, feature_width])."""
        return self.prefill_features(entries, features)[0]

    def prefill_features(self, entries: list[tuple[int, list[int]]],
                         features: dict[int, torch.Tensor] | None = None, *,
                         keep: bool = False):
        """prefill; with keep, also return {seq_id: [tokens, hidden_size]} the features of
        every position cached (the final hidden state, float32)."""
        self.check_prefill(entries)
        self.check_features(entries, features)
        computed = {seq_id: SeqCache(None, 0) for seq_id, token_ids in entries if not token_ids}
        kept = {seq_id: torch.zeros(0, self.hidden_size) for seq_id, t in entries if not t}
        for chunk in prefill_chunks([e for e in entries if e[1]], PREFILL_CHUNK_TOKENS):
            rows, hidden = self._prefill_batch(chunk, features, keep)
            computed.update(rows)
            kept.update(hidden)
        self.caches.update(computed)
        return [self.caches[s].length for s, _ in entries], kept

    def check_features(self, entries, features: dict[int, torch.Tensor] | None) -> None:
        """A model that reads features needs a row per token, of its width; others none."""
        if not self.reads_features:
            if features:
                raise errors.InvalidArgument(f"{self.name} reads no features; send none")
            return
        features = features or {}
        for seq_id, token_ids in entries:
            given = features.get(seq_id)
            if given is None or tuple(given.shape) != (len(token_ids), self.reads_features):
                shape = None if given is None else tuple(given.shape)
                raise errors.InvalidArgument(
                    f"sequence {seq_id}: {self.name} reads the target's features: send "
                    f"{len(token_ids)} rows of {self.reads_features}, not {shape}")

    def features(self, prefixes: list[list[int]]) -> list[torch.Tensor]:
        """The features [len(prefix), hidden_size] of every position of each prefix,
        computed without touching any cache."""
        out = []
        for token_ids in prefixes:
            self.check_token_ids(token_ids, "features prefix")
            self.check_context(0, len(token_ids))
            if not token_ids:
                out.append(torch.zeros(0, self.hidden_size))
                continue
            group = GroupForward(self, [SeqCache(None, 0)])
            group.step(torch.tensor([token_ids], device=self.device), num_logits=1,
                       keep_hidden=True)
            out.append(group.hidden[0].float().cpu())
        return out

    def prefill_copies(self, entries: list[tuple[int, list[int]]],
                       copies: dict[int, int]) -> list[int]:
        """prefill, where the sequences in `copies` (seq_id: source) take their positions
        from their source's cache: views of the same tensors, no copy and no forward (a
        cache's tensors are never written in place: forwards append into new ones)."""
        self.check_prefill(entries)
        lengths = {s: len(t) for s, t in entries}
        for seq_id, source in copies.items():
            if seq_id not in lengths or source in copies or source == seq_id:
                raise errors.InvalidArgument(
                    f"sequence {seq_id}: copy_from {source} must name a sequence computed by "
                    "this command or cached already, for an entry of this command")
            known = lengths.get(source, self.caches[source].length
                                if source in self.caches else None)
            if known is None:
                raise errors.NotFound(f"sequence {seq_id}: copy_from {source} is not cached here")
            if known < lengths[seq_id]:
                raise errors.FailedPrecondition(
                    f"sequence {seq_id}: copy_from {source} holds {known} positions, fewer than "
                    f"the {lengths[seq_id]} to copy")
        self.prefill([(s, t) for s, t in entries if s not in copies])
        for seq_id, source in copies.items():
            self.caches[seq_id] = truncate(self.caches[source], lengths[seq_id])
        return [self.caches[s].length for s, _ in entries]

    def prefill_scored(self, entries: list[tuple[int, list[int]]],
                       scoring: dict[int, tuple[int, int]]):
        """prefill, and score the prompts of the sequences in `scoring` (seq_id: (num_top,
        next_token_id)): each token after the first, then next_token_id, by the position
        before it. Returns (cache lengths, {seq_id: [TokenLogprobs]}). A scored prompt runs
        alone: its logits ([tokens, vocab]) are kept for every position."""
        self.check_prefill(entries)
        for seq_id, (num_top, next_token_id) in scoring.items():
            logprobs.check_num_top(num_top)
            self.check_token_ids([next_token_id], f"next token of sequence {seq_id}")
        alone = [(s, t) for s, t in entries if s in scoring and t]
        self.prefill([(s, t) for s, t in entries if not (s in scoring and t)])
        scored = {s: [] for s in scoring}
        for seq_id, token_ids in alone:
            num_top, next_token_id = scoring[seq_id]
            group = GroupForward(self, [SeqCache(None, 0)])
            logits = group.step(torch.tensor([token_ids], device=self.device),
                                num_logits=len(token_ids))[0]
            scored[seq_id] = logprobs.score(logits, token_ids[1:] + [next_token_id], num_top)
            self.caches[seq_id] = group.rows_after([len(token_ids)])[0]
        return [self.caches[s].length for s, _ in entries], scored

    def _prefill_batch(self, chunk: list[tuple[int, list[int]]], features=None,
                       keep: bool = False):
        """One forward over right-padded prompts. Causal attention means a real position never
        sees the pads after it, and each row keeps only its real positions; where the runner
        packs positions the linear layers skip the pads (a prompt costs its own tokens, not
        the longest one's). Returns (rows, {seq_id: its positions' features} when `keep`)."""
        width = max(len(t) for _, t in chunk)
        padded = [t + [0] * (width - len(t)) for _, t in chunk]
        valid = torch.arange(width)[None, :] < torch.tensor([len(t) for _, t in chunk])[:, None]
        fed = None
        if self.reads_features:
            fed = torch.zeros(len(chunk), width, self.reads_features)
            for i, (seq_id, token_ids) in enumerate(chunk):
                fed[i, :len(token_ids)] = features[seq_id]
        group = GroupForward(self, [SeqCache(None, 0)] * len(chunk))
        group.step(torch.tensor(padded, device=self.device), num_logits=1, valid=valid,
                   features=fed, keep_hidden=keep)
        rows = group.rows_after([len(t) for _, t in chunk])
        hidden = {seq_id: group.hidden[i, :len(t)].float().cpu()
                  for i, (seq_id, t) in enumerate(chunk)} if keep else {}
        return {seq_id: row for (seq_id, _), row in zip(chunk, rows)}, hidden

    def trim(self, entries: list[tuple[int, int, int]]) -> list[int]:
        """Roll caches back: (seq_id, expected_len, keep_len) each. Bookkeeping only."""
        self.check_trim(entries)
        for seq_id, _, keep in entries:
            self.caches[seq_id] = truncate(self.caches[seq_id], keep)
        return [keep for _, _, keep in entries]

    # ---- group forwards ----------------------------------------------------------------------
    def open_group(self, rows: list[RowSpec], *, realign: bool,
                   extra_positions: int = 0) -> "GroupForward":
        """Validate a group and stack its caches (rolled back to keep_len) into one batch.

        Every row must append the same number of tokens. Rows of different keep_len are
        refused unless `realign`, which left-pads them. `extra_positions` is how many more
        positions the caller will add (to check the context limit up front).
        """
        if not rows:
            raise errors.InvalidArgument("empty group")
        self.check_unique([r.seq_id for r in rows])
        caches = []
        for r in rows:
            caches.append(self.check_row(r.seq_id, r.expected_cache_len, r.keep_len,
                                         r.append_token_ids, extra_positions))
        if len({len(r.append_token_ids) for r in rows}) != 1:
            raise errors.InvalidArgument("every row of a group must append the same number of "
                                         "tokens")
        if not realign and len({r.keep_len for r in rows}) != 1:
            raise errors.FailedPrecondition(
                "rows have different cache lengths "
                f"{sorted({r.keep_len for r in rows})}; send realign=true to left-pad them")
        return GroupForward(self, [truncate(c, r.keep_len) for c, r in zip(caches, rows)],
                            reserve=len(rows[0].append_token_ids) + extra_positions)

    def held_columns(self, layers: list[kvcache.LayerKV]) -> int:
        """The most columns of the batch `layers` views that a stored sequence holds."""
        buffers = getattr(layers, "buffers", None)
        if not buffers:
            return 0
        return max((c.columns for c in self.stored_in(buffers)), default=0)

    def stored_in(self, buffers: list[kvcache.Buffer]):
        """The stored sequences' caches that are rows of the batch of `buffers`."""
        return (c for c in self.caches.values()
                if getattr(c.home, "buffers", (None,))[0] is buffers[0])

    def store(self, seq_ids: list[int], rows: list[SeqCache]) -> None:
        self.caches.update(zip(seq_ids, rows))


# Padded positions per prefill forward: bounds the activation memory of a batched prefill.
PREFILL_CHUNK_TOKENS = 4096


def prefill_chunks(entries: list[tuple[int, list[int]]], max_tokens: int):
    """Split prompts, sorted by length (least padding), into chunks whose padded size
    (rows x longest prompt) stays within max_tokens; a longer prompt goes alone."""
    chunk, width = [], 0
    for entry in sorted(entries, key=lambda e: len(e[1])):
        new_width = max(width, len(entry[1]))
        if chunk and new_width * (len(chunk) + 1) > max_tokens:
            yield chunk
            chunk, new_width = [], len(entry[1])
        chunk.append(entry)
        width = new_width
    if chunk:
        yield chunk


def truncate(cache: SeqCache, keep: int) -> SeqCache:
    """The cache's first `keep` real positions (views, no copy)."""
    if keep == cache.length:
        return cache
    if keep == 0:
        return SeqCache(None, 0)
    return SeqCache(cache.home, keep, kvcache.keep_first(cache.spans, keep), cache.row)


# A group's batch keeps the holes its rejected drafts leave (masked, not copied) until its
# widest row has this many columns more than its longest sequence has positions; then the
# next group forward compacts it (a realignment copy). Every forward attends over the holes:
# a budget of half the longest row made plain steps of 32 rows over ~200 positions 3% slower
# than the server without drafts, where a copy of the batch costs about one step's attention.
def hole_budget(max_length: int) -> int:
    return max(8, max_length // 16)


class GroupForward:
    """Batched forwards over a group of sequences.

    When the group is exactly the rows, in order, of the batch its sequences last ran in, that
    batch is used as it is: rows may differ in padding and holes, which the attention mask
    hides. When its membership changed (rows left, newcomers joined), the batch is kept and
    only the newcomers are copied into it (`seat_in_place`). Otherwise, or when holes grow
    past `hole_budget`, each row's real positions are copied into a new left-padded batch (a
    realignment; zeros in the pad columns).
    Position ids are each row's count of real positions, so padding never shifts them.
    """

    def __init__(self, runner: ModelRunner, caches: list[SeqCache], reserve: int = 0):
        self.runner = runner
        started = time.perf_counter()
        lengths = [c.length for c in caches]
        longest = max(lengths)
        # aligned: every row holds the same positions in columns [0, longest), nothing to hide
        aligned = all(n == longest and kvcache.is_plain(c.spans)
                      for n, c in zip(lengths, caches))
        # the batch row of each of the group's rows (None: row i is batch row i); the batch's
        # other rows are vacant (no row of the group), fed a token that nothing keeps
        self.slots: list[int] | None = None
        self.copied = False
        # a batch whose membership changed keeps its rows where they are: newcomers are
        # copied into rows no sequence holds, rows that left stay vacant a while
        resident = resident_batch(caches)
        seated = seat_in_place(runner, caches, reserve) if resident is None else None
        if seated is not None:
            layers, self.width, self.slots, self.lengths, self.spans = seated
        else:
            self.lengths, self.spans = lengths, [c.spans for c in caches]
            layers = self._resident(caches, resident, longest, reserve)
        self.cache = kvcache.to_model_cache(layers or None)
        self.realigned = not aligned or self.slots is not None
        self.mask = None
        if self.width and any(s != ((0, self.width),) for s in self.spans):  # pads or holes
            self.mask = kvcache.column_mask(self.spans, self.width).to(runner.device)
        self.stack_seconds = time.perf_counter() - started
        self.forward_seconds = 0.0
        # [batch, T, hidden] the last step's final hidden states (a feature head's predicted
        # features), when the step kept them; rows in the group's order
        self.hidden = None

    def _resident(self, caches: list[SeqCache], layers, longest: int, reserve: int):
        """The group's layers: `layers`, the batch its rows are, in order, all the rows of
        (appended in place), or else a left-padded copy of every row's real positions."""
        runner = self.runner
        self.width = max(c.columns for c in caches)
        if layers:  # append where its buffers can be written in place
            self.width = kvcache.next_column(layers, self.width,
                                             lambda: runner.held_columns(layers))
        self.copied = layers is None or (self.width - longest > hole_budget(longest)
                                         or self.width + reserve > runner.max_context_len)
        if self.copied:
            self.width = longest
            self.spans = [kvcache.right_aligned(n, longest) for n in self.lengths]
            return kvcache.stack_rows([c.layers for c in caches], [c.spans for c in caches],
                                      reserve)
        return kvcache.columns_of(layers, self.width) if layers else layers

    @property
    def realign_seconds(self) -> float:
        """Time spent on rows that were not aligned: copying them into a left-padded batch,
        or building the mask that hides their pads and holes."""
        return self.stack_seconds if self.realigned else 0.0

    @torch.inference_mode()
    def step(self, input_ids: torch.Tensor, *, num_logits: int,
             valid: torch.Tensor | None = None, features: torch.Tensor | None = None,
             keep_hidden: bool = False) -> torch.Tensor:
        """Feed input_ids [batch, T] to every row; returns the last num_logits logits
        [batch, num_logits, vocab] in float32 (a feature head's: over its own vocabulary,
        runner.logit_token_ids). valid [batch, T] bool (where the runner packs positions):
        the real tokens; the others are right padding, which no real position
        attends to, whose logits are zeros and which no row may keep. features [batch, T,
        width]: for a model that reads them (required there). keep_hidden: keep the final
        hidden states in `self.hidden` (a feature head always does)."""
        started = time.perf_counter()
        kwargs = {}
        if self.runner.reads_features:
            if features is None:
                raise ValueError("a feature head's forward needs features")
            kwargs["features"] = self._seated(features.to(self.runner.device))
        input_ids = self._seated(input_ids)
        valid = None if valid is None else self._seated(valid)
        packed = valid is not None and self.runner.packs_positions \
            and packing.worth_packing(int((~valid).sum()))
        with (fastlinear.only_positions(valid) if packed else contextlib.nullcontext(),
              self._hidden_kept(keep_hidden and self.runner.lean_forward is None)):
            logits = self._step(input_ids, num_logits, started, kwargs, keep_hidden)
        if self.slots is None:
            return logits
        if self.hidden is not None:
            self.hidden = self.hidden[self.slots]
        return logits[self.slots]

    @torch.inference_mode()
    def draft_steps(self, input_ids: torch.Tensor, steps: int, params, sure: torch.Tensor,
                    min_confidence: float, features: torch.Tensor | None = None):
        """Feed input_ids [rows, T] to every row (a feature head: after `features` [rows, T,
        width]), then each row's choice under its SamplingParams `params` (as
        sampling.choose makes it), one token a step, for up to `steps` steps in one call
        (runner.draft_loop: fewer where min_confidence cuts every row, from each row's
        product of confidences `sure` [rows] on). Returns (choices [rows, run], the
        confidences [rows, run]), or None (nothing done) where the loop does not take these
        steps."""
        loop = self.runner.draft_loop
        batch, fed = len(self.lengths), input_ids.shape[1]
        if loop is None or not loop.takes(self.cache, batch * fed,
                                          max(self.lengths) + fed + steps):
            return None
        started = time.perf_counter()
        sure = self._seated(sure)  # (vacant rows: 0, cut from the start; and greedy)
        column_mask = None if self.mask is None or bool(self.mask.all()) else self.mask.bool()
        chosen, confidence = loop(self._seated(input_ids), torch.tensor(self.lengths),
                                  self.cache, column_mask, steps, sure, min_confidence,
                                  None if features is None else self._seated(features),
                                  [self._seated(t) for t in _sampling(params)])
        columns = fed + chosen.shape[1] - 1
        if self.mask is not None:
            self.mask = torch.cat([self.mask, self.mask.new_ones(batch, columns)], dim=1)
        self.hidden = None
        self._advanced(columns, None, started)
        if self.slots is None:
            return chosen, confidence
        return chosen[self.slots], confidence[self.slots]

    def _seated(self, rows: torch.Tensor) -> torch.Tensor:
        """A tensor of the group's rows [rows, ...] as the batch's rows: vacant rows zeros
        (False: a vacant row feeds no real position)."""
        if self.slots is None:
            return rows
        batch = rows.new_zeros((len(self.lengths), *rows.shape[1:]))
        batch[self.slots] = rows
        return batch

    @contextlib.contextmanager
    def _hidden_kept(self, keep: bool):
        """Keep the final hidden states of the forward inside in `self.hidden`: the output of
        the model's base (after its final norm: what `output_hidden_states` returns last),
        caught by a hook, so no other layer's hidden states are kept alive."""
        if not keep or self.runner.reads_features:
            yield
            return

        def catch(module, args, out):
            self.hidden = out[0] if isinstance(out, tuple) else out.last_hidden_state

        hook = self.runner.model.base_model.register_forward_hook(catch)
        try:
            yield
        finally:
            hook.remove()

    def _step(self, input_ids: torch.Tensor, num_logits: int, started: float,
              kwargs: dict, keep_hidden: bool) -> torch.Tensor:
        batch, num_new = input_ids.shape
        device = self.runner.device
        starts = torch.tensor(self.lengths, device=device)
        position_ids = starts[:, None] + torch.arange(num_new, device=device)[None, :]
        if self.mask is not None:
            self.mask = torch.cat([self.mask, self.mask.new_ones(batch, num_new)], dim=1)
            kwargs["attention_mask"] = self.mask
        self.hidden = None  # set by the forward below where kept
        if self.runner.lean_forward is not None:
            logits, self.hidden = self.runner.lean_forward(
                input_ids.to(device), position_ids, self.cache, kwargs.get("attention_mask"),
                num_logits, keep_hidden, kwargs.get("features"))
            return self._advanced(num_new, logits.float(), started)
        kwargs[self.runner.cache_keyword] = self.cache
        model = self.runner.model
        out = model(input_ids=input_ids.to(device), position_ids=position_ids, use_cache=True,
                    logits_to_keep=0 if self.runner.reads_features else num_logits, **kwargs)
        self.cache = kvcache.returned_cache(out)
        if self.runner.reads_features:
            self.hidden = out.hidden
            logits = model.lm_head.subset_logits(out.hidden[:, -num_logits:]).float()
        else:
            logits = out.logits[:, -num_logits:].float()
        return self._advanced(num_new, logits, started)

    def _advanced(self, num_new: int, logits: torch.Tensor, started: float) -> torch.Tensor:
        """After a forward fed num_new tokens to every row: the group's bookkeeping moved on."""
        self.lengths = [n + num_new for n in self.lengths]
        self.spans = [kvcache.append_span(s, self.width, self.width + num_new)
                      for s in self.spans]
        self.width += num_new
        self.forward_seconds += time.perf_counter() - started
        return logits

    def rows_after(self, keep_lens: list[int]) -> list[SeqCache]:
        """Per-row caches holding each row's first keep_lens[i] real positions (views of this
        group's batch, which the next forward of the same group reuses as it is)."""
        layers = kvcache.from_model_cache(self.cache)
        rows = []
        for i, keep in enumerate(keep_lens):
            slot = i if self.slots is None else self.slots[i]
            if keep > self.lengths[slot]:
                raise ValueError(f"row {i}: cannot keep {keep} of {self.lengths[slot]} "
                                 "positions")
            if keep == 0:
                rows.append(SeqCache(None, 0))
                continue
            rows.append(SeqCache(layers, keep, kvcache.keep_first(self.spans[slot], keep),
                                 row=slot))
        return rows


# Vacant rows a batch may keep (run, fed a token nothing keeps) rather than be copied into a
# smaller one: a row that leaves costs its share of each forward until a newcomer takes its
# place, where a copy of the batch costs about a step's attention at once.
def _sampling(params) -> list[torch.Tensor]:
    """Each row's (temperature, 0 for a greedy row; top_k; top_p; seed as int64) as the draft
    loop takes them; none where every row is greedy."""
    if all(p.greedy for p in params):
        return []
    temperature, top_k, top_p = sampling.settings(params)
    greedy = torch.tensor([p.greedy for p in params])
    return [temperature.masked_fill(greedy, 0.0), top_k, top_p,
            torch.from_numpy(sampling.seeds(params).view(np.int64))]


def vacancy_budget(batch_rows: int) -> int:
    return batch_rows // 8


def seat_in_place(runner: ModelRunner, caches: list[SeqCache], reserve: int):
    """Keep a batch whose membership changed: the group's rows that are rows of one batch stay
    where they are, the others (newcomers, such as freshly prefilled sequences) are copied
    into rows of it that no stored sequence holds, right-aligned at the batch's width, and rows
    left over stay vacant. Only the newcomers' positions are copied, where a realignment copies
    every row's. Returns (layers, width, the group's rows' batch rows, each batch row's length,
    its spans), or None where the batch cannot be kept: no batch, rows of it shared, too many
    vacant rows, no free row or column for a newcomer, or holes past the budget (callers ask
    only where the group is not the batch as a whole, resident_batch). A newcomer longer
    than the batch is wide widens it (zeros in the columns the other rows gain, holes to
    them), as wide as a copy of every row would make it."""
    homes = collections.Counter(id(c.home) for c in caches if c.home is not None)
    if not homes:
        return None
    home_id = homes.most_common(1)[0][0]
    home = next(c.home for c in caches if id(c.home) == home_id)
    buffers = getattr(home, "buffers", None)
    batch_rows = home[0][0].shape[0]
    slots = [c.row if id(c.home) == home_id else None for c in caches]
    taken = [r for r in slots if r is not None]
    if not buffers or len(set(taken)) != len(taken) or len(caches) > batch_rows \
            or batch_rows - len(caches) > vacancy_budget(batch_rows):
        return None
    held = {c.row for c in runner.stored_in(buffers)}
    free = [r for r in range(batch_rows) if r not in held and r not in taken]
    newcomers = [i for i, r in enumerate(slots) if r is None]
    if len(free) < len(newcomers):
        return None
    width = kvcache.next_column(home, max(caches[i].columns for i, r in enumerate(slots)
                                          if r is not None),
                                lambda: runner.held_columns(home))
    longest = max(c.length for c in caches)
    if longest + reserve > runner.max_context_len or width - longest > hole_budget(longest):
        return None
    if longest > width:  # a newcomer longer than the batch is wide: the batch is widened
        # (the columns its other rows gain are holes, masked), as wide as a copy would be
        if not kvcache.widen(buffers, width, longest, reserve):
            return None
        width = longest
    lengths, spans = [0] * batch_rows, [()] * batch_rows
    for i, slot in zip(newcomers, free):
        kvcache.place_row(buffers, slot, width, caches[i].layers, caches[i].spans)
        slots[i] = slot
        spans[slot] = kvcache.right_aligned(caches[i].length, width)
    for cache, slot in zip(caches, slots):
        lengths[slot] = cache.length
        if cache.home is home:
            spans[slot] = cache.spans
    return kvcache.columns_of(home, width), width, slots, lengths, spans


def resident_batch(caches: list[SeqCache]) -> list[kvcache.LayerKV] | None:
    """The batch tensors the caches are, in order, all the rows of (a lone row's own views);
    None when they are not."""
    home = caches[0].home
    if home is None or home[0][0].shape[0] != len(caches) or \
            any(c.home is not home or c.row != i for i, c in enumerate(caches)):
        return caches[0].layers if len(caches) == 1 else None
    return home
