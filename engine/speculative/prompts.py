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

# A third held-out set, written on 12-05 before any head was measured on it,
# because six prompts a side read one answer as ~0.06 of the mean: the
# benchmark's figure of record is the mean over HELD_OUT_* and TEST_* together
# (36 chat, 24 code; docs/MTP_HEAD.md, "How acceptance is measured"). Each is
# absent from the training prompts and shares at most 0.44 of its content words
# with any of them (the benchmark's and dev sets' own figure: at most 0.60);
# tests/test_train_mtp.py checks the first.
TEST_CHAT = (
    "How does a hot air balloon rise?",
    "What are some ways to save money on groceries?",
    "How do stage magicians make a coin disappear?",
    "What should I think about before changing careers at forty?",
    "Describe a quiet evening in a small fishing village.",
    "How does a vending machine know which coin was inserted?",
    "How do I keep my houseplants healthy?",
    "Write a note inviting my neighbours to a garden party.",
    "Why do some old houses creak at night?",
    "How does a ship's anchor hold it in place?",
    "What are the benefits of learning to play a musical instrument?",
    "What makes a museum visit enjoyable for children?",
    "How does a paper mill turn wood into paper?",
    "What should I bring to a friend's housewarming party?",
    "Describe a bakery in the hour before it opens.",
    "What are some fun things to do on a rainy day?",
    "How do fireflies glow?",
    "How does a florist keep cut flowers fresh?",
    "Give me tips for running my first 5K race.",
    "How does a camera capture a photograph?",
    "How do glow-in-the-dark stickers work?",
    "Write a short poem about a kettle that sings in the morning.",
    "How can I stay focused when working in a noisy place?",
    "What happens inside a volcano before it erupts?",
    "How does a lock and key work?",
    "What are the main differences between cats and dogs as pets?",
    "How do hermit crabs choose a new shell?",
    "How can I keep my kitchen organised?",
    "Why do we yawn?",
    "Explain how a library lends e-books.")
TEST_CODE = (
    "Write a Python function that checks whether a string is a valid email address.",
    "Write a JavaScript function that formats a number with commas as thousands separators.",
    "Write a Python function that checks whether all values in a dictionary are unique.",
    "Write a Python class for a parking lot that tracks its free spaces.",
    "Write a C function that swaps two integers using pointers.",
    "Write a Python function that reads a CSV file and returns the sum of one column.",
    "Write a JavaScript function that shuffles an array randomly.",
    "Write a Python function that turns a list of (name, score) pairs into a ranked leaderboard.",
    "Write a Python class for a thermostat that keeps a target temperature.",
    "Write a C function that counts the lines in a file.",
    "Write a Python function that pads every line of a text to the same width.",
    "Write a JavaScript function that converts a number of seconds into a mm:ss string.",
    "Write a Python function that finds all files with a given extension in a folder.",
    "Write a Python function that shortens a string to a maximum length and adds an ellipsis.",
    "Write a Python class for a simple timer with start and stop methods.",
    "Write a JavaScript function that checks whether two objects have the same keys.",
    "Write a C function that converts a string of digits to an integer.",
    "Write a Python function that returns the initials of a full name.")

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

