"""Prompt sets for the target's own generations, built offline: hand-written instructions, free-text requests
combined from word lists (stories, poems, letters, descriptions, how-tos, comparisons), and prompts made from the
Python standard library's sources (functions to explain, complete or document; module docs to summarise).

Two disjoint sets. Training prompts come from `TRAIN_*` lists and from stdlib modules outside the held-out tenth;
held-out prompts come from `HELDOUT_*` lists and from those modules only, so no held-out prompt, function or
paragraph is ever seen in training (free-text prompts cross training words only, or held-out words only). Every
choice is seeded, so a set is the same on every machine with the same Python version.
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import os
import random
import sysconfig

# Folders of the standard library that are tests, demos, bundled tools or installed third-party code.
SKIPPED_DIRS = {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo", "ensurepip",
                "__pycache__", "tkinter", "pydoc_data"}

# One module in ten is held out, chosen by a stable hash of its path (Python's own hash() is salted per process).
HELDOUT_SHARE = 10


@dataclasses.dataclass(frozen=True)
class Prompt:
    text: str
    chat: bool  # wrap in the tokenizer's chat template (else the raw text is continued, as the CLI without --chat)
    stdlib: bool = False  # made from standard-library source (else written: hand-written or free text)


TRAIN_TASKS = [
    "checks whether a string is a palindrome", "returns the n-th Fibonacci number", "reverses the words in a sentence",
    "counts the vowels in a string", "flattens a nested list", "removes duplicates from a list while keeping order",
    "finds the largest element of a list without using max", "converts Celsius to Fahrenheit",
    "checks whether two strings are anagrams", "returns the factorial of a number",
    "merges two sorted lists into one sorted list", "computes the greatest common divisor of two numbers",
    "counts how often each word occurs in a text", "validates an email address with a regular expression",
    "reads a CSV file and returns its rows as dictionaries", "finds the second largest number in a list",
    "rotates a list by k positions", "checks whether a year is a leap year", "converts a Roman numeral to an integer",
    "returns all prime numbers below n", "computes the average of a list of numbers",
    "splits a list into chunks of a given size", "capitalizes the first letter of every word",
    "checks whether a list is sorted", "computes the sum of the digits of a number",
    "finds the longest common prefix of a list of strings", "transposes a matrix given as a list of lists",
    "converts a binary string to an integer", "returns the intersection of two lists",
    "implements binary search on a sorted list", "counts the lines in a text file",
    "finds the most common element in a list", "generates a random password of a given length",
    "checks whether parentheses in a string are balanced", "computes the dot product of two vectors",
    "returns the median of a list of numbers", "removes all whitespace from a string",
    "converts a dictionary to a JSON string", "sorts a list of tuples by their second element",
    "computes compound interest", "finds all pairs in a list that sum to a target",
    "implements a simple stack class", "implements a queue using two stacks",
    "returns the number of days between two dates", "converts snake_case to camelCase",
    "checks whether a number is a perfect square", "finds the missing number in a list from 1 to n",
    "groups a list of words by their first letter", "computes the running total of a list",
    "parses a URL query string into a dictionary",
]
HELDOUT_TASKS = [
    "checks whether a number is prime", "counts the characters in a string that are digits",
    "returns the longest word in a sentence", "computes the least common multiple of two numbers",
    "deduplicates a list of dictionaries by a key", "converts an integer to its binary representation",
    "checks whether a matrix is symmetric", "returns the n largest values of a list",
]
TRAIN_CONCEPTS = [
    "recursion", "a hash table", "object-oriented programming", "a linked list", "big O notation", "a closure",
    "version control", "a REST API", "unit testing", "a race condition", "garbage collection", "a binary tree",
    "dynamic programming", "an operating system", "photosynthesis", "inflation", "the water cycle", "gravity",
    "supply and demand", "a black hole", "machine learning", "compound interest", "vaccines", "the greenhouse effect",
    "a neural network", "encryption", "a compiler", "the internet", "plate tectonics", "the immune system",
    "a database index", "a decorator in Python", "a generator in Python", "list comprehensions",
    "exceptions in Python", "virtual environments", "the difference between a list and a tuple", "type hints",
    "the global interpreter lock", "an API key", "cloud computing", "a spreadsheet formula", "electric circuits",
    "the scientific method", "democracy", "evolution by natural selection", "the stock market", "climate change",
]
HELDOUT_CONCEPTS = [
    "a hash function", "a mutex", "the TCP handshake", "a context manager in Python", "recursion limits",
    "the difference between weather and climate", "interest rates", "DNA",
]
TRAIN_TIPS = [
    "learning a new programming language", "writing clean code", "staying focused while studying",
    "preparing for a job interview", "saving money each month", "getting better sleep", "running a productive meeting",
    "writing a good email", "debugging a program", "keeping a houseplant alive", "learning to cook",
    "starting to exercise", "organizing files on a computer", "giving a presentation", "reading more books",
    "writing documentation", "reviewing a colleague's code", "planning a trip", "managing stress at work",
    "naming variables well", "learning to draw", "working from home", "taking notes in a lecture",
    "writing tests for a Python project",
]
HELDOUT_TIPS = [
    "making a small Python script easier for a colleague to read", "learning a musical instrument",
    "keeping a kitchen tidy", "writing a cover letter",
]
TRAIN_QUESTIONS = [
    "What is the capital of France, and what is it known for?", "Why is the sky blue?",
    "How do airplanes stay in the air?", "What is the difference between a virus and a bacterium?",
    "Write a short poem about the ocean.", "Write a haiku about autumn leaves.", "Tell me a fun fact about octopuses.",
    "Write a short story about a robot who learns to paint.", "What should I pack for a weekend hiking trip?",
    "How does a refrigerator work?", "What are the main causes of the French Revolution?",
    "Give me a recipe for a simple tomato pasta.", "What are the benefits of drinking water?",
    "Explain how to change a flat tire.", "What is the Pythagorean theorem?", "How do I make a cup of tea?",
    "Write a thank-you note to a teacher.", "Describe the life cycle of a butterfly.",
    "What is the difference between weather and climate in one paragraph?",
    "Suggest five names for a coffee shop.", "Write a limerick about a cat.", "How does a bill become a law?",
    "What are the planets in the solar system?", "Explain the rules of chess briefly.",
    "Write a product description for a reusable water bottle.", "How do vaccines train the immune system?",
    "What is the difference between Python 2 and Python 3?", "How do I reverse a list in Python?",
    "What does the yield keyword do in Python?", "How do I read a file line by line in Python?",
    "What is a lambda function in Python?", "How can I sort a dictionary by value in Python?",
    "Write a SQL query that finds the ten most recent orders.", "What is the difference between git merge and rebase?",
    "How do I create a virtual environment in Python?", "What is the time complexity of quicksort?",
]
HELDOUT_QUESTIONS = [
    "Why do leaves change colour in autumn?", "Write a short poem about a lighthouse.",
    "How do I remove duplicates from a list in Python?", "What is the difference between a process and a thread?",
    "Give me a recipe for pancakes.", "How does a bicycle gear system work?",
]


# Free text. Chat models are mostly asked for prose, and prose is where MTP layers trained on code draft worst, so
# about half of the training prompts are written as below (see docs/design.md, 'MTP layers and training'). Each
# family crosses two word lists; held-out lists share no entry with training ones.
TRAIN_CHARACTERS = [
    "a young baker", "an old fisherman", "a curious cat", "a retired astronaut", "a shy librarian",
    "a street musician", "a lost dog", "a farmer", "a little girl", "a tired nurse", "a clockmaker", "a dragon",
    "a detective", "a schoolteacher", "a mail carrier", "a beekeeper", "a painter", "a sailor", "a grandmother",
    "a young inventor",
]
HELDOUT_CHARACTERS = ["a night guard", "a young violinist", "a mountain guide", "a parrot", "a train conductor"]
TRAIN_EVENTS = [
    "finds a hidden door in the basement", "loses something important", "makes an unlikely friend",
    "wins a contest by accident", "gets stuck in a snowstorm", "discovers a hidden talent",
    "receives a mysterious letter", "moves to a new city", "has to keep a secret", "finds an old map",
    "misses the last train home", "plants a strange seed", "meets a childhood hero", "learns to say no",
    "repairs a broken music box", "gets lost in a forest", "builds a boat from scrap", "finds an old photograph",
    "opens a small shop", "teaches a neighbour to read",
]
HELDOUT_EVENTS = ["wakes up in another century", "hears a strange noise at night", "finds a wallet on the street",
                  "plants a garden on a rooftop", "gets a second chance"]
TRAIN_FORMS = ["a short poem", "a haiku", "a short essay", "a diary entry", "a short speech", "a news report",
               "a song verse", "a short blog post"]
HELDOUT_FORMS = ["a sonnet", "a postcard"]
TRAIN_THEMES = [
    "the first day of spring", "a rainy afternoon", "a busy market", "friendship", "learning from mistakes",
    "a long journey", "the city at night", "a favourite meal", "the sea", "growing older", "a snowy morning",
    "a garden", "the moon", "a public library", "a summer holiday", "a thunderstorm",
]
HELDOUT_THEMES = ["a quiet village", "a windy beach", "an old bridge"]
TRAIN_MESSAGES = ["a short email to a colleague", "a letter to a friend", "a note to a neighbour",
                  "a message to a customer", "a letter to a local newspaper"]
HELDOUT_MESSAGES = ["a message to a landlord"]
TRAIN_PURPOSES = [
    "asking to move a meeting", "thanking them for their help", "apologising for a delay", "announcing a new product",
    "inviting them to a party", "complaining about noise", "asking for advice", "declining an invitation politely",
    "sharing good news", "asking for a refund",
]
HELDOUT_PURPOSES = ["reporting a broken heater", "asking for a day off"]
TRAIN_SIGHTS = ["snow", "the ocean", "a desert", "a rainbow", "a forest in autumn", "a city at rush hour",
                "a volcano", "a waterfall", "a night sky full of stars", "a coral reef"]
HELDOUT_SIGHTS = ["a glacier", "the northern lights"]
TRAIN_HOWTOS = ["bake bread", "plant a tree", "tie a tie", "wash a car", "make a paper airplane", "set up a tent",
                "brew coffee", "paint a room", "write a resume", "clean a bicycle chain"]
HELDOUT_HOWTOS = ["iron a shirt", "repot a plant"]
TRAIN_PAIRS = [("a crocodile", "an alligator"), ("a lake", "a pond"), ("a list", "a set in Python"),
               ("HTTP", "HTTPS"), ("a violin", "a viola"), ("baking soda", "baking powder"),
               ("a comet", "an asteroid"), ("memory", "storage in a computer"), ("a simile", "a metaphor"),
               ("a novel", "a short story")]
HELDOUT_PAIRS = [("a frog", "a toad"), ("a loan", "a grant")]
TRAIN_IDEAS = ["a rainy day with children", "a birthday gift for a friend", "a healthy breakfast",
               "a weekend project", "a team-building activity", "a science fair project", "a short trip near home",
               "a blog about cooking"]
HELDOUT_IDEAS = ["a school fundraiser"]


def free_text_prompts(heldout: bool) -> list[str]:
    """Requests for prose: each family crosses two lists of the split."""
    pick = (lambda train, held: held if heldout else train)  # noqa: E731
    characters, events = pick(TRAIN_CHARACTERS, HELDOUT_CHARACTERS), pick(TRAIN_EVENTS, HELDOUT_EVENTS)
    forms, themes = pick(TRAIN_FORMS, HELDOUT_FORMS), pick(TRAIN_THEMES, HELDOUT_THEMES)
    messages, purposes = pick(TRAIN_MESSAGES, HELDOUT_MESSAGES), pick(TRAIN_PURPOSES, HELDOUT_PURPOSES)
    return (
        [f"Write a short story about {who} who {event}." for who in characters for event in events]
        + [f"Write {form} about {theme}." for form in forms for theme in themes]
        + [f"Write {message} {purpose}." for message in messages for purpose in purposes]
        + [f"Describe {sight} to someone who has never seen it." for sight in pick(TRAIN_SIGHTS, HELDOUT_SIGHTS)]
        + [f"Explain step by step how to {task}." for task in pick(TRAIN_HOWTOS, HELDOUT_HOWTOS)]
        + [f"What is the difference between {a} and {b}?" for a, b in pick(TRAIN_PAIRS, HELDOUT_PAIRS)]
        + [f"Give me five ideas for {topic}." for topic in pick(TRAIN_IDEAS, HELDOUT_IDEAS)]
    )


def handwritten_prompts(heldout: bool) -> list[str]:
    tasks, concepts, tips, questions = (
        (HELDOUT_TASKS, HELDOUT_CONCEPTS, HELDOUT_TIPS, HELDOUT_QUESTIONS) if heldout
        else (TRAIN_TASKS, TRAIN_CONCEPTS, TRAIN_TIPS, TRAIN_QUESTIONS)
    )
    return (
        [f"Write a Python function that {task}." for task in tasks]
        + [f"Explain {concept} in simple terms." for concept in concepts]
        + [f"What are three practical tips for {tip}?" for tip in tips]
        + list(questions)
    )


def stdlib_root() -> str:
    return sysconfig.get_path("stdlib")


def stdlib_files() -> list[str]:
    """Every .py file of the standard library outside `SKIPPED_DIRS`, sorted (stable order on every machine)."""
    found = []
    for root, dirs, files in os.walk(stdlib_root()):
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS)
        found += [os.path.join(root, name) for name in files if name.endswith(".py")]
    return sorted(found)


def is_heldout_file(path: str) -> bool:
    relative = os.path.relpath(path, stdlib_root())
    return int(hashlib.sha256(relative.encode()).hexdigest(), 16) % HELDOUT_SHARE == 0


def stdlib_prompts(files: list[str], limit: int, seed: int) -> list[str]:
    """Up to `limit` prompts made from the functions, classes and module docs of `files`."""
    rng = random.Random(seed)
    made = []
    for path in files:
        try:
            with open(path, encoding="utf-8") as handle:
                source = handle.read()
            tree = ast.parse(source)
        except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
            continue
        made += _module_prompts(tree, source.splitlines(), rng)
    rng.shuffle(made)
    return made[:limit]


def _module_prompts(tree: ast.Module, lines: list[str], rng: random.Random) -> list[str]:
    out = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef)):
            paragraph = _first_paragraph(ast.get_docstring(node) or "")
            if len(paragraph) > 120:
                out.append(rng.choice(SUMMARY_TEMPLATES).format(text=paragraph))
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
            continue
        code = lines[node.lineno - 1: node.end_lineno]
        if not 4 <= len(code) <= 25:
            continue
        docstring = ast.get_docstring(node)
        if docstring and rng.random() < 0.4:
            head = _dedent(code[: node.body[0].end_lineno - node.lineno + 1])  # signature and docstring
            out.append(f"Complete this Python function. Reply with the code only.\n\n```python\n{head}\n")
        else:
            out.append(rng.choice(CODE_TEMPLATES).format(code=_dedent(code)))
    return out


SUMMARY_TEMPLATES = [
    "Summarize the following text in two sentences.\n\n{text}",
    "Explain the following documentation to a beginner.\n\n{text}",
    "Rewrite this paragraph in plain English.\n\n{text}",
]
CODE_TEMPLATES = [
    "Explain what this Python function does.\n\n```python\n{code}\n```",
    "Suggest one improvement to this Python function and show the new version.\n\n```python\n{code}\n```",
    "Write a docstring for this Python function.\n\n```python\n{code}\n```",
    "Write a unit test for this Python function.\n\n```python\n{code}\n```",
    "{code}",
]


def _first_paragraph(doc: str) -> str:
    return " ".join(doc.strip().split("\n\n")[0].split())


def _dedent(lines: list[str]) -> str:
    indent = min((len(line) - len(line.lstrip()) for line in lines if line.strip()), default=0)
    return "\n".join(line[indent:] for line in lines)


def prompt_set(heldout: bool, count: int, stdlib_share: float = 0.5, chat_share: float = 0.8,
               seed: int = 0) -> list[Prompt]:
    """Up to `count` prompts of the training or held-out split, in a seeded order: a `stdlib_share` of them made
    from stdlib modules of the split, the rest written (hand-written and free text), each kind topping up the
    other where it runs short. A `chat_share` of them use the chat template; the rest are continued as raw text."""
    rng = random.Random(seed + 7)
    files = [path for path in stdlib_files() if is_heldout_file(path) == heldout]
    written = handwritten_prompts(heldout) + free_text_prompts(heldout)
    random.Random(seed).shuffle(written)
    stdlib = stdlib_prompts(files, count, seed + heldout)
    from_stdlib = min(len(stdlib), max(round(stdlib_share * count), count - len(written)))
    chosen = [(text, False) for text in written[: count - from_stdlib]]
    chosen += [(text, True) for text in stdlib[:from_stdlib]]
    rng.shuffle(chosen)
    return [Prompt(text, rng.random() < chat_share, stdlib=made) for text, made in chosen]


def training_files() -> list[str]:
    """Standard library files whose source text training may read (the held-out modules excluded)."""
    return [path for path in stdlib_files() if not is_heldout_file(path)]
