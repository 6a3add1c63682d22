"""The fixed texts of `graphinfer bench accuracy` (written for this repo, so no download is needed; never edit
them: the perplexities in docs/benchmarks.md are over exactly these)."""

PROMPTS = [
    "Explain in two sentences why the sky is blue.",
    "Write a short poem about a lighthouse keeper.",
    "What are three good habits for writing clean Python code?",
    "Summarise the plot of a detective story in which the butler is innocent.",
    "Give me a recipe for a simple tomato soup.",
    "How does a bicycle stay upright while it moves?",
    "List the planets of the solar system in order from the sun.",
    "Describe the difference between a list and a tuple in Python.",
]

PERPLEXITY_TEXT = """\
The village sat at the edge of a wide valley, where the river slowed and spread into a string of shallow pools.
Every morning the baker opened his shutters before sunrise, and the smell of warm bread drifted down the main street
long before the first cart rolled over the bridge. Children walked to the small stone school in groups, trading
stories about the foxes they had seen in the fields and the storms that had rattled their windows at night.

In spring the farmers ploughed the dark soil and planted barley, beans and potatoes. They watched the sky closely,
because a late frost could ruin a season's work in a single night. When the rain came at the right time, the
valley turned green almost overnight, and the market in the square filled with baskets of early vegetables, jars
of honey and bunches of wild garlic gathered from the woods.

A computer program is a list of instructions that tells a machine what to do. Programmers write these instructions
in languages that people can read, and tools called compilers translate them into the simple operations a
processor understands. Good programs are easy to read, easy to test and easy to change. They use clear names,
small functions and comments that explain why something is done, not only what is done.

Large language models predict the next word of a text from the words that came before it. During training they read
a great deal of writing and slowly adjust millions of numbers so that their predictions improve. When such a model
answers a question, it produces one token at a time, and each new token depends on everything it has written so
far. Running these models quickly requires careful use of memory, because every step must read all of the model's
weights.
"""
