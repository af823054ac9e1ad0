"""Chat prompts for distilling a draft. They cover the same kinds of work as the benchmark
prompts (bench_prompts.jsonl) without repeating any of them, so the benchmark set stays held out.

Two fixed sources, in this order (a longer list keeps a shorter one as its prefix, so a
resumed `distill` only generates the new prompts):
1. templates x topics (1,440 prompts);
2. tasks on passages and functions of Python's own standard library (docstrings and short
   function sources, read with `inspect`): summarising, extracting, explaining, translating
   and reviewing code on thousands of different texts. Templated prompts alone get a draft
   that agrees with the target on 66% of its training answers but 31% of the benchmark's
   (`batchspec evaluate-draft --draft DIR --training-data DIR`, README); varied inputs are
   what it lacks.

And one the target writes itself (`distill --self-instruct N`, self-instruct style): N
requests, one per kind of benchmark work in turn, each on a topic ("write a question someone
might ask about owls"), that the target answers *by sampling*; `self_instruct_prompt` turns
each answer into a training prompt (the text itself, or a task wrapped around it).
"""
import importlib
import inspect
import itertools
import random

TEMPLATES = [
    "Explain {t} in simple terms.",
    "What are three interesting facts about {t}?",
    "Write a short poem about {t}.",
    "Give me a few tips related to {t}.",
    "Write a short paragraph describing {t}.",
    "What are the pros and cons of {t}?",
    "Summarize what most people should know about {t}.",
    "Write a friendly message to a friend about {t}.",
    "How would you teach a child about {t}?",
    "List five questions someone might ask about {t}.",
    "Write a tweet about {t}.",
    "Describe the history of {t} briefly.",
    "What is a common misconception about {t}?",
    "Translate the phrase '{t} is important' into French and Spanish.",
    "Write a Python function with a docstring about {t}.",
    "Create a short quiz with two questions about {t}.",
]
TOPICS = [
    "volcanoes", "the moon", "coffee", "machine learning", "gardening", "the ocean", "bicycles",
    "chess", "music theory", "the Roman Empire", "recycling", "sleep", "electric cars",
    "honey bees", "the internet", "cooking pasta", "budgeting", "climate change", "dinosaurs",
    "yoga", "photography", "the human heart", "mountains", "time management", "rainbows",
    "saving energy at home", "learning a language", "friendship", "solar panels", "libraries",
    "public speaking", "deserts", "football", "bread baking", "earthquakes", "the stock market",
    "penguins", "meditation", "video games", "origami",
]
# A second pool, appended after the first so that earlier runs' data stays a prefix.
MORE_TEMPLATES = [
    "Can you help me understand {t}?", "I'm curious about {t}. Where should I start?",
    "Write a short dialogue between two friends discussing {t}.",
    "Give a step-by-step explanation related to {t}.", "What would a beginner get wrong about {t}?",
    "Write an email to a colleague summarizing a talk about {t}.",
    "Compare {t} with something similar and explain the difference.",
    "Why do people care about {t}?", "Write a short story that involves {t}.",
    "Explain {t} to a five-year-old.", "What are the main parts of {t}?",
    "Give me a fun fact about {t} and explain why it is true.",
]
MORE_TOPICS = [
    "black holes", "the French Revolution", "photosynthesis", "jazz", "tea", "rivers",
    "spreadsheets", "the immune system", "wind turbines", "marathons", "knitting", "owls",
    "databases", "the printing press", "coral reefs", "cloud computing", "camping",
    "vitamins", "elections", "bridges", "comets", "the piano", "cheese", "glaciers",
    "sorting algorithms", "the Olympic Games", "tomatoes", "airplanes", "sharks", "poetry",
    "renting an apartment", "job interviews", "first aid", "kites", "the Great Wall of China",
    "rainforests", "dogs", "bread", "painting", "smartphones", "the alphabet", "robots",
    "chocolate", "trains", "the sun", "fractions", "email etiquette", "houseplants",
    "volunteering", "podcasts",
]
ARITHMETIC = [
    "What is {a} plus {b}?", "What is {a} times {b}?", "What is {a} minus {b}?",
    "If a book costs ${a} and I pay with ${c}, how much change do I get?",
    "What is {b}% of {c}?",
]


