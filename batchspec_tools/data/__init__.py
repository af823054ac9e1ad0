"""Prompt sets kept in the repo, and the one reader of the JSON-lines files the project keeps."""
import itertools
import json
import pathlib


def read_jsonl(path: pathlib.Path) -> list[dict]:
    """One dict per non-blank line."""
    return [json.loads(line) for line in pathlib.Path(path).read_text().splitlines()
            if line.strip()]


def bench_prompts(limit: int | None = None, path: str | None = None) -> list[dict]:
    """The benchmark's prompts ({"category", "prompt"} rows), or a JSONL file of the same
    shape ("category" optional)."""
    rows = read_jsonl(pathlib.Path(path) if path else
                      pathlib.Path(__file__).parent / "bench_prompts.jsonl")
    for row in rows:
        row.setdefault("category", "other")
    if not limit:
        return rows
    # a subset takes the categories in turn, so that every kind of work is in it
    by_category: dict[str, list[dict]] = {}
    for row in rows:
        by_category.setdefault(row["category"], []).append(row)
    interleaved = [row for group in itertools.zip_longest(*by_category.values())
                   for row in group if row is not None]
    return interleaved[:limit]


def right_padded(sequences: list[list[int]]):
    """(input_ids, attention_mask), each [len(sequences), longest], padded on the right."""
    import torch

    width = max(map(len, sequences))
    input_ids = torch.zeros(len(sequences), width, dtype=torch.long)
    mask = torch.zeros(len(sequences), width, dtype=torch.long)
    for i, seq in enumerate(sequences):
        input_ids[i, :len(seq)] = torch.tensor(seq)
        mask[i, :len(seq)] = 1
    return input_ids, mask