# The MTP head trained on templated "{topic}" prompts drafted 0.66 of held-out templated answers
# right but only 0.38 of the dev set's natural chat answers: these hand-written requests give the
# training corpus the phrasing and answer shapes of real chat (no benchmark or dev subject).
NATURAL_CHAT = (
    "How does a touchscreen tell where my finger is?", "How does a zipper actually work?",
    "How do hearing aids help people hear better?", "How does a dishwasher get the dishes clean?",
    "How does Wi-Fi send information through the air?",
    "How do the gears on a bicycle make pedalling easier?",
    "How does a pressure cooker cook food so much faster?",
    "How does a smoke detector sense smoke?", "How does a compass always point north?",
    "How does an electric kettle know when to switch itself off?",
    "How does a washing machine get clothes almost dry by spinning?",
    "How does a stock market index like the S&P 500 work?",
    "How does an induction hob heat a pan without getting hot itself?",
    "How does a pacemaker keep a heart beating regularly?", "How does a dam produce electricity?",
    "How does a fire extinguisher put out a fire?",
    "How does a metal detector find things buried in the sand?",
    "How does the flush on a toilet work?", "How does a sundial tell the time?",
    "How does a quartz watch keep such accurate time?",
    "How does a search engine decide which results to show first?",
    "How does a wireless charger charge a phone without a cable?",
    "How does a spacesuit keep an astronaut alive?",
    "How are votes counted in a national election?",
    "How does a fuse protect an electrical circuit?", "How can a huge ship made of steel float?",
    "How does a letter get across the country in a day or two?",
    "How does a breathalyser measure alcohol?",
    "How does a water treatment plant make tap water safe to drink?",
    "Why do our fingers wrinkle after a long bath?",
    "Why does freshly cut grass smell the way it does?",
    "Why do some people get carsick on every journey while others can read in the back seat "
    "without trouble?",
    "Why do my ears pop when I drive up a mountain road?", "Why do humans have fingerprints?",
    "Why does the Moon look bigger when it is near the horizon?",
    "Why do apples turn brown after they are cut?", "Why do we blush when we are embarrassed?",
    "Why do we get brain freeze from eating ice cream too fast?",
    "Why does hair turn grey as we get older?", "Why does some music give people chills?",
    "Why does a hard-boiled egg yolk sometimes turn green around the edge?",
    "Why is gold so valuable?", "Why do prices usually go up over time?",
    "Why do we feel dizzy after spinning around?",
    "Why are flamingos pink, and are they born that way?",
    "Why does soap get rid of grease when water alone doesn't?",
    "Why do some buildings skip the thirteenth floor?",
    "Why do knuckles make a popping sound when you crack them?",
    "Why are tomatoes called a fruit when we eat them like vegetables?",
    "Why do people's eyes look red in some flash photos?",
    "Why do some coins have ridges on their edges?",
    "Why does a word start to sound strange if you repeat it many times?",
    "Why is a year 365 days long, and why do we need leap years?",
    "Why do we always see the same side of the Moon?",
    "Why does my phone battery drain faster when it is cold outside?",
    "Why do different countries use different electrical plugs?",
    "Why do older people often say that time passes faster?",
    "Why do some songs get stuck in your head?",
    "What is the difference between a psychologist and a psychiatrist?",
    "What's the difference between a latte and a cappuccino?",
    "What is the difference between a city and a town?",
    "What is the difference between a violin and a viola?",
    "What is the difference between an introvert and an extrovert?",
    "What is the difference between a republic and a monarchy?",
    "What is the difference between a laser printer and an inkjet printer?",
    "What is the difference between a solicitor and a barrister?",
    "What is the difference between a planet and a dwarf planet?",
    "What's the difference between a seal and a sea lion?",
    "What is the difference between a savings account and a current account?",
    "What is the difference between a moth and a butterfly?",
    "What is the difference between jam, jelly and marmalade?",
    "What is the difference between an LED bulb and an old incandescent bulb?",
    "What is the difference between a tsunami and an ordinary wave?",
    "What's the difference between speed and velocity?",
    "What is the difference between a lawyer and a notary?",
    "What is the difference between a haiku and a sonnet?",
    "What is the difference between opera and musical theatre?",
    "What is the difference between a rabbit and a hare?",
    "What is the difference between a museum and a gallery?",
    "What's the difference between a cafe and a coffee shop, if any?",
    "What is the difference between a mammal and a reptile?",
    "What is the difference between a lake and a pond?",
    "What should I do if I lock myself out of my house?",
    "What should I bring with me to a job interview?",
    "How can I get better at remembering people's names?",
    "How can I cut down on the time I spend on my phone?",
    "Can you give me some tips for negotiating a higher salary?",
    "Our heating bill doubled last winter. "
    "What are some cheap ways to keep the house warm this year?",
    "How do I get rid of fruit flies in my kitchen?", "How can I teach my child to ride a bike?",
    "How do I politely turn down an invitation?", "What should I do if a pan of oil catches fire?",
    "Can you give me some tips for writing a wedding speech?", "How can I learn to draw faces?",
    "What can I grow in a garden that gets very little sun?",
    "How do I unblock a kitchen sink without using harsh chemicals?",
    "How can I keep my car in good condition?", "How do I pick a ripe watermelon at the shop?",
    "How can I make my phone battery last longer?", "How can I spot a phishing email?",
    "How do I come up with a strong password that I can still remember?",
    "How can I stop my glasses from fogging up when I wear a mask?",
    "How do I iron a shirt properly?",
    "How should I deal with a neighbour who plays loud music late at night?",
    "What should I say to someone who has just lost a parent?",
    "How can I help my teenager use their phone less?",
    "Can you give me some tips for a first date?",
    "My three-year-old refuses to eat anything green. How can I get him to try more vegetables?",
    "What should I know before getting a tattoo?", "How do I write a eulogy for my grandmother?",
    "How can I use less plastic in my kitchen?", "How do I jump-start a car with a flat battery?",
    "How do I read the nutrition label on food packaging?",
    "How do I paint a room without making a mess?",
    "Can you give me some tips for learning to juggle?", "How do I remove a splinter safely?",
    "How do I get rid of a bad smell in my car?", "How do I clean a burnt saucepan?",
    "How do I tell a friend that they owe me money without making it awkward?",
    "How do I organise my photos so I can find them again?",
    "How do I hang a heavy picture on a plaster wall?",
    "My kitchen drawers are a mess. How should I organise them?",
    "I want to read more books this year. How can I actually make it happen?",
    "How can I remember what I read?", "Write a short story about the last bookshop in a big city.",
    "Write a short story that takes place on a night bus.",
    "Write a short story about a baker who can taste people's memories.",
    "Write a children's story about a shy little dragon.",
    "Write a short mystery that takes place at a village fair.",
    "Write a story about a ghost who is afraid of people.",
    "Write a short science fiction story about the first town on Mars.",
    "Write a fable about a fox and a crow who share a secret.",
    "Write a short story about a town where it never stops snowing.",
    "Write a funny story about a wedding cake that goes missing.",
    "Write a story about a grandmother who teaches her grandson to fish.",
    "Write a short story in which a postman delivers a letter sixty years late.",
    "Write a fairy tale in which the princess rescues the kingdom.",
    "Write a short story about an astronaut coming home after a year in space.",
    "Write a story about a violin that can only play happy songs.",
    "Write an email to my landlord asking when the broken heater will be fixed.",
    "Write an email introducing myself to my new colleagues.",
    "Write an email to a client following up on an unpaid invoice.",
    "Write an email cancelling a magazine subscription.",
    "Write a cover letter for a job at a bookshop.",
    "Write a letter to a pen pal in another country describing my town.",
    "Write a warm letter to my grandmother telling her about my new job as a nurse and the "
    "city I moved to.",
    "Write a letter to the local council asking for a new pedestrian crossing.",
    "Write a short, polite resignation letter.",
    "Write an email inviting my neighbours to a street party.",
    "Write an email to a school asking about their admissions process.",
    "Write an email to a supplier asking for a discount on a large order.",
    "Write a letter to a local newspaper about the lack of bike lanes.",
    "Write a letter to my younger self about the mistakes I made at twenty.",
    "Write a formal letter disputing a parking fine.",
    "Write a poem about the first snow of winter.", "Write a poem about an old kitchen table.",
    "Write a haiku about morning coffee.", "Write a poem about a city at midnight.",
    "Write a short poem for my mother's sixtieth birthday.",
    "Write a limerick about a cook who burns everything.",
    "Write a poem about the sea from the point of view of a pebble.",
    "Write a short poem about a grandfather's old coat.",
    "My grandmother is turning ninety next month. "
    "Can you write a short poem I could read at her party?",
    "Write a rhyming poem for children about brushing their teeth.",
    "Write a poem about a bicycle ride on a summer evening.",
    "Write a short speech to welcome guests to a charity dinner.",
    "Write a graduation speech about learning from failure.",
    "Write a short retirement speech for a colleague who worked here for thirty years.",
    "Write a toast for my parents' thirtieth wedding anniversary.",
    "Write a short speech for the opening of a new community library.",
    "Write a speech for a school assembly about kindness.",
    "Write a short speech to open a local football club's end-of-season dinner.",
    "Write a product description for a handmade wool scarf that I'm selling online, in a warm, "
    "friendly tone.",
    "Write a product description for a cordless vacuum cleaner.",
    "Write a product description for a scented candle called Rainy Library.",
    "Write a product description for a children's wooden train set.",
    "Write a product description for a lightweight travel umbrella.",
    "Write a product description for a bamboo cutting board.",
    "Write a poster for a lost parrot named Kiwi.",
    "Write a social media post announcing the opening of a new bakery.",
    "Write a short advert for a second-hand bicycle I want to sell.",
    "Write a short description of a holiday cottage by a lake for a rental website.",
    "Write a dialogue between a shopkeeper and a customer who wants a refund.",
    "Write a dialogue between a grandfather and his grandson about their first phones.",
    "Write a dialogue between two astronauts arguing about what to eat for dinner.",
    "Write a dialogue between a detective and a nervous witness.",
    "Write a dialogue in which two neighbours argue about a tree on the fence line.",
    "Write a dialogue between a tourist who is lost and a helpful local.",
    "Write a dialogue between a teacher and a parent at a school evening.",
    "Write a conversation between the Sun and the Moon.",
    "Write a review of a heist film in which everything goes wrong.",
    "Write a review of a pair of wireless earbuds.", "Write a review of a local farmers' market.",
    "Write a book review of a novel about time travel.",
    "Write a review of a museum exhibition about ancient Egypt.",
    "Write a short review of a hotel with a beautiful view but a terrible breakfast.",
    "Write a wedding invitation for a small ceremony in a garden.",
    "Write a sympathy card message for a coworker whose father has died.",
    "Write an apology note to my neighbour for the noise from last night's party.",
    "Write a short introduction for a community garden's newsletter.",
    "Write a riddle whose answer is a shadow.",
    "Write a diary entry of a Roman soldier stationed in Britain.",
    "Write a short monologue for a villain who thinks he is the hero.",
    "Write a welcome message for new members of a photography club.",
    "Write a text message to reschedule dinner with a friend.",
    "Write a short tourist guide to an imaginary island.",
    "Write a short, fun quiz about the planets for a school class.",
    "Write a recipe card for my family's favourite pancakes, with a short story behind it.",
    "Describe a quiet beach just after sunrise.", "Describe a night market full of food stalls.",
    "Describe a kitchen on the morning of a big family holiday.",
    "Describe a snowy mountain village at Christmas.",
    "Describe a football stadium just before the match begins.",
    "Describe the scene backstage just before a school play starts.",
    "Describe the view of a city at night from the top of a skyscraper.",
    "Describe a jazz club in New York in the 1920s.",
    "Describe the first warm day of spring in a city park.",
    "Describe a concert hall while the orchestra is tuning up.",
    "Describe a rainforest waking up at dawn.", "Describe a wooden cabin on a snowy evening.",
    "Describe a street festival on a hot summer day.",
    "Describe a wedding in a small village in the countryside.",
    "Describe a family farm at harvest time, with the sounds, the smells and everyone hard at "
    "work.",
    "Describe what a city street sounds like at three in the morning.",
    "Describe a child's bedroom the day before the family moves house.",
    "Describe a cafe on a cold, foggy morning.", "What was life like for a Roman gladiator?",
    "What was life like for a pioneer family on the American frontier?",
    "What was life like for ordinary farmers in ancient Egypt?",
    "What was life like for women in ancient Athens?", "What did people wear in ancient Egypt?",
    "What did people use before toilet paper was invented?",
    "What did families eat during the Great Depression?",
    "What did people use as money before coins existed?",
    "What toys did children play with in medieval Japan?",
    "How did people tell the time before clocks were common?",
    "How did the ancient Romans heat their houses and baths?",
    "Why did the Western Roman Empire fall?",
    "Who were the Phoenicians, and what were they known for?", "What was the Harlem Renaissance?",
    "How did the telephone change everyday life?",
    "Why is the Magna Carta considered so important?",
    "What happened during the California Gold Rush?",
    "Who was Cleopatra, and why is she still famous?",
    "What was the Ottoman Empire, and how long did it last?",
    "How did the Aztecs build a city in the middle of a lake?",
    "What was the Berlin Wall, and why did it come down?",
    "What was life like for a cowboy in the American West?",
    "What was daily life like in a Viking village?",
    "How did the Incas keep records without a written language?",
    "What was it like to live in London during the Blitz?",
    "What was life like for a servant in a grand country house a century ago?",
    "What was life like for a coal miner in the nineteenth century?",
    "How did ancient people make dyes for their clothes?",
    "What are the pros and cons of buying a used electric car?",
    "What are the pros and cons of homeschooling?",
    "What are the pros and cons of living in a big city?",
    "What are the pros and cons of going to university straight after school?",
    "What are the pros and cons of open-plan offices?",
    "What are the pros and cons of school uniforms?",
    "What are the pros and cons of taking a gap year?",
    "What are the pros and cons of doing most of your shopping online?",
    "I'm thinking about going vegetarian. "
    "What are the pros and cons, and what should I watch out for?",
    "What are the pros and cons of retiring early?",
    "What are the pros and cons of having a smart speaker at home?",
    "What are the upsides and downsides of being your own boss?",
    "Is it worth learning to drive if I live in a city with good buses?",
    "What are the pros and cons of a cruise holiday?",
    "What are the pros and cons of buying a new phone every two years?",
    "What are the pros and cons of wearing a smartwatch all day?",
    "What are the pros and cons of moving back in with my parents to save money?",
    "What are the pros and cons of a gas hob compared with an electric one?",
    "Give me a simple recipe for banana bread.",
    "I get home from work at seven and I'm always hungry. "
    "What is an easy pasta dish I can make quickly?",
    "How do I make a basic tomato sauce for pasta?",
    "Give me a recipe for chewy chocolate chip cookies.",
    "What is a quick recipe for egg fried rice?",
    "What's an easy vegetarian curry I can make in thirty minutes?",
    "How do I make a basic salad dressing?", "Give me a recipe for a simple apple crumble.",
    "How do I make French toast that is crispy outside and soft inside?",
    "Give me a simple recipe for homemade lemonade.", "How do I make a classic French omelette?",
    "How do I make roast potatoes really crispy?",
    "How do I make a quick chicken and noodle stir-fry?", "Give me a recipe for homemade granola.",
    "How do I bake a simple sponge cake?", "How do I make a cheese sauce without lumps?",
    "How do I make masala chai from scratch?", "Give me a simple recipe for shortbread.",
    "Give me a simple recipe for fish tacos.", "How do I make a simple risotto?",
    "How do I cook a steak in a frying pan?", "Give me an easy recipe for homemade burgers.",
    "How do I make a classic Greek salad?", "Give me a recipe for baked salmon with lemon.",
    "Why does a spoon look bent when it stands in a glass of water?",
    "How do fireflies make light?", "Why doesn't a moving bicycle fall over?",
    "How do chameleons change colour?", "Why does a fizzy drink go flat after it is opened?",
    "Why does a mirror flip left and right but not up and down?",
    "Why can we see our breath on cold days?", "How do fish breathe underwater?",
    "Is it true that hot water can freeze faster than cold water?",
    "Why does blowing on hot tea cool it down?", "Why does iron rust, and how can it be stopped?",
    "How do caves form underground?", "How do bats find their way in the dark?",
    "Why does a match light when you strike it?",
    "Why does the air smell different after it rains?", "How do spiders make their silk?",
    "Why does food turn brown when you fry it?", "What is at the centre of the Earth?",
    "Why do car tyres have grooves?", "Why is glass see-through when sand is not?",
    "Why does water boil at a lower temperature high up a mountain?",
    "Why do a heavy ball and a light ball fall at the same speed?",
    "Why does a metal spoon get hot in a cup of tea but a wooden one doesn't?",
    "How does sunscreen protect your skin?", "Why does a kettle get noisy just before it boils?",
    "Why does stirring sugar into tea make it dissolve faster?",
    "How do candles burn, and where does the wax go?",
    "How much water should an adult drink in a day?", "What does a balanced breakfast look like?",
    "How can I protect my eyes when I use screens all day?",
    "How can I tell if a cut needs stitches?", "Why is fibre important in our diet?",
    "What causes bad breath, and how can I get rid of it?", "What causes most everyday headaches?",
    "How often should I get my eyes tested?",
    "What is blood pressure, and what do the two numbers mean?",
    "What are the symptoms of low iron?", "How can I stop biting my nails?",
    "What should I do if someone near me is choking?", "How can I protect my skin from sun damage?",
    "What does cholesterol actually do in the body?", "What does the liver do?",
    "How can I make vegetables taste better to a picky child?",
    "What are the benefits of eating fish once or twice a week?", "Is it bad to skip breakfast?",
    "How can I tell if a mole on my skin should be checked by a doctor?",
    "How do I start saving for a deposit on a house?",
    "What is an emergency fund, and how big should it be?",
    "What is an index fund, explained simply?", "How does income tax on a salary work?",
    "What should I think about before lending money to family?",
    "How do I ask a shop for a refund on a faulty product?",
    "My kids are seven and nine. How can I teach them about saving and spending money?",
    "How can I avoid impulse buying?", "How can I tell if an investment offer is a scam?",
    "What is insurance, and how does it work?", "What happens to my savings if my bank goes bust?",
    "What is a recession, and how does it affect ordinary people?",
    "Can you explain the 50/30/20 rule for budgeting?",
    "How can a freelancer plan for an income that changes from month to month?",
    "I just got my first paycheque. How should I split it between saving and spending?",
    "How do I figure out whether I can afford a car?",
    "What is the difference between saving and investing?",
    "How does a bank decide how much it will lend me for a house?",
    "What should I do with an unexpected bonus from work?",
    "What questions should I ask at the end of a job interview?",
    "How do I answer 'What is your biggest weakness?' in an interview?",
    "How can I stop checking my email every five minutes?",
    "I start a new job as an office administrator on Monday. "
    "What should I focus on in my first week?",
    "How can I get better at writing reports?", "What are some good questions to ask a mentor?",
    "How can I network at events without feeling awkward?",
    "What jobs are good for people who love being outdoors?",
    "I took two years off work to care for my mother. How do I explain the gap in my CV?",
    "Write a thank-you email to send after a job interview.",
    "How can I make a good first impression at a new job?",
    "How do I tell a friend that their business idea has problems?",
    "What is it like to work as a nurse?", "How can I turn a hobby into a small business?",
    "How do I take useful notes in meetings?", "What should I do if I think I'm being underpaid?",
    "What are transferable skills, and how do I find mine?",
    "How do I prepare for a phone interview?",
    "How do I make small talk with colleagues I barely know?",
    "What is the cheapest way to travel around Norway?",
    "What are some tips for travelling alone for the first time?",
    "What should I see in Lisbon if I only have two days?",
    "Can you suggest an itinerary for a week in Scotland?",
    "How can I stay safe while travelling abroad?",
    "What customs should I know about before visiting Morocco?",
    "How much should I tip in restaurants in the United States?",
    "Plan a relaxing weekend in the countryside for two people.",
    "What are the best things to do in Paris with children?",
    "Describe a road trip along the coast of California.",
    "What should I do if I lose my passport abroad?",
    "When is the best time of year to visit Iceland?",
    "What foods should I try on a trip to Mexico City?", "Plan a one-day food tour of Bangkok.",
    "Why do people get homesick, and how can they cope?",
    "What should I know about renting a car on holiday?",
    "What is a good first trip abroad for someone who has never left their country?",
    "How do I keep a good travel journal?", "What should I see on a first visit to New York?",
    "What should I know before visiting India for the first time?",
    "How do I learn to play the ukulele?", "What is a good first sewing project for a beginner?",
    "How do I start a stamp collection?",
    "What are some good board games for a family of four, with kids aged eight and twelve?",
    "How do I learn to solve a Rubik's cube?", "What is the best way to learn calligraphy?",
    "How do I get started with pottery at home?",
    "What are some good indoor hobbies for the winter months?",
    "How do I get better at cryptic crosswords?", "How do I learn to dance salsa?",
    "What is geocaching, and how do I start?", "What kind of telescope should a beginner buy?",
    "How do I restore an old wooden chair?", "How do I start collecting vinyl records?",
    "How do I make candles at home?", "How do I learn to whistle with my fingers?",
    "How do I learn to play the guitar by ear?",
    "What is a good first jigsaw puzzle for an adult beginner?", "How do I start learning to sing?",
    "How do I set up a Wi-Fi network at home?", "How does face unlock on a phone work?",
    "How do batteries in electric cars work?", "How does a QR code store information?",
    "How does streaming a film over the internet work?",
    "How does my phone know which way up it is?", "What is a blockchain, explained simply?",
    "How do voice assistants understand what I say?",
    "How do online maps know where the traffic jams are?",
    "What should I look for when buying a new laptop?", "How can I tell if a news article is fake?",
    "How does a computer store everything as ones and zeros?",
    "What is an eSIM, and how is it different from a normal SIM card?",
    "What happens to old phones when they are recycled?",
    "How does a smartwatch measure my heart rate?", "How do I keep my children safe online?",
    "What is a smart meter, and what does it measure?", "How do electric scooters work?",
    "How do I get rid of pop-up adverts on my browser?",
    "How do whales communicate with each other?", "Why do salmon swim upstream?",
    "How do snails make their shells?", "How do ants find their way back to their nest?",
    "What happens to a forest after a wildfire?", "How do mushrooms spread from place to place?",
    "Why do birds sing so much in the early morning?", "How can some frogs survive being frozen?",
    "What is a food chain?", "Why are wetlands so important for wildlife?",
    "How do sharks find their prey?", "Why are big predators like tigers so rare?",
    "How does a river delta form?", "How do mountains form over time?",
    "How do crows solve puzzles?", "How do chimpanzees use tools?",
    "Why do jellyfish sting, and how does it work?", "How do snakes move without legs?",
    "Why do woodpeckers not get headaches?", "How do owls hunt in the dark?",
    "Why do people throw rice or confetti at weddings?",
    "What is Diwali, and how is it celebrated?", "Why is tea such a big part of British culture?",
    "Why is Shakespeare still so popular today, more than four hundred years after his plays "
    "were written?",
    "Where does the tradition of the Christmas tree come from?",
    "Why are cherry blossoms so important in Japan?",
    "Who was Frida Kahlo, and why is her art famous?", "What are the main ideas of Buddhism?",
    "What is flamenco, and where does it come from?", "How did hip-hop begin in New York?",
    "Why is the Mona Lisa so famous?", "What is Ramadan, and how do people observe it?",
    "What are some of the most famous Greek myths?", "What is the plot of the Odyssey?",
    "Where did the English language come from?", "What was the first novel ever written?",
    "What is the story behind Hanukkah?", "What is the story of the Trojan horse?",
    "What is the history of the sandwich?",
    "Where do our names for the days of the week come from?",
    "Why is the kilt part of Scottish culture?",
    "My neighbour's tree drops branches into my garden every winter. "
    "What is the friendliest way to bring it up with them?",
    "I'm hosting my first Thanksgiving dinner for ten people. "
    "Can you help me plan the menu and a rough cooking schedule?",
    "My ten-year-old wants a phone because all her classmates have one. "
    "What should I think about before saying yes?",
    "I have an old bike in the shed that hasn't been used for years. "
    "What should I check before riding it again?",
    "I'm giving a short talk at my cousin's wedding and I get nervous speaking in front of "
    "people. How can I prepare?",
    "We are driving from London to Edinburgh with two kids next month. "
    "Where are some good places to stop along the way?",
    "Can you explain in simple words what happens to the money I pay into a pension over forty "
    "years?",
    "I want a short story for my niece in which her toy rabbit goes on a big adventure. "
    "Can you write it?",
    "My grandfather was a sailor in the 1950s. "
    "What would daily life on a cargo ship have been like for him?",
    "I just moved into a house with a big garden and have no experience. "
    "What are the first things I should do?",
    "I know the rules of chess but lose every game against my brother. How can I get better?",
    "My wardrobe is full of clothes I have worn once or never. "
    "How can I stop buying things I don't need?",
    "I'm renting a car in France this summer. "
    "What should I know before driving there for the first time?",
    "How do I get my toddler to stop throwing food on the floor?",
    "What are good ways to handle a child's tantrum in the middle of a supermarket?",
    "How much pocket money should an eight-year-old get?",
    "How can I help my son settle in when he moves up to secondary school?",
    "How do I talk to my kids about a death in the family?",
    "My daughter is frightened of her swimming lessons. "
    "How can I help her feel braver in the water?",
    "How can I encourage my teenager to talk to me more?",
    "What should I do when my two children fight over the same toy?",
    "What are some screen-free activities for a rainy afternoon with young kids?",
    "How can I raise a child who loves reading?",
    "At what age can children walk to school on their own?",
    "How do I explain divorce to a five-year-old?",
    "My twelve-year-old says he's bored all through the summer holidays. "
    "How can I help him find things to do without just handing him a tablet?",
    "How should I respond when my child tells a lie?",
    "How can I prepare my first child for the arrival of a new baby?",
    "What should I pack in a hospital bag before giving birth?",
    "How can I help my child with maths homework when I've forgotten it all myself?",
    "What should I do if my child is being bullied at school?",
    "How can grandparents stay close to grandchildren who live far away?",
    "What are some fun ways to teach a preschooler the alphabet?",
    "How do I get my kids to help tidy up without constant nagging?",
    "When and how should I prune a rose bush?", "How do I start a compost heap in a small garden?",
    "What is the easiest way to get rid of weeds between paving stones?",
    "How do I plant tulip bulbs so they flower in spring?",
    "How can I keep slugs off my lettuces without using poison?",
    "How deep should I dig the hole when planting a young apple tree?",
    "What vegetables are easiest for a first-time gardener to grow?",
    "How do I save seeds from my tomato plants for next year?",
    "How do I repot a houseplant that has outgrown its pot?",
    "Why are the leaves on my tomato plants turning yellow?",
    "What jobs should I do in the garden to get it ready for winter?",
    "How do I grow strawberries in hanging baskets?",
    "How can I attract butterflies and birds to my garden?",
    "What is mulch, and why do gardeners use it?",
    "How do I build a simple raised bed for vegetables?",
    "What is the best way to clean and sharpen garden tools?",
    "How can I grow herbs on a kitchen windowsill?",
    "My hedge has become very overgrown and is blocking the path. "
    "How hard can I cut it back without killing it?",
    "How do I start a wildflower meadow in one corner of my garden?",
    "How do I check the oil level in my car?", "How often should I rotate my car's tyres?",
    "What does the check engine light usually mean?",
    "How do I check the tyre pressure and pump up a tyre at a petrol station?",
    "What should I keep in my car in case I break down in winter?",
    "How can I tell when my brake pads need replacing?",
    "Why does my car make a squealing noise when I start it on cold mornings?",
    "What does a car service usually include?", "How can I drive in a way that uses less fuel?",
    "How do I change a flat tyre on a car safely at the side of the road?",
    "What should I check before buying a second-hand car?",
    "What is the difference between a manual and an automatic gearbox?",
    "How do I know if my car battery is dying?",
    "My car pulls to the left when I brake. "
    "What could be causing it, and is it safe to drive to a garage?",
    "What does a timing belt do, and why does it need replacing?", "How do I fix a dripping tap?",
    "How do I fill a small hole in a plasterboard wall?", "How can I stop a door from squeaking?",
    "How do I replace the silicone sealant around a bath?",
    "What should I do if a water pipe bursts in my house?",
    "How do I fix a toilet that keeps running after it's flushed?",
    "How do I stop cold draughts coming under my front door?",
    "How do I unstick a sash window that has been painted shut?",
    "How do I get rid of black mould in the bathroom?",
    "How do I put up a shelf that is actually level?",
    "What tools should every household have in a basic toolbox?",
    "How do I change a ceiling light fitting safely?",
    "Our bedroom door doesn't close properly anymore because it rubs against the frame at the "
    "top. How can I fix it myself?",
    "How can I soundproof a room cheaply?",
    "What kind of paint should I use on a bathroom ceiling?",
    "How can I tell if a wall is load-bearing?",
    "How do I stop condensation forming on the windows every morning?",
    "How do I set up a tank for a pair of goldfish?",
    "What does a rabbit need to be happy living indoors?", "How do I look after a guinea pig?",
    "Can two hamsters live together in one cage?", "What should I feed a pet tortoise?",
    "How do I teach a budgie to talk?", "What do I need to keep a few chickens in my back garden?",
    "How long do parrots live, and what does that mean for an owner?",
    "Is a bearded dragon a good pet for a child?", "How do I tell if my rabbit is unwell?",
    "What kinds of fish can live together in a small community aquarium?",
    "How do I handle a pet rat so it learns to trust me?",
    "My son wants a pet snake for his birthday. What would we need to look after one properly?",
    "How do I care for a horse in winter?",
    "What should I do with my pet fish when I go on holiday for a week?",
    "Do pet birds get lonely if they live on their own?",
    "Should I pay off my student loan early or save the money instead?",
    "Is it better to rent or buy a home in your twenties?",
    "How do I decide between a fixed-rate and a variable-rate mortgage?",
    "Should I buy a brand new car or one that is a couple of years old?",
    "Is it a good idea to lease a car instead of buying one?",
    "What should I think about before taking out a personal loan?",
    "How do I work out whether switching energy supplier would save me money?",
    "I have five thousand pounds sitting in my current account. What are my options for it?",
    "How can a couple split household bills fairly when one of them earns much more?",
    "What should I do if I can't pay a bill on time?",
    "Is it sensible to buy a house together with my sister?",
    "How do I make a will, and why should I bother?", "What are the hidden costs of owning a home?",
    "How can I find and cancel subscriptions I've forgotten about?",
    "What is a credit score, and how can I improve mine?",
    "My partner and I want a small wedding next year. "
    "Where should we spend the money and where can we save?",
    "How do I plan financially for having a baby?",
    "How do I set a savings goal for a big holiday and stick to it?",
    "What should I do first if I inherit some money?",
    "How do I tell my boss that I've made a serious mistake?",
    "How should I handle a coworker who keeps taking credit for my work?",
    "How can I switch careers at forty?", "What does a project manager actually do all day?",
    "How do I write a professional summary for my LinkedIn profile?",
    "What is the best way to run a short, useful meeting?",
    "How can I say no to extra work without looking lazy?",
    "What should I do in my last two weeks before leaving a job?",
    "How do I prepare for my annual performance review?",
    "What does an apprenticeship involve, and who is it good for?",
    "How do I ask a former employer for a reference?",
    "How do I deal with a manager who micromanages everything I do?",
    "How can I disagree with a colleague politely in a meeting?",
    "What is it like to work as a paramedic?", "How do I become a primary school teacher?",
    "What is a four-day working week, and does it work?",
    "I've been offered two jobs: one pays more, the other has a shorter commute and nicer people. "
    "How should I decide?",
    "What should I put in a handover document before going on parental leave?",
    "What are the most common mistakes people make on a CV?",
    "A project I'm responsible for will miss its deadline by two weeks. "
    "How do I write an honest email to the client about it?",
    "What is a prime number, and why do mathematicians care about them?",
    "Can you explain what pi is and why its digits never end?",
    "What does it mean for a number to be irrational?",
    "How do I work out 15 percent of a bill in my head?",
    "What is the Pythagorean theorem, with an everyday example?", "Why can't you divide by zero?",
    "How would you explain negative numbers with a real-life example?",
    "How do you work out the chance of rolling two sixes in a row?",
    "What is the difference between the mean, the median and the mode?",
    "How do fractions and decimals relate to each other?",
    "What is algebra actually used for in everyday life?",
    "What is infinity, and are some infinities bigger than others?",
    "What is a logarithm, in plain words?",
    "What is the Monty Hall problem, and why is the answer so surprising?",
    "What is a ratio, and how do I use one to scale a recipe up?",
    "Why is any number to the power of zero equal to one?",
    "What is symmetry in maths, and where do we see it in nature?",
    "When should I use 'who' and when should I use 'whom'?",
    "What is the difference between 'affect' and 'effect'?", "How do I use a semicolon correctly?",
    "What is the passive voice, and why do teachers tell you to avoid it?",
    "When do I use an apostrophe before an s?",
    "What is the difference between 'fewer' and 'less'?",
    "What is a split infinitive, and is it really wrong?",
    "Is it wrong to start a sentence with 'and' or 'but'?",
    "What is the difference between 'its' and 'it's'?",
    "When should I say 'my husband and I' and when 'my husband and me'?",
    "What is the Oxford comma, and should I use it?",
    "What is a dangling modifier? Can you show me one and how to fix it?",
    "What is the difference between 'lay' and 'lie'?",
    "What is a run-on sentence, and how do I fix one?",
    "What is alliteration, and can you give me some examples?",
    "Why is the Nile so important to Egypt?",
    "What are the seven continents, and which is the largest?",
    "How do caves form in limestone?",
    "Why do some countries have more than one capital city?",
    "How do lines of latitude and longitude work?",
    "Why does Australia have so many animals found nowhere else?",
    "What is a fjord, and where can you see them?",
    "Why is the Netherlands so flat, and how does it keep the sea out?",
    "What is the difference between Great Britain and the United Kingdom?",
    "Why was Venice built on water?", "Why is Iceland so green while Greenland is covered in ice?",
    "How big is Antarctica compared with Australia?",
    "Why do rivers bend and twist instead of flowing straight?",
    "What is the Panama Canal, and why was it built?",
    "What is the difference between an acid and an alkali?",
    "Why does baking soda fizz when you add vinegar?",
    "What actually happens in a chemical reaction?",
    "What is the difference between a mixture and a compound?",
    "How do fireworks get their different colours?",
    "Why does bleach take the colour out of clothes?",
    "What are the noble gases, and why don't they react with anything?",
    "How does a battery produce electricity?", "What is carbon dating, and how does it work?",
    "What are polymers, and where do we find them in daily life?",
    "How does DNA carry the instructions for building a body?",
    "What is the difference between a plant cell and an animal cell?",
    "How do our kidneys clean the blood?",
    "What is evolution by natural selection, in simple terms?",
    "How does the human eye see colour?", "Why do people have different blood types?",
    "How does the digestive system break down a meal?",
    "What are genes, and how are they passed from parents to children?",
    "Why do we have two lungs but only one heart?", "How do bones heal after a break?",
    "What is gravity, and why does it hold us to the ground?",
    "What is friction, and why is it useful?", "How does a lever make lifting easier?",
    "Why do we hear an echo in a large empty hall?",
    "Why does a siren sound different as it passes you?",
    "Why does a balloon stick to the wall after you rub it on your hair?",
    "What is Newton's third law, with an everyday example?",
    "What is the speed of sound, and how was it first measured?",
    "How do the lenses in a camera focus light?",
    "Can you explain electric current using water in pipes?", "Where does the word 'OK' come from?",
    "How many words do I need to know to hold a conversation in Spanish?",
    "Why does English spelling make so little sense?",
    "What are some English words borrowed from Arabic?",
    "What does the phrase 'break the ice' mean, and where does it come from?",
    "Why do British and American English spell some words differently?",
    "What is the difference between a dialect and a language?",
    "What are some useful phrases to learn before a trip to Italy?",
    "What are false cognates in French? Can you give me some examples?",
    "Why do some languages have masculine and feminine nouns?",
    "What does 'serendipity' mean, and where does the word come from?",
    "Give me five English idioms about money and explain what they mean.",
    "Is it easier for children to learn a second language than adults?",
    "How does Chinese writing work without an alphabet?",
    "What is Esperanto, and does anyone actually speak it?",
    "What does the expression 'once in a blue moon' mean?",
    "How does the offside rule work in football?", "How is a tennis match scored?",
    "What are the basic rules of cricket?", "How do I improve my golf swing?",
    "What is a try in rugby, and how many points is it worth?",
    "How does scoring work in ten-pin bowling?",
    "What is the difference between rugby union and rugby league?",
    "How do I breathe properly while swimming front crawl?", "What are the rules of volleyball?",
    "How does the Tour de France work?", "How do you score points in American football?",
    "What is the difference between a yellow card and a red card in football?",
    "How does a penalty shootout work?", "What is the history of the football World Cup?",
    "How does a handicap work in golf?", "How does sumo wrestling work?",
    "What is the difference between a major and a minor key?",
    "How do I tune a guitar without a tuner?",
    "Is the piano or the violin easier for a child to start with?",
    "What does a conductor actually do in an orchestra?", "How do I read sheet music?",
    "What is a chord, and how is it built?",
    "What is the difference between a symphony and a concerto?",
    "How often should a beginner practise an instrument?",
    "Why does a guitar string make a higher note when it's shorter?",
    "How did the blues influence rock and roll?", "How do I start writing my own songs?",
    "What is reggae, and where does it come from?", "What is perfect pitch, and can it be learned?",
    "Who was Mozart, and why is he so famous?", "Summarize the plot of a typical heist movie.",
    "What makes a good detective novel?", "What is the hero's journey in storytelling?",
    "Can you recommend some older novels for a teenager who likes adventure?",
    "How does a film get made, from script to cinema?",
    "What is the difference between a novel and a novella?",
    "Why are so many films remakes or sequels these days?",
    "What does a film director do compared with a producer?",
    "What are the main features of a Gothic novel?", "How do I start a book club?",
    "What makes a good villain in a story?", "What is a plot twist, and what makes one work?",
    "What are some good audiobooks for a long car journey with kids?",
    "How did silent films tell stories without dialogue?",
    "What is the difference between science fiction and fantasy?",
    "What is an unreliable narrator?", "What is the difference between baking and roasting?",
    "How do I poach an egg without it falling apart?",
    "How do I know when oil is hot enough for frying?", "What does it mean to deglaze a pan?",
    "How do I chop an onion quickly and safely?",
    "What is the point of resting meat after cooking it?", "How do I cook rice so it isn't sticky?",
    "What is the difference between baking soda and baking powder?",
    "How do I know when bread dough has been kneaded enough?", "How do I season a cast iron pan?",
    "How do I make stock from leftover chicken bones?",
    "What is the difference between simmering and boiling?",
    "How do I marinate meat, and how long should I leave it?",
    "How do I thicken a sauce that is too runny?", "How do I make pastry that isn't tough?",
    "How can I tell if an egg is still fresh?", "How much should I spend on a wedding gift?",
    "Is it rude to use my phone at the dinner table?",
    "How do I politely leave a conversation at a party?",
    "What should I bring when I'm invited to someone's house for dinner?",
    "Should I take my shoes off when I visit someone's house?",
    "How do I use chopsticks properly in a Japanese restaurant?",
    "What is the etiquette for replying to a group email?",
    "Is it okay to bring my children to a wedding if the invitation doesn't mention them?",
    "How do people usually greet each other in business meetings in China?",
    "How should I behave at a formal dinner with lots of cutlery?",
    "Is it rude to ask someone how much they earn?",
    "How do I tell a guest it's time to go home without being rude?",
    "What is the etiquette for splitting the bill at a restaurant?",
    "How should I introduce two people to each other?",
    "Is it acceptable to pass on a present someone gave me to another person?",
    "How is Chinese New Year celebrated?", "What is the Day of the Dead in Mexico?",
    "What happens during Holi in India?", "Why do people celebrate Bonfire Night in Britain?",
    "How do people in Sweden celebrate Midsummer?",
    "What is Passover, and what is eaten at the Seder meal?",
    "Why do Americans celebrate the Fourth of July?",
    "What is Eid al-Fitr, and how do families celebrate it?",
    "What are some Christmas traditions from around the world?",
    "What is Oktoberfest, and how did it begin?", "How is New Year's Eve celebrated in Spain?",
    "What is the Moon Festival in China, and why do people eat mooncakes?",
    "What are the traditions of a Japanese New Year?", "Why do people carve pumpkins at Halloween?",
    "How is Thanksgiving in Canada different from the American one?",
    "Is it ever right to lie to protect someone's feelings?", "Should zoos exist at all?",
    "If I find a wallet with cash in it, what is the right thing to do?",
    "Should parents read their teenager's messages?", "Is it ethical to buy fast fashion?",
    "Should people be allowed to sell their own organs?",
    "What is the trolley problem, and what does it show about ethics?",
    "Is it wrong to download films without paying for them?",
    "If a shop gives me too much change, am I obliged to give it back?",
    "Should everyone be required by law to vote?", "What is utilitarianism, explained simply?",
    "Is it wrong to tell children that Father Christmas is real?",
    "What would happen if the Moon disappeared?",
    "What would happen if everyone on Earth jumped at the same time?",
    "What would happen if humans stopped using money altogether?",
    "What would the world be like if the printing press had never been invented?",
    "What would happen if the Earth stopped spinning?",
    "What would happen if you dug a hole straight through the Earth and jumped in?",
    "What if the dinosaurs had never died out?",
    "What would happen to my body if I stayed in space for a year?",
    "What would happen if the internet went down for a whole week?",
    "If you could live in any period of history, which would be the most comfortable?",
    "What would life be like if humans could breathe underwater?",
    "If the Roman Empire had never fallen, what might Europe look like today?",
    "What would happen if everyone in a city stopped driving for a month?",
    "What would happen if people lived to be two hundred years old?",
    "What is the difference between a crocodile and an alligator?",
    "How are Spanish and Portuguese similar, and how are they different?",
    "Compare living in a village with living in a suburb.",
    "What is the difference between a hurricane and a typhoon?",
    "Compare e-readers with paper books for someone who reads a lot.",
    "Which uses more water, a shower or a bath?",
    "What is the difference between a heat pump and a gas boiler?",
    "What is the difference between baroque music and romantic music?",
    "Is a tablet or a laptop better for a university student?",
    "What is the difference between a freehold and a leasehold property?",
    "Give me step-by-step instructions for tying a tie.",
    "Walk me through changing a bike chain, step by step.",
    "How do I wrap a present neatly, step by step?",
    "Give me step-by-step instructions for planting a tree.",
    "Walk me through making a cup of pour-over coffee.",
    "How do I do CPR? Please give me the steps.",
    "Explain step by step how to fold a fitted sheet.", "Give me the steps to knit a simple scarf.",
    "How do I sew a button back onto a shirt?", "Walk me through building a campfire safely.",
    "Give me step-by-step instructions for changing a baby's nappy.",
    "How do I plait hair, step by step?",
    "Summarize the story of Romeo and Juliet in a few sentences.",
    "Give me a short summary of the story of Cinderella.",
    "Summarize the main events of the First World War.",
    "Summarize what happens in a typical superhero origin story.",
    "Summarize the history of the Olympic Games in one paragraph.",
    "Give me a one-paragraph summary of the life of Charles Darwin.",
    "Summarize the story of King Arthur and the Knights of the Round Table.",
    "Summarize how a typical haunted house film unfolds.",
    "Summarize the main arguments for and against nuclear power.",
    "Summarize the plot of Hamlet in five sentences.",
    "Summarize the plot of a typical Western film.",
    "Pretend you are a tour guide in Rome and show me around the Colosseum.",
    "Pretend you are a museum guide describing a dinosaur skeleton to a group of children.",
    "Act as a job interviewer and ask me three questions for a sales job.",
    "Pretend you are a chef explaining tonight's specials to a table of diners.",
    "You are a medieval town crier. Announce the news of the day.",
    "Pretend you are a travel agent and sell me a holiday to Norway.",
    "Act as a French waiter and take my order, but keep it simple so I can practise.",
    "Pretend you are a pirate captain giving a speech to a nervous crew.",
    "Pretend you are Sherlock Holmes and deduce something about me from my muddy shoes.",
    "Act as a librarian helping me choose a book for a rainy weekend.",
    "Pretend you are an estate agent showing me a tiny, very strange house.",
    "Pretend you are a sports commentator describing a snail race.",
    "Pretend you are an ancient Egyptian scribe describing your working day.",
    "Pretend you are a gardener giving a tour of a walled garden in June.",
    "Rewrite this sentence to sound more polite: Send me the report now.",
    "Rewrite this sentence so it sounds more formal: Hey, can we move the meeting?",
    "Make this text message friendlier: I can't come tonight.",
    "Rewrite this sentence in plain English: "
    "The aforementioned party shall remit payment forthwith.",
    "Rewrite this complaint so it sounds calmer: "
    "Your delivery service is a total joke and I want my money back.",
    "Rewrite 'The meeting was cancelled by the manager' in the active voice.",
    "Make this sentence shorter: "
    "Due to the fact that it was raining, we decided that we would stay inside.",
    "Rewrite this opening line so it grabs the reader: It was a normal day in town.",
    "Turn this sentence into a question: The library closes at eight.",
    "Rewrite this sentence for a five-year-old: "
    "Photosynthesis converts light into chemical energy.",
    "Make this job advert sound more welcoming: Applicants must have five years of experience.",
    "Rewrite this sentence without the word 'very': The film was very, very good.",
    "Rewrite this so it sounds more confident: "
    "I think maybe I could possibly help with the project.",
    "Rewrite this in the past tense: She walks to the market and buys fresh bread.",
    "Rewrite this note to a neighbour so it sounds less angry: Stop parking in front of my garage.",
    "Rewrite this sentence in the style of a fairy tale: The bus was late again.",
    "Make this announcement sound more exciting: Our school fair will have games and food.",
    "Fix the grammar in this sentence: Me and him goes to the shops yesterday.",
    "Rewrite this to sound more professional: Sorry, I totally forgot about your email.",
    "List five famous bridges and the cities they are in.",
    "Name five famous painters from the Renaissance.",
    "List six things to pack for a beach holiday with a baby.",
    "List five common houseplants that are hard to kill.",
    "Name five inventions from China that changed the world.",
    "List five easy dinners that use only one pan.",
    "List the main food groups with an example of each.",
    "Name five famous women scientists and what they discovered.",
    "List five things to do in London that are free.",
    "List ten things a new parent might forget to buy.",
    "List five card games that two people can play.",
    "Name the Seven Wonders of the Ancient World.",
    "List five good questions to ask a new neighbour.", "List five famous speeches from history.",
    "Give me ten name ideas for a small bakery.",
    "Give me ten ideas for a ten-year-old's birthday party.",
    "Brainstorm ideas for a school fundraiser.", "Give me some ideas for a cheap date night.",
    "Suggest some themes for a fancy dress party.",
    "What are some creative ways to reuse glass jars?",
    "Give me gift ideas for a grandfather who says he wants nothing.",
    "Brainstorm some fun team-building activities for a small office.",
    "Give me ideas for a short story about a lost suitcase.",
    "Suggest some names for a podcast about local history.",
    "Give me ten ideas for things to do on a rainy Sunday with teenagers.",
    "Brainstorm slogans for a campaign to keep the local park clean.",
    "Give me some ideas for a science fair project for a twelve-year-old.",
    "Give me ideas for decorating a teenager's bedroom without spending much.",
    "Brainstorm ways a village could raise money to repair its church roof.",
    "Give me ten ideas for a photography project around my neighbourhood.",
    "Suggest some names for a new variety of apple.",
    "Plan a week of quick vegetarian lunches to take to work.",
    "Make me a three-day itinerary for Rome.",
    "Help me plan a surprise party for my husband's fortieth birthday.",
    "Plan a day out in Edinburgh for a family with young children.",
    "Create a weekly cleaning schedule for a three-bedroom house.",
    "Help me plan a vegetable patch for a small back garden.",
    "Plan a ten-day trip through Vietnam from north to south.",
    "Plan a morning routine for a family that is always late for school.",
    "Plan a four-day road trip along the Amalfi coast.",
    "Make a meal plan for someone who wants to eat more vegetables.",
    "Plan a Christmas dinner timetable so everything is ready at the same time.",
    "Plan a simple weekly menu for a student with a tiny kitchen.",
    "Plan an afternoon tea for my mother's birthday.",
    "Make a schedule for a weekend spent redecorating a living room.",
    "Explain to a six-year-old why we need to brush our teeth.",
    "How would you explain where babies come from to a four-year-old?",
    "Explain to a child why the Moon seems to change shape.",
    "Explain to a child what money is and why we use it.",
    "How do I explain to my daughter why people have different skin colours?",
    "Explain electricity to a seven-year-old.", "Explain to a child why we have seasons.",
    "Explain to a child how a seed grows into a plant.", "Explain to a child why we pay taxes.",
    "How would you explain what a computer does to a small child?",
    "Explain to an eight-year-old how the heart pumps blood.",
    "Explain to a child what germs are and why we wash our hands.",
    "Explain what an election is to a nine-year-old.",
    "We just got a pair of rabbits for our kids, and they keep digging up the lawn. "
    "How can we give them space to dig without ruining the whole garden?",
    "My car is ten years old and needs a repair costing about a third of its value. "
    "Should I fix it or put that money towards another car?",
    "I've been offered a job in another city that pays twenty percent more, but my partner would "
    "have to find a new job. What questions should we ask before deciding?",
    "My son is fifteen and wants a part-time job at a supermarket. "
    "How can he balance it with school?",
    "Our bathroom extractor fan has stopped working and the mirror steams up for ages. "
    "Can I replace the fan myself, and what would I need?",
    "I'm learning Spanish on an app and can read quite well, but I freeze when someone speaks to "
    "me. How can I get better at listening and speaking?",
    "My daughter has a school project on the geography of Japan. "
    "Can you give her an overview of its islands, mountains and biggest cities?",
    "I play five-a-side football on Tuesdays and always lose the ball when I'm tackled. "
    "What techniques can help me keep possession?",
    "I've been given a cheap acoustic guitar for my birthday. "
    "What should I learn in the first month so that I don't give up?",
    "We're hosting my partner's parents from Korea for the first time next month. "
    "What customs should we be aware of to make them feel welcome?",
    "I found out that a colleague has been claiming overtime for hours he didn't work. "
    "Should I report him, and how?",
    "My book group just finished a long historical novel and half of us hated it. "
    "How can I run a good discussion when people disagree so strongly?",
    "I'm cooking dinner for a guest who can't eat gluten. "
    "What is a safe main course and dessert, and how do I avoid cross-contamination?",
    "My grandmother gave me her old sewing machine, but I have never used one. "
    "How do I thread it and sew a straight line?",
    "We want to plant a small fruit tree in a pot on our patio. "
    "Which kinds stay small, and how do we look after them?",
    "My teenage daughter wants to dye her hair bright blue before term starts. "
    "How should I respond without starting a fight?",
    "Our kitchen tap has very low water pressure while the bathroom taps are fine. "
    "What could cause that, and what can I check myself?",
    "I'm writing a mystery novel set in a seaside town in the 1950s. "
    "What everyday details would make the setting feel real?",
    "I've saved about ten thousand pounds and I'm twenty-eight. "
    "Should I put it towards a house deposit or start investing for retirement?",
    "My eight-year-old asked me why the Earth is round and not flat. "
    "How can I explain it in a way she will understand?",
    "We are visiting Kyoto for three days in November with my elderly parents, who can't walk "
    "far. What should we see?",
    "I'm starting a small online shop selling handmade soap. "
    "What should I think about for pricing, packaging and postage?",
    "My tortoise hasn't eaten for a few days and seems very slow. "
    "Should I be worried, and what should I check?",
    "I've inherited my grandfather's old mechanical watch and it has stopped. "
    "Is it worth repairing, and how should I look after it?",
    "The paint on our wooden window frames is peeling and the wood underneath looks grey. "
    "How do I repair and repaint them properly?",
    "I run a chess group for children aged eight to eleven. "
    "What activities can keep them interested for an hour each week?",
    "I have an interview for a bank teller job on Friday. "
    "I have retail experience but nothing in finance. How should I present myself?",
    "My parents are in their seventies and want to sell the family house and move somewhere "
    "smaller. How can I help them through it?",
    "Our neighbourhood wants to start a monthly repair cafe where people fix broken things "
    "together. How should we organise the first one?",
    "My son is learning fractions and keeps getting confused when adding fractions with different "
    "denominators. How can I explain it to him?",
    "I keep mixing up 'there', 'their' and 'they're' in my writing. "
    "Can you explain the difference with examples?",
    "We have a family reunion in July with about thirty people of all ages. "
    "What games and activities would work for everyone?",
    "My car failed its annual inspection because of worn tyres and a broken number plate light. "
    "Can I fix any of that myself?",
    "Our local tennis club wants to attract more young players. "
    "What could we offer to get teenagers interested?",
    "I want to watch the great films of the 1970s this year. "
    "Which ones should be on my list, and why?",
    "I'm making a roast chicken for the first time this Sunday. "
    "How do I make sure it's cooked through but still juicy?",
    "My mother-in-law always rearranges my kitchen when she visits. "
    "How can I ask her to stop without hurting her feelings?",
    "I've been asked to organise a leaving party for a colleague who has worked here for ten "
    "years. Where do I start?",
    "My goldfish has white spots on its fins. What could that be, and how can I treat it?",
    "We are moving to Germany next year with two children under ten. "
    "What should we know about schools and daily life there?",
    "I found a baby bird on the ground in my garden. Should I pick it up, or leave it alone?",
    "My teenage son wants to become a professional gamer. "
    "How can I support him while making sure he has a backup plan?",
    "I'm hosting a dinner party for eight, and one guest is vegan and another can't eat "
    "gluten. Can you suggest a menu that works for everyone?",
    "I lent my lawnmower to a neighbour and it came back broken. How should I raise it with him?",
    "My daughter is eleven and wants to start a small business selling bracelets at school. "
    "How can I help her do it properly?",
    "We've just bought a house with a wood-burning stove. How do I light it and use it safely?",
    "I've been playing the piano for a year and feel stuck at the same level. "
    "What can I do to keep improving?",
    "Our town is twinned with a town in France, and I've been asked to give a short welcome in "
    "French. Can you help me write a few simple sentences?",
    "I'm thirty-five and I've never paid into a pension. "
    "Is it too late to start, and how much should I put in?",
    "My neighbours keep chickens and one of them often wanders into my garden and eats my "
    "seedlings. What is a friendly way to sort this out?",
    "I'm driving across the Alps in winter for the first time. "
    "What should I know about snow chains and mountain roads?",
    "I volunteer at a food bank and we want to encourage more people to donate fresh food. "
    "What ideas might work?",
    "My youngest starts school in September and I'll have my days free for the first time in "
    "years. How can I make good use of that time?",
    "I'm reading a book about medieval Venice and keep seeing the word 'doge'. "
    "How did Venetian government actually work?",
    "Our shower tray is leaking and water is coming through the kitchen ceiling below. "
    "What should I do right now?",
    "My twins have started playing football and keep arguing about the rules. "
    "Can you explain the basics in a way seven-year-olds can follow?",
    "I run a small cafe and customers keep complaining that the music is too loud. "
    "How do I find a level that suits everyone?",
    "My son has to write about the Great Fire of London for homework. "
    "Can you give him the main facts in simple words?",
    "I've been asked to give the vote of thanks at a community awards evening. "
    "What should I say, and how long should it be?",
    "My partner and I both want a pet but we work long hours. "
    "Which animals are happy being left alone during the day?",
    "I've started baking sourdough, but my loaves come out flat and dense. "
    "What am I probably doing wrong?",
    "My teenager is about to take a driving test. What are the most common reasons people fail?",
    "What is a fair way to split chores between flatmates?",
    "How do I write a short bio for a conference programme?",
    "What should I do if I get a letter saying I've won a prize for a competition I never entered?",
    "Why do we say 'bless you' when someone sneezes?",
    "Why do we clink glasses when we make a toast?",
    "Can I fix a wool jumper that shrank in the wash?")

