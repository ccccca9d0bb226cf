"""Tokenizer and reward functions for the reward tests, and the parts shared by the test reward files.

They live in a module (not in the test files) so that worker processes can import them by
reference without importing pytest or the tests. The reward files that the trainer tests load by
path (tests/trainer/*_reward.py, tests/slurm/*_reward.py) import `parity_score` and `count_call`
from here: they run in the trainer, its reward pool workers and SLURM job steps, all started from
the repository root (the working directory, or PYTHONPATH in the sbatch scripts), where `tests` imports.
"""

from __future__ import annotations

import os
import time

CALLS_FILE_ENV = "MDAPO_TEST_REWARD_CALLS"
"""Names a file that `count_call` appends one byte to at every call: its size counts the calls."""

PAD_ID = 0
"""Special token (padding / end of sequence) that skip_special_tokens drops."""


class CharTokenizer:
    """One token per character (id = code point + 1; 0 is the special token).

    Deliberately not a Hugging Face tokenizer: it checks that it receives python lists of ints,
    which is all the reward manager promises to give a generic tokenizer.
    """

    def encode(self, text: str) -> list[int]:
        return [ord(c) + 1 for c in text]

    def batch_decode(self, sequences, skip_special_tokens: bool = False) -> list[str]:
        out = []
        for ids in sequences:
            if not isinstance(ids, list) or not all(type(i) is int for i in ids):
                raise TypeError(f"CharTokenizer expects lists of python ints, got {type(ids).__name__}")
            chars = (("" if skip_special_tokens else "<pad>") if i == PAD_ID else chr(i - 1) for i in ids)
            out.append("".join(chars))
        return out


def build_hf_tokenizer(corpus: list[str]):
    """A small byte-level BPE trained on `corpus`, wrapped as a Hugging Face fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
    )
    backend.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", clean_up_tokenization_spaces=False)


def char_batch(texts: list[str]) -> tuple[list[list[int]], list[int]]:
    """Lists of ids with an EOS (special, counted in the length, dropped when decoding)."""
    tok = CharTokenizer()
    ids = [tok.encode(t) + [PAD_ID] for t in texts]
    return ids, [len(i) for i in ids]


def answer_is_ground_truth(response: str, ground_truth: str) -> float:
    """1.0 when the response ends with the ground truth, else 0.0 (a float, no acc given)."""
    return 1.0 if response.endswith(ground_truth) else 0.0


def raises_on_boom(response: str, ground_truth: str) -> dict:
    if "boom" in response:
        raise RuntimeError("scorer exploded")
    return {"score": 0.5, "pred": response[-3:]}  # no "acc": acc = score > 0


def hangs_on_marker(response: str, ground_truth: str) -> float:
    """Hangs forever in pure python on 'spin', in a blocking sleep on 'sleep'."""
    if "spin" in response:
        while True:
            pass
    if "sleep" in response:
        time.sleep(1e9)
    return 2.0


def exits_on_marker(response: str, ground_truth: str) -> float:
    if "die" in response:
        os._exit(3)  # the worker process disappears without a word
    return 1.0


def returns_garbage(response: str, ground_truth: str):
    if response == "nan":
        return float("nan")
    if response == "nodict":
        return {"acc": True}
    if response == "text":
        return "high"
    return {"score": -0.5, "acc": True, "pred": object()}  # odd pred is turned into a string


def sees_validating(response: str, ground_truth: str, validating: bool = False) -> dict:
    return {"score": 1.0, "pred": f"validating={validating}"}


def sees_everything(response: str, ground_truth: str, **kwargs) -> dict:
    return {"score": 1.0, "pred": repr(sorted(kwargs.items()))}


def sees_data_source_only(response: str, ground_truth: str, data_source: str = "?") -> dict:
    return {"score": 1.0, "pred": data_source}


def worker_pid(response: str, ground_truth: str) -> dict:
    return {"score": 0.0, "pred": os.getpid()}


class ParentOnlyTokenizer(CharTokenizer):
    """Pickles fine but refuses to unpickle in any other process (a broken worker environment)."""

    def __init__(self) -> None:
        self.owner = os.getpid()

    def __setstate__(self, state: dict) -> None:
        if os.getpid() != state["owner"]:
            raise RuntimeError("this tokenizer cannot be loaded here")
        self.__dict__.update(state)


def parity_score(solution_str: str, ground_truth) -> dict:
    """tests/trainer/parity_reward.py's score: correct when the response's length plus the answer is even."""
    acc = (len(solution_str) + int(ground_truth)) % 2 == 0
    return {"score": 1.0 if acc else -1.0, "acc": acc, "pred": str(len(solution_str))}


def count_call(at: str) -> bool:
    """Count this call and say whether it is the N-th, N given by the environment variable `at`.

    Each call appends one byte to the file named by MDAPO_TEST_REWARD_CALLS (opened for appending,
    so the count holds across steps and across the processes that score: the trainer or its reward
    workers) and reads the file's size as the number of calls so far. Without that variable nothing
    is counted and the answer is False; it is False as well whenever `at` is unset or 0.
    """
    calls_file = os.environ.get(CALLS_FILE_ENV)
    if not calls_file:
        return False
    fd = os.open(calls_file, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, b".")
        calls = os.fstat(fd).st_size
    finally:
        os.close(fd)
    return calls == int(os.environ.get(at, "0"))
