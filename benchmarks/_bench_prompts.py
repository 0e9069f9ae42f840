"""The fixed prompt set of benchmarks/bench.py: one user message per task, in the order the table aggregates them.

Each task favours a different strategy: code editing repeats most of its prompt (prompt lookup's home ground),
code completion is predictable for a small drafter, chat, summary and story are free text where drafts are accepted
less (the story copies nothing from its prompt).
"""

CODE_COMPLETION = '''Complete this Python function. Reply with the code only.

```python
def merge_intervals(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Merge overlapping closed intervals and return them sorted by start."""
'''

CODE_EDITING = '''Rewrite the function below so that it skips lines that start with "#". Change nothing else and reply \
with the whole function.

```python
def load_scores(path):
    """Read "name,score" lines from a file and return a dict of name -> best score."""
    best = {}
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            line = line.strip()
            if not line:
                continue
            name, score = line.split(",", 1)
            score = float(score)
            if name not in best or score > best[name]:
                best[name] = score
    return best
```
'''

CHAT = "What are three practical tips for making a small Python script easier for a colleague to read?"

SUMMARY = '''Summarize the following paragraph in two sentences.

The town's old railway station closed in 1968, when the branch line lost its last passenger service. For decades \
the building stood empty: its windows were boarded up, the platform was overgrown, and a plan to turn it into \
offices failed twice for lack of money. In 2015 a group of residents formed a cooperative, bought the station for \
a symbolic sum, and spent four years restoring it with volunteer labour and a small heritage grant. Today it holds \
a café, a bicycle repair workshop and a room that local clubs can book for free, and the old trackbed has become \
a footpath that links the town centre to the river.'''

# Free text with nothing to copy: what a drafter that cannot predict must not slow down.
STORY = "Write a short story about a lighthouse keeper who finds a message in a bottle."

PROMPTS: dict[str, str] = {
    "code_completion": CODE_COMPLETION,
    "code_editing": CODE_EDITING,
    "chat": CHAT,
    "summary": SUMMARY,
    "story": STORY,
}

# Lengths of the fixed random prompts used when no tokenizer is installed for a random model (same order).
RANDOM_PROMPT_LENGTHS: dict[str, int] = {"code_completion": 60, "code_editing": 180, "chat": 40, "summary": 150,
                                         "story": 30}


def chat_ids(tokenizer, text: str) -> list[int]:
    """`text` as one user message in the tokenizer's chat template, ready for the model to answer: its token ids
    (the template writes any special tokens itself)."""
    templated = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                              add_generation_prompt=True)
    return tokenizer(templated, add_special_tokens=False)["input_ids"]
