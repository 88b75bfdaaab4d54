"""The built-in benchmark suite: written for mlx-spec (no public benchmark set), five categories.

summarize and rewrite give the model a text to work from (copy-heavy: prompt lookup's case);
chat, code and math are open-ended."""

_LIGHTHOUSE = (
    "The lighthouse on Brennick Point was built in 1871 after three ships ran aground on the "
    "reef in a single winter. Its first keeper, Ada Marsh, kept a logbook for forty years, "
    "recording every storm, every passing ship and the price of lamp oil. When the light was "
    "automated in 1962, the logbooks were moved to the town library, where historians later "
    "used them to reconstruct how shipping routes changed as steam replaced sail. Today the "
    "tower is a museum, and volunteers still climb its 114 steps each evening to check the "
    "automatic lamp, a tradition the town council voted to keep in 2015."
)

_MEETING = (
    "The quarterly planning meeting covered three topics. First, the mobile team reported that "
    "the new login flow reduced failed sign-ins by 18 percent, but support tickets about "
    "password resets increased. Second, the data team asked for two more engineers to finish "
    "the migration to the new warehouse before the end of the year; finance agreed to one. "
    "Third, the office move was postponed from March to May because the new building's network "
    "installation is late. Action items: the mobile team will redesign the reset screen, the "
    "data team will re-plan the migration with one hire, and facilities will confirm the May date."
)

_EMAIL = (
    "hi team, so i wanted to let everyone know that the release is going to be late again, "
    "the reason is that we found a bug in the payment code that sometimes charges customers "
    "twice and we cant ship that obviously. we think it will take about a week to fix and test. "
    "sorry about this, i know marketing already planned the announcement for monday. let me know "
    "if you have questions."
)

_CODE = """def load_scores(path):
    scores = {}
    with open(path) as f:
        for line in f:
            name, value = line.strip().split(",")
            scores[name] = scores.get(name, 0) + int(value)
    return scores


def top_players(scores, n):
    ranked = sorted(scores.items(), key=lambda item: item[1], reverse=True)
    return [name for name, _ in ranked[:n]]
"""

SUITE = [
    {
        "category": "chat",
        "prompt": "What are three good habits for someone who wants to sleep better? Explain each briefly.",
    },
    {
        "category": "chat",
        "prompt": "I am visiting a new city for one day. How should I plan the day to see the most without rushing?",
    },
    {
        "category": "code",
        "prompt": "Write a Python function that checks whether a string is a palindrome, ignoring case and punctuation, with a short docstring.",
    },
    {
        "category": "code",
        "prompt": "Add a docstring to each function in this Python code and return the whole code:\n\n"
        + _CODE,
    },
    {
        "category": "math",
        "prompt": "A baker makes 24 muffins per tray and bakes 7 trays. She sells 130 muffins and gives away 15. How many muffins are left? Show your steps.",
    },
    {
        "category": "math",
        "prompt": "A train travels 180 km in 2 hours, then 150 km in 3 hours. What is its average speed for the whole trip? Explain.",
    },
    {"category": "summarize", "prompt": "Summarize the following text in a few sentences:\n\n" + _LIGHTHOUSE},
    {
        "category": "summarize",
        "prompt": "Summarize the decisions and action items of this meeting:\n\n" + _MEETING,
    },
    {
        "category": "rewrite",
        "prompt": "Rewrite this email so that it is clear and professional, keeping all the facts:\n\n"
        + _EMAIL,
    },
    {
        "category": "rewrite",
        "prompt": "Repeat the following text, changing every past-tense verb to present tense:\n\n"
        + _LIGHTHOUSE,
    },
]
