"""KV-cache tensors of sequences and groups, and the one place that touches the transformers
Cache API (it moves between releases).

A sequence's cache is a set of columns of one batch tensor per layer, kept as views
[1, num_kv_heads, columns, head_dim] of that batch's row. Not every column holds a real position:
`Spans`, the ordered (start, end) column ranges that do, say which. Columns outside the spans
are left padding or the positions of rejected drafts ("holes"); they hold finite stale values
and are masked out of attention, never read as positions. Only `to_model_cache` and
`from_model_cache` know how the installed transformers wants the tensors.

A batch's tensors are views of `Buffer`s with free columns after the written ones: a forward
writes its new positions there instead of concatenating (a copy of the whole cache at every
layer, which cost a 16-row step over ~200 positions about a quarter of its time on a CPU).
"""
import inspect
from collections.abc import Callable

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

LayerKV = tuple[torch.Tensor, torch.Tensor]
Spans = tuple[tuple[int, int], ...]


# Free columns a new buffer gets past the ones it must hold: a batch decodes or verifies that
# many positions more in place before its next copy (into a larger buffer).
def spare_columns(columns: int) -> int:
    return max(64, columns // 8)


class Buffer:
    """One layer's keys and values, [batch, kv_heads, capacity, head_dim] each; columns
    [0, written) have been written, the others are free.

    Invariant: a view handed out never reaches past `written`, and nothing is written below it
    but columns no stored sequence holds (see next_column). So a forward changes no column any
    stored sequence holds, and a failed one leaves every sequence as it was."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, written: int):
        self.keys, self.values, self.written = keys, values, written
        self._last: tuple[int, LayerKV] | None = None  # (columns, its views): asked again

    @classmethod
    def empty(cls, like: torch.Tensor, batch: int, columns: int) -> "Buffer":
        """A buffer for `columns` columns of `batch` rows shaped like `like`, plus spare ones
        (none written yet)."""
        shape = (batch, like.shape[1], columns + spare_columns(columns), like.shape[3])
        return cls(like.new_empty(shape), like.new_empty(shape), 0)

    def view(self, columns: int) -> LayerKV:
        """Columns [0, columns) (columns <= written), as views (the same ones when asked for
        the same columns again: a step asks for each layer's a few times)."""
        if self._last is None or self._last[0] != columns:
            self._last = columns, (self.keys.narrow(2, 0, columns),
                                   self.values.narrow(2, 0, columns))
        return self._last[1]

    def ends(self, keys: torch.Tensor) -> bool:
        """Whether `keys` is this buffer's written columns, all of them (so what is appended
        after it may be written in place)."""
        if self._last is not None and self._last[1][0] is keys:  # a view of ours
            return self._last[0] == self.written
        return (keys.dim() == 4 and keys.data_ptr() == self.keys.data_ptr()
                and keys.shape[0] == self.keys.shape[0] and keys.shape[2] == self.written
                and keys.stride() == self.keys.stride())

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> LayerKV:
        """Write [batch, heads, T, dim] new positions at `written`; the views up to them."""
        end = self.written + keys.shape[2]
        self.keys[:, :, self.written:end].copy_(keys)
        self.values[:, :, self.written:end].copy_(values)
        return self.advanced(keys.shape[2])

    def advanced(self, more: int) -> LayerKV:
        """After `more` columns from `written` on were written: the views up to them."""
        self.written += more
        return self.view(self.written)


class Batch(list):
    """Per layer (keys, values) views [batch, kv_heads, columns, head_dim] of `buffers`."""

    def __init__(self, buffers: list[Buffer], columns: int):
        super().__init__(b.view(columns) for b in buffers)
        self.buffers = buffers


class AppendLayer(DynamicLayer):
    """A cache layer that writes new positions into its buffer's free columns when its
    tensors end that buffer (else it moves them, once, into a new buffer with spare room)."""

    buffer: Buffer | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        buffer = self.room(key_states.shape[2], key_states)
        self.keys, self.values = buffer.append(key_states, value_states)
        return self.keys, self.values

    def room(self, more: int, like: torch.Tensor) -> Buffer:
        """The buffer whose columns from `written` on take this layer's next `more` positions
        (shaped like `like`): its own where its tensors end it with room, else a new one
        holding them."""
        buffer = self.buffer
        if buffer is None or not buffer.ends(self.keys) or \
                buffer.written + more > buffer.keys.shape[2]:
            buffer = self.buffer = _moved(self.keys, self.values, like, more)
        return buffer


def _moved(keys: torch.Tensor, values: torch.Tensor, like: torch.Tensor, more: int) -> Buffer:
    """A new buffer holding keys and values (none when they are empty) with room for `more`."""
    width = keys.shape[2] if keys.dim() == 4 else 0
    buffer = Buffer.empty(like, like.shape[0], width + more)
    if width:
        buffer.append(keys, values)
    return buffer


def cache_keyword(model: torch.nn.Module) -> str:
    """The keyword a model's forward takes its KV cache by: `cache` where it has one
    (transformers 5, where `past_key_values` is deprecated and goes in 5.40), else
    `past_key_values` (earlier releases). Read from its signature: ask once per model on a
    hot path."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters \
        else "past_key_values"


def with_cache(model: torch.nn.Module, cache) -> dict:
    """{keyword: cache} for a forward of `model` (see cache_keyword)."""
    return {cache_keyword(model): cache}


def returned_cache(out):
    """The KV cache a forward returned, under whichever name its output gives it."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else getattr(out, "past_key_values", None)


def to_model_cache(layers: list[LayerKV] | None) -> DynamicCache:
    """A DynamicCache holding `layers` as they are (an empty cache for None): no copy. Where
    they are a `Batch`, its forwards write into the batch's buffers.

    (DynamicCache(ddp_cache_data=layers) would copy every tensor, as big a copy as a
    realignment: it appends the data to empty layers with torch.cat.)"""
    cache = DynamicCache()
    cache.layer_class_to_replicate = AppendLayer
    buffers = getattr(layers, "buffers", None) or [None] * len(layers or ())
    # what transformers sets up for a layer of these tensors (the same for every layer of a
    # model: its device and dtype), made once and given to each layer
    state = None
    for (keys, values), buffer in zip(layers or (), buffers):
        layer = AppendLayer()
        if state is None:
            layer.lazy_initialization(keys, values)
            state = dict(vars(layer))
        else:
            vars(layer).update(state)
        layer.keys, layer.values, layer.buffer = keys, values, buffer
        cache.layers.append(layer)
    return cache


def from_model_cache(cache: DynamicCache) -> list[LayerKV]:
    """The per-layer (keys, values) tensors of a cache, [batch, heads, length, head_dim]: a
    `Batch` when each layer's tensors end its buffer."""
    layers = [(layer.keys, layer.values) for layer in cache.layers]
    buffers = [getattr(layer, "buffer", None) for layer in cache.layers]
    if layers and all(b is not None and b.ends(k) for b, (k, _) in zip(buffers, layers)):
        return Batch(buffers, layers[0][0].shape[2])
    return layers


def next_column(layers: list[LayerKV], width: int, held: Callable[[], int]) -> int:
    """Where a forward over the first `width` columns of a resident batch appends, given that
    no stored sequence holds a column of its buffers past `held()` (asked only when columns
    were written past `width`): at `width` when the columns after it are held by none (the
    written ones there, rejected drafts, are written over), else after every written column
    (those between then hold no row's positions: holes), so that it writes in place."""
    buffers = getattr(layers, "buffers", None)
    if not buffers or len({b.written for b in buffers}) != 1 or width == buffers[0].written:
        return width
    if width < buffers[0].written and held() <= width:
        for buffer in buffers:
            buffer.written = width
        return width
    return max(width, buffers[0].written)


def columns_of(layers: list[LayerKV], width: int) -> list[LayerKV]:
    """The first `width` columns of a batch's layers, as views (a Batch where they can be)."""
    buffers = getattr(layers, "buffers", None)
    if buffers and all(width <= b.written for b in buffers):
        return Batch(buffers, width)
    return [(k[:, :, :width], v[:, :, :width]) for k, v in layers]


# ---- spans: which columns are real positions ---------------------------------------------------
def span_length(spans: Spans) -> int:
    return sum(end - start for start, end in spans)


def keep_first(spans: Spans, keep: int) -> Spans:
    """The spans of the first `keep` real positions (keep <= span_length(spans))."""
    kept, left = [], keep
    for start, end in spans:
        if left <= 0:
            break
        kept.append((start, min(end, start + left)))
        left -= end - start
    return tuple(kept)


def append_span(spans: Spans, start: int, end: int) -> Spans:
    """spans followed by the columns [start, end), merged with the last span when adjacent."""
    if spans and spans[-1][1] == start:
        return spans[:-1] + ((spans[-1][0], end),)
    return spans + ((start, end),)


def right_aligned(length: int, width: int) -> Spans:
    """The spans of `length` positions that end a row `width` columns wide (left padding)."""
    return ((width - length, width),) if length else ()


def is_plain(spans: Spans) -> bool:
    """True when the real positions are columns 0.. with no padding or hole among them."""
    return len(spans) <= 1 and (not spans or spans[0][0] == 0)


def column_mask(row_spans: list[Spans], width: int) -> torch.Tensor:
    """[batch, width] long: 1 on the columns that are real positions of each row."""
    mask = torch.zeros(len(row_spans), width, dtype=torch.long)
    for i, spans in enumerate(row_spans):
        for start, end in spans:
            mask[i, start:end] = 1
    return mask


# ---- stacking rows into a batch ----------------------------------------------------------------
def stack_rows(rows: list[list[LayerKV] | None], row_spans: list[Spans],
               more: int = 0) -> Batch | None:
    """Copy each row's real positions (its spans) into one left-padded batch, whose buffers
    have room for `more` positions after them (and spare columns).

    Row i's positions, in order, end up as the last span_length(row_spans[i]) columns of
    [max length] columns; the pad columns before them are zeros. None when every row is empty.
    """
    lengths = [span_length(s) for s in row_spans]
    width = max(lengths)
    if width == 0:
        return None
    template = next(r for r, n in zip(rows, lengths) if n > 0)
    indices = [_column_index(spans, ref=template[0][0]) for spans in row_spans]
    buffers = []
    for layer_index, (ref, _) in enumerate(template):
        buffer = Buffer.empty(ref, len(rows), width + more)
        buffer.written = width
        for which, out in enumerate(buffer.view(width)):
            _left_padded(out, rows, row_spans, indices, lengths, layer_index, which)
        buffers.append(buffer)
    return Batch(buffers, width)


def _column_index(spans: Spans, ref: torch.Tensor) -> torch.Tensor | None:
    """The real columns of a row with more than one span, as an index tensor (else None)."""
    if len(spans) <= 1:
        return None
    return torch.cat([torch.arange(start, end) for start, end in spans]).to(ref.device)


def _left_padded(out, rows, row_spans, indices, lengths, layer_index, which):
    """Copy one layer's keys (which=0) or values (1) of every row into `out`
    [batch, heads, width, head_dim], its pad columns zeroed."""
    for i, (row, spans, index, n) in enumerate(zip(rows, row_spans, indices, lengths)):
        _right_aligned(out[i], row[layer_index][which][0] if n else None, spans, index, n)


def _right_aligned(out: torch.Tensor, source: torch.Tensor | None, spans: Spans,
                   index: torch.Tensor | None, n: int) -> None:
    """Write a row's n real positions (its spans in `source`, [heads, columns, head_dim]; or
    `index`, their columns where there are several spans) as the last n columns of `out`
    [heads, width, head_dim], zeros before them."""
    width = out.shape[1]
    if n < width:
        out[:, :width - n].zero_()
    if not n:
        return
    if index is None:
        start, end = spans[0]
        out[:, width - n:].copy_(source[:, start:end])
    else:
        out[:, width - n:].copy_(source.index_select(1, index))


@torch.inference_mode()  # buffers a forward made are inference tensors
def widen(buffers: list[Buffer], width: int, new_width: int, room: int) -> bool:
    """Make a batch written up to `width` (every column after it free) `new_width` wide, the
    new columns zeros in every row, with `room` free columns still after them; False (nothing
    changed) where its buffers are not written up to `width` or have no such room."""
    if any(b.written != width or new_width + room > b.keys.shape[2] for b in buffers):
        return False
    for buffer in buffers:
        buffer.keys[:, :, width:new_width].zero_()
        buffer.values[:, :, width:new_width].zero_()
        buffer.written = new_width
    return True


@torch.inference_mode()  # buffers a forward made are inference tensors
def place_row(buffers: list[Buffer], slot: int, width: int, row: list[LayerKV] | None,
              spans: Spans) -> None:
    """Write one sequence's real positions (its spans in `row`, its own layers) into row
    `slot` of a batch's buffers as the last columns of [0, width), zeros before them: the
    row a left-padded stacking would have given it, written in place. The caller makes sure
    no stored sequence holds that row."""
    n = span_length(spans)
    index = _column_index(spans, ref=buffers[0].keys)
    for layer_index, buffer in enumerate(buffers):
        for which, out in enumerate((buffer.keys, buffer.values)):
            _right_aligned(out[slot, :, :width], row[layer_index][which][0] if n else None,
                           spans, index, n)


def take_row(layers: list[LayerKV], row: int, columns: int) -> list[LayerKV] | None:
    """Row `row`'s first `columns` columns of a batched cache (views, no copy)."""
    if columns == 0:
        return None
    return [(k[row:row + 1, :, :columns], v[row:row + 1, :, :columns]) for k, v in layers]
