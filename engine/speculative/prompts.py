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

# A second held-out set in the benchmark's style (natural questions and
# requests, other subjects): recipes are compared on these, so that the
# benchmark's own prompts stay a test (`python -m bench.mtp_gap --prompts dev`).
# With the head shipped on 12-02 they read 1.48 chat / 1.94 code in the loop
# against the benchmark's 1.47 / 1.95 (same measure): a faithful stand-in.
DEV_CHAT = (
    "How does a refrigerator keep food cold?", "What should I pack for a weekend hiking trip?",
    "Why is the sky blue?", "Can you give me some tips for sleeping better?",
    "What is the difference between weather and climate?",
    "Write a short story about a robot who learns to paint.", "How do bees make honey?",
    "What are some good habits for studying effectively?", "Explain why the ocean is salty.",
    "What causes thunderstorms?", "Describe the main features of a desert ecosystem.",
    "Write an email to my manager asking for a day off next Friday.",
    "What are the pros and cons of working from home?",
    "How can I make my small apartment feel bigger?",
    "What was life like for a medieval blacksmith?", "Why do cats purr?",
    "Give me a simple recipe for vegetable soup.", "What qualities make a good friend?",
    "How do vaccines train the immune system?", "Explain how a credit card works.",
    "What are the main causes of stress at work, and how can they be reduced?",
    "Describe a busy morning at a train station.",
    "How do plants get water from their roots to their leaves?",
    "What should someone consider before adopting a dog?")
DEV_CODE = (
    "Write a Python function that checks if a number is prime.",
    "Write a Python class for a queue with enqueue and dequeue.",
    "Write a JavaScript function that reverses an array without using reverse().",
    "Write a Python function that counts the words in a text file.",
    "Write a C function that returns the length of a linked list.",
    "Write a Python function that merges two sorted lists.",
    "Write a JavaScript function that throttles another function.",
    "Write a Python function that removes punctuation from a string.",
    "Write a Python class for a bank account with deposit and withdraw methods.",
    "Write a C function that reverses a string in place.",
    "Write a Python function that returns the most common element in a list.",
    "Write a JavaScript function that deep-clones an object.")

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


# `tandem train-mtp --varied N`: clean, naturally phrased prompts of many
# shapes (questions, how-tos, emails, stories, poems, lists; code requests in
# several phrasings). The shipped head fitted its 2,000 training answers
# (draft accuracy 0.83 on templated chat it trained on) but reached 0.36 on
# the benchmark's chat answers: too few distinct prompts, and the
# self-instructed ones are often odd ("I'm glad you asked that, guest.") with
# degenerate answers. None of these names a benchmark subject (exercise,
# rainbows, autumn leaves, team leaders, flight, lighthouses; Fibonacci,
# stacks, debouncing, a file's longest line, safe string copies, grouping
# words by first letter); a test checks no benchmark prompt is among them.
VARIED_TOPICS = (
    "the water cycle", "photosynthesis", "the printing press", "electric guitars", "origami",
    "the Silk Road", "honeybee colonies", "tea ceremonies", "wind turbines", "submarines",
    "the Amazon river", "the human brain", "bread making", "compost", "the metric system",
    "the Mars rovers", "penguins", "knitting", "the ancient Greeks", "public libraries",
    "urban gardening", "the blues", "mobile phones", "recycling plastic", "the Arctic",
    "hot air balloons", "vitamins", "the Byzantine Empire", "fermentation", "street art",
    "electric bicycles", "the Beatles", "typography", "wolves", "the Great Barrier Reef",
    "minimalism", "volunteering", "the history of chocolate", "bridges", "kites",
    "desert plants", "journaling", "chess openings", "the Vikings", "artificial intelligence",
    "cryptography", "the stock exchange", "small talk", "saving money on groceries",
    "the Eiffel Tower", "octopuses", "wildfires", "yoga", "podcasts", "the Moon's phases",
    "lightning", "mapmaking", "the Olympic marathon", "board game design", "earthworms",
    "the Cold War", "opera", "rice farming", "the speed of light", "carnivorous plants",
    "the Hubble telescope", "local elections", "sign language", "the history of the bicycle",
    "home insulation", "spices", "tornadoes", "the Sahara", "3D printing", "elephants",
    "classical music", "the immune response to a cold", "skateboarding", "the Mayan calendar",
    "dolphins", "nuclear fusion", "the history of writing", "swimming pools", "tidal energy",
)

VARIED_TEMPLATES = (
    "What is {topic}, and why does it matter?",
    "Can you tell me about {topic}?",
    "Why is {topic} important?",
    "What are the advantages and disadvantages of {topic}?",
    "Describe the history of {topic}.",
    "What should a beginner know about {topic}?",
    "Write a short blog post about {topic}.",
    "Give me a few practical tips related to {topic}.",
    "Write a short poem about {topic}.",
    "Write a friendly email inviting a colleague to a talk about {topic}.",
    "Summarize the key ideas behind {topic} in one paragraph.",
    "What are three surprising facts about {topic}?",
    "How has {topic} changed over the last hundred years?",
    "Write a short story that involves {topic}.",
    "I'm writing a school report on {topic}. Where should I start?",
    "What are some common questions people ask about {topic}?",
    "Explain {topic} to someone who has never heard of it.",
    "List the main points someone should remember about {topic}.",
)

