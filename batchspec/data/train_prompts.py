"""Chat prompts for distilling a draft, built from templates x topics. They cover the same kinds
of work as the benchmark prompts (bench_prompts.jsonl) without repeating any of them, so the
benchmark set stays held out."""
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
        raise ValueError(f"at most {len(pool)} training prompts")
    return pool[:count]
