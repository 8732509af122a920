"""The prompts `tandem train-mtp` asks the base model to answer.

Built as topics x task templates so the corpus covers many subjects and
answer shapes (explanations, lists, essays, code in several languages)
without shipping a dataset. bench/speculative.py measures acceptance on its
own prompts (HELD_OUT_CHAT, HELD_OUT_CODE), which are kept out of this set
(tests/test_train_mtp.py checks that no benchmark prompt is a training prompt).

Fixed templates teach the head their phrasing: the head trained on them
reached 2.04 tokens per step on held-out templated prompts but 1.36 / 1.80
on the benchmark's differently phrased ones (BENCHMARKS.md, MTP head v2).
`question_requests` asks the model itself for questions (self-instruct,
`tandem train-mtp --self-instruct N`); `extract_question` keeps the usable
ones.
"""
from __future__ import annotations

# bench/speculative.py measures acceptance on these: never trained on
HELD_OUT_CHAT = (
    "What are the benefits of regular exercise?", "Explain how a rainbow forms.",
    "Why do leaves change colour in autumn?", "What makes a good team leader?",
    "How do airplanes stay in the air?", "Describe a day in the life of a lighthouse keeper.")
HELD_OUT_CODE = (
    "Write a Python function that returns the n-th Fibonacci number.",
    "Write a Python class for a stack with push and pop.",
    "Write a JavaScript function that debounces another function.",
    "Write a Python function that returns the longest line of a text file.",
    "Write a C function that copies a string into a fixed-size buffer safely.",
    "Write a Python function that groups words by their first letter.")

CHAT_TOPICS = (
    "the French Revolution", "black holes", "vaccines", "the stock market", "inflation",
    "renewable energy", "the Roman Empire", "volcanoes", "sleep", "meditation", "coral reefs",
    "the internet", "democracy", "electric cars", "the human heart", "chess", "jazz music",
    "the moon landing", "bees", "compound interest", "the printing press", "earthquakes",
    "antibiotics", "the Great Wall of China", "solar panels", "the immune system", "coffee",
    "social media", "the Renaissance", "glaciers", "public speaking", "time management",
    "gardening", "the Olympic Games", "rainforests", "nuclear power", "the periodic table",
    "dinosaurs", "the Industrial Revolution", "ocean tides", "learning a new language",
    "budgeting", "marathon training", "the pyramids of Egypt", "cloud computing",
    "photography", "recycling", "the solar system", "friendship", "healthy eating",
)

CHAT_TEMPLATES = (
    "Explain {topic} in simple terms.",
    "What are the most important facts about {topic}?",
    "Write a short essay about {topic}.",
    "Give me five interesting things about {topic}.",
    "How would you explain {topic} to a ten-year-old?",
    "What are common misconceptions about {topic}?",
)

CODE_TASKS = (
    "checks whether a string is a palindrome", "returns the largest element of a list",
    "counts the vowels in a string", "computes the greatest common divisor of two numbers",
    "sorts a list with bubble sort", "converts Celsius to Fahrenheit",
    "removes duplicates from a list", "checks whether a year is a leap year",
    "finds the second smallest number in a list", "reverses the words in a sentence",
    "computes the sum of the digits of a number", "implements binary search",
    "flattens a nested list", "counts how often each character appears in a string",
    "returns the first n prime numbers", "checks whether two strings are anagrams",
    "computes the average of a list of numbers", "capitalizes the first letter of every word",
    "finds the longest word in a sentence", "converts a decimal number to binary",
    "merges two dictionaries", "rotates a list by k positions", "computes n factorial iteratively",
    "validates a password with at least eight characters and one digit",
    "transposes a matrix", "checks whether a number is a perfect square",
)

CODE_LANGUAGES = ("Python", "JavaScript", "C", "Rust", "Go", "Java")

CODE_TEMPLATES = (
    "Write a {language} function that {task}.",
    "Write a {language} function that {task}, and explain how it works.",
)


def training_prompts() -> list[str]:
    """Every (topic, template) and (task, language, template) prompt, in a fixed order."""
    chat = [t.format(topic=topic) for topic in CHAT_TOPICS for t in CHAT_TEMPLATES]
    code = [t.format(language=lang, task=task) for task in CODE_TASKS
            for lang in CODE_LANGUAGES for t in CODE_TEMPLATES]
    # interleaved so a truncated corpus (a short time budget) still mixes both
    mixed = []
    for i in range(max(len(chat), len(code))):
        mixed += chat[i:i + 1] + code[i:i + 1]
    return mixed


# Subjects beyond CHAT_TOPICS for the model's own questions: everyday life,
# work, science and making things, so phrasing and subject both vary.
MORE_TOPICS = (
    "cooking pasta", "job interviews", "houseplants", "running shoes", "weather forecasts",
    "writing a cover letter", "saving for retirement", "dogs", "cats", "bicycles",
    "moving to a new city", "baking bread", "climate change", "the water cycle",
    "starting a small business", "email etiquette", "video games", "board games",
    "first aid", "camping", "air travel", "learning to swim", "painting", "poetry",
    "the history of money", "spreadsheets", "databases", "computer networks",
    "operating systems", "machine learning", "statistics", "probability", "geometry",
    "electricity", "magnets", "light and colour", "sound", "bridges", "skyscrapers",
    "trains", "the ocean floor", "deserts", "mountains", "birds", "mushrooms",
)

QUESTION_REQUESTS = (
    "Write one question that a curious person might ask about {topic}. "
    "Reply with the question only.",
    "Write one request that someone might send to a helpful assistant about {topic}. "
    "Reply with the request only.",
)

CODE_REQUESTS = (
    "Write one short programming task for {language}, as a user would ask for it. "
    "Reply with the task only.",
    "Write one request for a small {language} program that a student might ask a tutor for. "
    "Reply with the request only.",
)

_LEADS = ("question:", "request:", "task:", "q:", "user:")


def question_requests() -> list[str]:
    """What the model is asked, to write training questions of its own."""
    chat = [t.format(topic=topic) for topic in CHAT_TOPICS + MORE_TOPICS
            for t in QUESTION_REQUESTS]
    code = [t.format(language=lang) for lang in CODE_LANGUAGES for t in CODE_REQUESTS]
    code = code * -(-len(chat) // (3 * len(code)))  # about a quarter code
    mixed = []
    for i in range(max(len(chat), len(code))):
        mixed += chat[i:i + 1] + (code[i:i + 1] if i % 3 == 0 else [])
    return mixed


def extract_question(text: str) -> str | None:
    """The question in a model's reply: its first line with content (not a
    preamble ending in ':'), without quotes, numbering or a 'Question:'
    lead, if it reads like a question or request (12 to 240 characters,
    ending in '?', '.' or '!'); else None."""
    for line in text.splitlines():
        line = line.strip().strip('"*').strip()
        if not line or line.endswith(":"):  # blank, or a preamble ("Here is one:")
            continue
        line = line.lstrip("0123456789.)-# ").strip()
        for lead in _LEADS:
            if line.lower().startswith(lead):
                line = line[len(lead):].strip()
        line = line.strip('"*').strip()  # "**Request:** ..." leaves "** ..."
        if 12 <= len(line) <= 240 and line[-1] in "?.!":
            return line
        return None
    return None