PASSAGE_TASKS = [
    "Summarize the following text in one sentence:\n\n{x}",
    "Explain this in simple words:\n\n{x}",
    "Extract the key terms from this text as a bulleted list:\n\n{x}",
    "Write two questions that this text answers, with their answers:\n\n{x}",
    "Rewrite the following as a short, friendly paragraph for a beginner:\n\n{x}",
    "Translate the following into French:\n\n{s}",
    "Translate the following into Spanish:\n\n{s}",
    "Give a real-world example that illustrates this:\n\n{x}",
    "What is the main point of this passage?\n\n{x}",
    "Turn this description into a numbered list:\n\n{x}",
]
CODE_TASKS = [
    "Explain what this Python function does:\n\n```python\n{x}```",
    "Write a docstring for this Python function:\n\n```python\n{x}```",
    "Suggest one improvement to this code and show the improved version:\n\n```python\n{x}```",
    "Write a unit test for this function:\n\n```python\n{x}```",
    "Add a comment to each step of this function:\n\n```python\n{x}```",
]
# Standard-library modules present in every CPython 3.11 build (no optional C extensions).
STDLIB_MODULES = [
    "abc", "argparse", "array", "ast", "base64", "binascii", "bisect", "calendar", "cmd",
    "code", "codecs", "collections", "colorsys", "concurrent.futures", "configparser",
    "contextlib", "copy", "csv", "dataclasses", "datetime", "decimal", "difflib", "dis",
    "doctest", "email.message", "enum", "filecmp", "fileinput", "fnmatch", "fractions",
    "functools", "getopt", "gettext", "glob", "graphlib", "gzip", "hashlib", "heapq", "hmac",
    "html", "http.client", "http.cookies", "http.server", "inspect", "io", "ipaddress",
    "itertools", "json", "json.decoder", "keyword", "linecache", "locale", "logging", "mailbox",
    "mimetypes", "netrc", "numbers", "operator", "optparse", "os", "pathlib", "pickle",
    "pkgutil", "platform", "plistlib", "pprint", "profile", "pstats", "queue", "quopri",
    "random", "re", "reprlib", "runpy", "sched", "secrets", "selectors", "shelve", "shlex",
    "shutil", "signal", "smtplib", "socket", "stat", "statistics", "string", "struct",
    "subprocess", "sysconfig", "tarfile", "tempfile", "textwrap", "threading", "timeit",
    "token", "tokenize", "tomllib", "trace", "traceback", "types", "typing", "unittest",
    "urllib.parse", "urllib.request", "uuid", "warnings", "wave", "weakref",
    "xml.etree.ElementTree", "xmlrpc.client", "zipapp", "zipfile", "zoneinfo",
]


def stdlib_texts() -> tuple[list[str], list[str]]:
    """(docstring paragraphs of 120-700 characters, sources of 4-25-line functions) of the
    public functions and classes of STDLIB_MODULES, each once, in a fixed order."""
    passages, functions = {}, {}
    for module_name in STDLIB_MODULES:
        module = importlib.import_module(module_name)
        for name, obj in sorted(vars(module).items()):
            if name.startswith("_") or getattr(obj, "__module__", None) != module.__name__:
                continue
            if not (inspect.isfunction(obj) or inspect.isclass(obj)):
                continue
            for paragraph in (inspect.getdoc(obj) or "").split("\n\n"):
                paragraph = " ".join(paragraph.split())
                if 120 <= len(paragraph) <= 700 and ">>>" not in paragraph:
                    passages.setdefault(paragraph)
            if inspect.isfunction(obj):
                try:
                    source = inspect.getsource(obj)
                except (OSError, TypeError):
                    continue
                if 4 <= source.count("\n") <= 25:
                    functions.setdefault(source)
    return list(passages), list(functions)


def first_sentence(text: str) -> str:
    end = text.find(". ")
    return text if end < 0 else text[:end + 1]


