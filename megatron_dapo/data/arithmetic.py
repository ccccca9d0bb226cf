"""A synthetic arithmetic task in the DAPO format, and the small tokenizer the CPU demo trains with.

The problems are short additions and subtractions ("What is 37 + 58?") whose answer is an integer,
so the DAPO rule-based math reward scores them exactly. The records are the verl/DAPO schema of
`data.prepare` (the DAPO-Math instruction template), so the demo exercises the real reward path:
the model must end its response with an `Answer: <number>` line.

The tokenizer is a byte-level BPE trained on the fly on this task's own text (no download),
with digits split one per token (so numbers are spelled digit by digit, which a tiny model can
learn) and Qwen-style chat special tokens plus a chat template, so the data pipeline applies a
chat template exactly as it does for a real model.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional, Union

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from megatron_dapo.data.prepare import dapo_prompt, make_record, write_records

__all__ = [
    "ARITHMETIC_DATA_SOURCE",
    "ArithmeticProblem",
    "build_tokenizer",
    "make_problems",
    "worked_solution",
    "write_arithmetic_dataset",
]

ARITHMETIC_DATA_SOURCE = "synthetic/arithmetic"

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

# Qwen-style template, reduced to what the task needs (a user turn, then the assistant's).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@dataclass(frozen=True)
class ArithmeticProblem:
    question: str
    answer: str
    a: int
    b: int
    op: str


def make_problems(num: int, seed: int, max_operand: int = 50, ops: str = "+-") -> list[ArithmeticProblem]:
    """`num` deterministic problems `a op b` with 0 <= a, b <= max_operand (subtraction stays >= 0)."""
    rng = random.Random(seed)
    problems = []
    for _ in range(num):
        op = rng.choice(ops)
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        if op == "-" and b > a:
            a, b = b, a
        value = a + b if op == "+" else a - b
        problems.append(ArithmeticProblem(question=f"What is {a} {op} {b}?", answer=str(value), a=a, b=b, op=op))
    return problems


def worked_solution(problem: ArithmeticProblem) -> str:
    """A step-by-step response ending in the DAPO answer line (the supervised warm start's target).

    Column arithmetic, units first: each line is a one-digit fact (with the carry or borrow), then
    the result is assembled. A tiny model can learn that procedure and apply it to problems it has
    never seen, so held-out validation measures the procedure, not recall; sampling slips in the
    steps are what DAPO then trains away. Operands up to 99.
    """
    a, b, op = problem.a, problem.b, problem.op
    (a_tens, a_units), (b_tens, b_units) = divmod(a, 10), divmod(b, 10)
    if op == "+":
        units = a_units + b_units
        carry = units // 10
        steps = [f"{a_units} + {b_units} = {units}", f"{a_tens} + {b_tens} + {carry} = {a_tens + b_tens + carry}"]
    else:
        borrow = int(a_units < b_units)
        steps = [
            f"{a_units + 10 * borrow} - {b_units} = {a_units + 10 * borrow - b_units}",
            f"{a_tens} - {b_tens} - {borrow} = {a_tens - b_tens - borrow}",
        ]
    return "\n".join(steps + [f"{a} {op} {b} = {problem.answer}", f"Answer: {problem.answer}"])


def build_tokenizer(vocab_size: int = 384, save_dir: str | Path | None = None):
    """Train the demo's byte-level BPE tokenizer on this task's text; return a HF fast tokenizer.

    Deterministic: the same corpus and settings give the same vocabulary on every machine.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = []
    for problem in make_problems(2000, seed=12345):
        corpus.append(f"<|im_start|>user\n{dapo_prompt(problem.question)}<|im_end|>\n<|im_start|>assistant\n")
        corpus.append(worked_solution(problem))
    tokenizer.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        bos_token=None,
        unk_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    if save_dir is not None:
        fast.save_pretrained(str(save_dir))
    return fast


def _distinct_problem_count(max_operand: int) -> int:
    """Distinct questions `make_problems` can produce with ops "+-": all a+b, and a-b with a >= b."""
    values = max_operand + 1
    return values * values + values * (values + 1) // 2


def _problem_stream(seed: int, max_operand: int) -> Iterator[ArithmeticProblem]:
    """Endless deterministic arithmetic problems (chunks of `make_problems` with derived seeds)."""
    chunk = 0
    while True:
        yield from make_problems(1024, seed=seed * 1_000_003 + chunk, max_operand=max_operand)
        chunk += 1


def write_arithmetic_dataset(
    out_dir: Union[str, Path], num_train: int, num_val: int, seed: int, max_operand: int = 50,
    sft_file: Optional[Union[str, Path]] = None,
) -> tuple[Path, Path]:
    """Write the arithmetic demo's ``train.parquet`` and ``val.parquet`` under `out_dir`; return their paths.

    The validation questions are distinct and never appear in the training set (training questions
    may repeat), so validation accuracy measures generalisation rather than recall. Deterministic in
    (num_train, num_val, seed, max_operand). `sft_file`: also write the training records there with
    a ``response`` field, their `worked_solution` (the supervised warm start's data).
    """
    if num_train < 1 or num_val < 1:
        raise ValueError(f"need num_train >= 1 and num_val >= 1, got {num_train} and {num_val}")
    universe = _distinct_problem_count(max_operand)
    if num_val >= universe:
        raise ValueError(
            f"max_operand={max_operand} allows only {universe} distinct problems; num_val={num_val} would leave none for training"
        )
    val_problems, held_out = [], set()
    for problem in _problem_stream(seed * 2 + 1, max_operand):
        if len(val_problems) == num_val:
            break
        if problem.question not in held_out:
            held_out.add(problem.question)
            val_problems.append(problem)
    train_problems = []
    for problem in _problem_stream(seed * 2, max_operand):
        if len(train_problems) == num_train:
            break
        if problem.question not in held_out:
            train_problems.append(problem)
    out_dir = Path(out_dir)

    def records(problems: list[ArithmeticProblem], split: str) -> list[dict]:
        return [make_record(p.question, p.answer, index=i, split=split, data_source=ARITHMETIC_DATA_SOURCE) for i, p in enumerate(problems)]

    train_records = records(train_problems, "train")
    train_path = write_records(train_records, out_dir / "train.parquet")
    val_path = write_records(records(val_problems, "test"), out_dir / "val.parquet")
    if sft_file is not None:
        write_records([{**r, "response": worked_solution(p)} for r, p in zip(train_records, train_problems)], sft_file)
    return train_path, val_path
