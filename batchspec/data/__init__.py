"""Prompt sets kept in the repo, and the one reader of the JSON-lines files the project keeps."""
import json
import pathlib


def read_jsonl(path: pathlib.Path) -> list[dict]:
    """One dict per non-blank line."""
    return [json.loads(line) for line in pathlib.Path(path).read_text().splitlines()
            if line.strip()]