# More natural chat requests, one subject domain a file, written for the same reason:
# the first 492 of NATURAL_CHAT took the dev set's chat from 1.52 to 1.65 and all 1,021 to
# 1.74, while held-out answers of the corpus's own prompts read 2.1, so the head still met
# subjects it never saw. The first six files (3,000) took it to 1.83, nine more (4,500,
# 12-04) to 1.91; training longer on the same prompts had stopped at 1.85. The files
# written after that head (science_everyday, society_civics, ...) are not in its corpus
# yet. One request a line in chat_requests/*.txt (a test holds them to a wider word list
# than NATURAL_CHAT's).
CHAT_REQUEST_FILES = "chat_requests"

# The head on 4,021 natural chat requests lost code (CPU benchmark 2.14 -> 2.01)
# as code's share of the corpus fell from 32% to 18%: 160 more code tasks, each
# asked in every language in one seeded phrasing (1,280 prompts), bring it back
# to ~31%. One task a line, completing "Write a Python function that ...".
CODE_TASK_FILE = "code_tasks.txt"


def chat_requests() -> tuple[str, ...]:
    """The requests of every chat_requests/*.txt file, files in name order."""
    folder = _packaged(CHAT_REQUEST_FILES)
    files = sorted((f for f in folder.iterdir() if f.name.endswith(".txt")), key=lambda f: f.name)
    return tuple(line for f in files for line in _lines(f))


