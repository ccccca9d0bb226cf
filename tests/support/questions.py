"""Questions with answers of every kind (a string, an int, LaTeX, a negative number; an extra field that
is ignored): the prompt-data tests write them through the library (tests/data/test_prepare.py) and
through the `prepare-data` command (tests/cli/test_prepare_data.py)."""

QUESTIONS = [
    {"question": "What is the smallest prime?", "answer": "2"},
    {"question": "How many sides has a hexagon?", "answer": 6, "source": "ignored"},
    {"question": "Compute 3^3.", "answer": "27"},
    {"question": "What is 10 / 4?", "answer": "\\frac{5}{2}"},
    {"question": "What is 9 - 10?", "answer": "-1"},
]