def stdlib_prompts(seed: int) -> list[str]:
    passages, functions = stdlib_texts()
    prompts = [task.format(x=p, s=first_sentence(p))
               for task, p in itertools.product(PASSAGE_TASKS, passages)]
    prompts += [task.format(x=f) for task, f in itertools.product(CODE_TASKS, functions)]
    prompts = list(dict.fromkeys(prompts))  # a one-sentence passage translates only once
    random.Random(seed + 2).shuffle(prompts)
    return prompts


def training_prompts(count: int, seed: int = 0) -> list[str]:
    """`count` distinct prompts, deterministic for a seed."""
    rng = random.Random(seed)
    pool = [t.format(t=topic) for t, topic in itertools.product(TEMPLATES, TOPICS)]
    for template in ARITHMETIC:
        for _ in range(40):
            a, b = rng.randint(2, 99), rng.randint(2, 50)
            pool.append(template.format(a=a, b=b, c=a + rng.randint(1, 200)))
    rng.shuffle(pool)
    more = [t.format(t=topic) for t, topic in itertools.product(MORE_TEMPLATES, MORE_TOPICS)]
    random.Random(seed + 1).shuffle(more)
    pool += more
    if count > len(pool):
        pool += stdlib_prompts(seed)
    if count > len(pool):
        raise ValueError(f"at most {len(pool)} training prompts")
    return pool[:count]


# (kind of work, request the target answers by sampling, how its answer becomes a prompt).
# The kinds are the benchmark's; "{x}" is the target's answer, stripped.
SELF_INSTRUCT = [
    ("conversation", "Write a message that someone might send to a friendly chatbot about {t}, "
                     "asking for advice or an opinion. Write only the message.", "{x}"),
    ("qa", "Write one question about {t} that starts with why, how or what. "
           "Write only the question.", "{x}"),
    ("writing", "Write a request for a short creative text (a story, a poem, a letter or a "
                "slogan) about {t}. Write only the request.", "{x}"),
    ("coding", "Write a short programming question or a small Python task inspired by {t}. "
               "Write only the task.", "{x}"),
    ("math", "Write a short math word problem about {t}. Write only the problem.", "{x}"),
    ("extraction", "Write two sentences about {t} that mention names, places, dates or "
                   "numbers.", "{task}: '{x}'"),
    ("translation", "Write one short everyday sentence about {t}.", "{task}: '{x}'"),
    ("summarization", "Write a short paragraph about {t}.", "{task}:\n\n{x}"),
]
EXTRACTION_TASKS = ["List the names mentioned in", "List every number and date in",
                    "Which places are mentioned in", "Extract the key facts as a list from"]
TRANSLATION_TASKS = [f"Translate into {language}" for language in
                     ("French", "Spanish", "German", "Italian", "Portuguese")]
SUMMARY_TASKS = ["Summarize in one sentence", "Give the main point of this text",
                 "Summarize this for a child", "Write a title and a one-line summary for this"]
WRAP_TASKS = {"extraction": EXTRACTION_TASKS, "translation": TRANSLATION_TASKS,
              "summarization": SUMMARY_TASKS}


def self_instruct_requests(count: int, seed: int = 0) -> list[dict]:
    """`count` requests for the target to answer by sampling, the kinds in turn, each with a
    topic and (for kinds that wrap the answer in a task) the task; deterministic for a seed."""
    rng = random.Random(seed + 3)
    topics = TOPICS + MORE_TOPICS
    requests = []
    for i in range(count):
        kind, request, wrap = SELF_INSTRUCT[i % len(SELF_INSTRUCT)]
        tasks = WRAP_TASKS.get(kind, [""])
        requests.append({"kind": kind, "request": request.format(t=rng.choice(topics)),
                         "wrap": wrap, "task": rng.choice(tasks)})
    return requests


def self_instruct_prompt(request: dict, answer: str, max_chars: int = 600) -> str | None:
    """The training prompt a sampled answer gives, or None for an unusable one (empty, too
    long, or still talking about the request)."""
    text = answer.strip().strip('"').strip()
    if not 10 <= len(text) <= max_chars or "write only" in text.lower():
        return None
    return request["wrap"].format(x=text, task=request["task"])