def code_tasks() -> tuple[str, ...]:
    """The tasks of code_tasks.txt."""
    return _lines(_packaged(CODE_TASK_FILE))


def _packaged(name: str):
    """A file or folder shipped beside this module (package data, so an
    installed wheel has it too)."""
    from importlib import resources

    return resources.files(__package__) / name


def _lines(resource) -> tuple[str, ...]:
    return tuple(line for line in resource.read_text().splitlines() if line.strip())


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
    the standalone and natural requests, and the code tasks x languages x phrasings;
    about 70% chat, 30% code, interleaved. Never a benchmark or dev prompt."""
    import itertools
    import random

    rng = random.Random(seed)
    chat = [t.format(topic=topic) for topic in VARIED_TOPICS for t in VARIED_TEMPLATES]
    rng.shuffle(chat)
    # VARIED_REQUESTS first, as before NATURAL_CHAT existed; NATURAL_CHAT spread
    # evenly through the rest (seeded), so train-mtp's held-out tail holds some
    chat = list(VARIED_REQUESTS) + _spread(chat, list(NATURAL_CHAT), rng)
    # the request files spread through all of it too (their own seed), so the
    # held-out tail and any first N prompts hold some
    chat = _spread(chat, list(chat_requests()), random.Random(seed + 1))
    code = [t.format(language=lang, task=task) for task in VARIED_CODE_TASKS
            for lang in dict.fromkeys(VARIED_LANGUAGES) for t in VARIED_CODE_TEMPLATES]
    code += [t.format(language=lang, thing=thing) for thing in VARIED_CLASSES
             for lang in ("Python", "JavaScript", "Java", "C++") for t in VARIED_CLASS_TEMPLATES]
    phrasing = random.Random(seed + 2)  # its own seed: older prompts keep their texts
    code += [phrasing.choice(VARIED_CODE_TEMPLATES).format(language=lang, task=task)
             for task in code_tasks() for lang in dict.fromkeys(VARIED_LANGUAGES)]
    rng.shuffle(code)
    held_out = {*HELD_OUT_CHAT, *HELD_OUT_CODE, *DEV_CHAT, *DEV_CODE}
    # four code prompts to every five chat ones (until 12-03 the index i*4//5
    # read some code prompts twice and every fourth never)
    mixed: list[str] = []
    codes = iter(code)
    for i, prompt in enumerate(chat):
        mixed.append(prompt)
        if i % 5 != 4:
            mixed += itertools.islice(codes, 1)  # none once the code prompts run out
    mixed += codes
    out = [p for p in dict.fromkeys(mixed) if p not in held_out]
    return out[:count]


def _spread(items: list[str], extra: list[str], rng) -> list[str]:
    """`items` with `extra` (shuffled) inserted at even intervals."""
    extra = extra[:]
    rng.shuffle(extra)
    out, every = [], len(items) / max(len(extra), 1)
    for i, item in enumerate(extra):
        out += items[round(i * every):round((i + 1) * every)] + [item]
    return out + items[round(len(extra) * every):]
