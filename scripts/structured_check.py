#!/usr/bin/env python3
"""Structured output against a running server, checked against the target alone.

Asks a server (`batchspec serve --http-port PORT`) held-out chat questions under JSON
schemas, greedy, through the official `openai` client, and decodes each with stock
transformers `generate` under the same grammar (llguidance as a logits processor, built
from the Hugging Face tokenizer, not from the server's code). Prints per question whether
the tokens are equal, whether the JSON parses, the server's acceptance and time.

    batchspec serve --http-port 8000 &
    python scripts/structured_check.py --port 8000 [--target-model smollm2]
"""
import argparse
import json
import time

QUESTIONS = [
    ("Describe the city of Lisbon.", {
        "type": "object", "additionalProperties": False,
        "required": ["city", "country", "famous_for"],
        "properties": {"city": {"type": "string"}, "country": {"type": "string"},
                       "famous_for": {"type": "array", "items": {"type": "string"},
                                      "maxItems": 3}}}),
    ("Is a tomato a fruit? Answer with a reason.", {
        "type": "object", "additionalProperties": False, "required": ["answer", "reason"],
        "properties": {"answer": {"enum": ["yes", "no"]}, "reason": {"type": "string"}}}),
    ("Give a recipe for pancakes.", {
        "type": "object", "additionalProperties": False, "required": ["title", "steps"],
        "properties": {"title": {"type": "string"},
                       "steps": {"type": "array", "items": {"type": "string"},
                                 "maxItems": 4}}}),
    ("Name a planet and its number of moons.", {
        "type": "object", "additionalProperties": False, "required": ["planet", "moons"],
        "properties": {"planet": {"type": "string"},
                       "moons": {"type": "integer", "minimum": 0, "maximum": 200}}}),
]


def reference(model, tokenizer, lltok, question, schema, max_tokens):
    import llguidance
    import torch

    from batchspec_tools.bench.grammar_mask import GrammarMask

    prompt = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                           add_generation_prompt=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
    eos = model.generation_config.eos_token_id
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             logits_processor=[GrammarMask(llguidance.LLMatcher(lltok, grammar),
                                                           len(prompt))],
                             eos_token_id=eos, pad_token_id=tokenizer.pad_token_id or 0)
    return tokenizer.decode(out[0, len(prompt):], skip_special_tokens=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--target-model", default="smollm2")
    parser.add_argument("--max-tokens", type=int, default=96)
    args = parser.parse_args()

    import llguidance.hf
    import openai
    from transformers import AutoTokenizer

    from batchspec.runtime import models

    source = models.resolve(args.target_model)
    tokenizer = AutoTokenizer.from_pretrained(source.path, gguf_file=source.gguf_file)
    model = models.load_causal_lm(args.target_model, stock=True)
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=model.config.vocab_size)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{args.port}/v1", api_key="unused")
    same = 0
    for question, schema in QUESTIONS:
        started = time.perf_counter()
        answer = client.chat.completions.create(
            model="batchspec", messages=[{"role": "user", "content": question}],
            max_tokens=args.max_tokens, temperature=0, response_format={
                "type": "json_schema", "json_schema": {"name": "a", "schema": schema}})
        seconds = time.perf_counter() - started
        text = answer.choices[0].message.content
        expected = reference(model, tokenizer, lltok, question, schema, args.max_tokens)
        try:
            json.loads(text)
            parses = True
        except ValueError:
            parses = False
        same += text == expected
        print(json.dumps({"question": question, "same_as_target_alone": text == expected,
                          "parses": parses, "finish": answer.choices[0].finish_reason,
                          "tokens": answer.usage.completion_tokens,
                          "seconds": round(seconds, 2), "answer": text}))
    print(f"{same}/{len(QUESTIONS)} answers equal to the target alone under the grammar")
    raise SystemExit(0 if same == len(QUESTIONS) else 1)


if __name__ == "__main__":
    main()
