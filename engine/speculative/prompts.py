"""The prompts `tandem train-mtp` asks the base model to answer.

Built as topics x task templates so the corpus covers many subjects and
answer shapes (explanations, lists, essays, code in several languages)
without shipping a dataset. bench/speculative.py measures acceptance on its
own prompts, which are kept out of this set (tests/test_speculative.py
checks that no benchmark prompt is a training prompt).
"""
from __future__ import annotations

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