# standalone requests: how-to, why, advice, writing tasks
VARIED_REQUESTS = (
    "How do I change a flat tire on a bicycle?", "Why do we get hiccups?",
    "How can I become a better listener?", "What makes bread rise?",
    "Write a thank-you note to a neighbour who watered my plants.",
    "How do I start learning to play the piano as an adult?", "Why do onions make us cry?",
    "What is the best way to prepare for an exam in two weeks?",
    "Write a short speech for a friend's birthday party.", "How do magnets work?",
    "How do I write a good résumé?", "Why does ice float on water?",
    "What are some ways to reduce food waste at home?", "How do noise-cancelling headphones work?",
    "Write a story about a lost key that changes someone's life.", "How does a bill become a law?",
    "What are good ways to make new friends in a new city?",
    "Explain the difference between a virus and a bacterium.",
    "How do I keep a conversation going?", "Why do stars twinkle?",
    "Write a product description for a reusable water bottle.",
    "How does compound interest help savings grow?", "What should I do if my computer is slow?",
    "How do birds know where to migrate?",
    "Write a polite complaint to a hotel about a noisy room.",
    "What is the difference between a comet and an asteroid?", "How can I stop procrastinating?",
    "Describe a walk through a busy market in the morning.", "How do glasses correct eyesight?",
    "Why do we have time zones?",
    "Write a short motivational message for a team before a deadline.",
    "How do I care for a cactus?", "What happens to our bodies when we sleep?",
    "Plan a three-day trip to a city with museums and parks.",
    "How does a microwave oven heat food?", "Why are some people left-handed?",
    "Write a limerick about a forgetful wizard.",
    "What is the difference between a loan and a lease?",
    "How can a small shop attract more customers?", "Write instructions for folding a paper boat.",
    "How do earthquakes get measured?", "What are the signs of dehydration?",
    "How do I apologise to a friend I upset?", "Why is the Dead Sea so salty?",
    "Describe the life cycle of a butterfly.", "Write a short review of an imaginary restaurant.",
    "How does GPS know where I am?", "What are some healthy snacks for work?",
    "Explain what a budget is and how to make one.", "Write a letter to your future self.",
    "How do solar eclipses happen?", "Why do we dream?",
    "What is a good way to organise a messy closet?",
    "How do I give constructive feedback to a coworker?", "What did people eat in ancient Rome?",
    "Write a dialogue between a cat and a dog about breakfast.",
    "How do submarines dive and surface?", "Why do some foods taste spicy?",
    "Explain the rules of basketball briefly.")

VARIED_CODE_TASKS = (
    "checks whether the parentheses in a string are balanced",
    "converts a Roman numeral to an integer", "returns all pairs in a list that sum to a target",
    "returns the intersection of two lists", "splits a list into chunks of size n",
    "computes the dot product of two vectors", "finds the median of a list of numbers",
    "generates a random password of a given length",
    "computes the Levenshtein distance of two strings",
    "finds the missing number in a list of the numbers 1 to n",
    "turns two lists into a dictionary", "sorts a list of dictionaries by a given key",
    "implements insertion sort", "implements quicksort", "checks whether a list is sorted",
    "returns the k-th largest element of a list", "validates an IPv4 address",
    "converts a hex colour like #ff8800 to an RGB tuple", "counts the set bits of an integer",
    "computes compound interest over n years", "converts minutes into hours and minutes",
    "finds the first non-repeating character in a string",
    "checks whether a string contains only digits", "computes the running average of a list",
    "returns the n-th row of Pascal's triangle", "removes all whitespace from a string",
    "finds the most frequent word in a sentence", "converts a list of strings to upper case",
    "computes the area of a triangle from its three sides",
    "checks whether two rectangles overlap")

VARIED_CLASSES = (
    "a 2D point with a method for the distance to another point",
    "a to-do list with add, remove and list methods",
    "a rectangle with area and perimeter methods", "a simple linked list with append and find",
    "a min-heap with push and pop", "a counter that can be incremented, decremented and reset",
    "a library book that can be checked out and returned",
    "a temperature that converts between Celsius and Kelvin")

VARIED_LANGUAGES = ("Python", "Python", "JavaScript", "C", "Java", "Go", "Rust", "C++",
                    "TypeScript")

VARIED_CODE_TEMPLATES = (
    "Write a {language} function that {task}.",
    "How do I write a {language} function that {task}?",
    "Can you show me {language} code that {task}?",
    "Implement a {language} function that {task}, with a short example of its use.",
    "I need a {language} function that {task}. Can you help?",
)

VARIED_CLASS_TEMPLATES = (
    "Write a {language} class for {thing}.",
    "Show me how to implement {thing} as a class in {language}.",
)


def varied_prompts(count: int, seed: int = 0) -> list[str]:
    """`count` distinct prompts drawn (seeded) from every topic x template,
    the standalone requests, and the code tasks x languages x phrasings;
    about 60% chat, 40% code, interleaved. Never a benchmark or dev prompt."""
    import random

    rng = random.Random(seed)
    chat = [t.format(topic=topic) for topic in VARIED_TOPICS for t in VARIED_TEMPLATES]
    rng.shuffle(chat)
    chat = list(VARIED_REQUESTS) + chat  # the hand-written ones first
    code = [t.format(language=lang, task=task) for task in VARIED_CODE_TASKS
            for lang in dict.fromkeys(VARIED_LANGUAGES) for t in VARIED_CODE_TEMPLATES]
    code += [t.format(language=lang, thing=thing) for thing in VARIED_CLASSES
             for lang in ("Python", "JavaScript", "Java", "C++") for t in VARIED_CLASS_TEMPLATES]
    rng.shuffle(code)
    held_out = {*HELD_OUT_CHAT, *HELD_OUT_CODE, *DEV_CHAT, *DEV_CODE}
    mixed: list[str] = []
    for i in range(max(len(chat), len(code))):
        mixed += chat[i:i + 1] + (code[i * 4 // 5:i * 4 // 5 + 1] if i % 5 != 4 else [])
    out = [p for p in dict.fromkeys(mixed) if p not in held_out]
    return out[:count]
