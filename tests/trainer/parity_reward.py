"""A test reward that gives mixed groups even for an untrained model: deterministic in the response.

"Correct" when the response's length plus the answer is even. With sampled responses of random
length, about half of each group is correct, so dynamic sampling keeps most groups and the trainer
tests exercise the whole step (advantages are non-zero) without a model that can do arithmetic.
"""


def compute_score(solution_str, ground_truth, **_):
    acc = (len(solution_str) + int(ground_truth)) % 2 == 0
    return {"score": 1.0 if acc else -1.0, "acc": acc, "pred": str(len(solution_str))}
