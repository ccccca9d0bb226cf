"""A synthetic arithmetic task in the DAPO format, and the small tokenizer the CPU demo trains with.

The problems are short additions and subtractions ("What is 37 + 58?") whose answer is an integer,
so the DAPO rule-based math reward scores them exactly. Prompts use the DAPO instruction template
(the same text as the DAPO-Math-17k dataset), so the demo exercises the real reward path: the
model must end its response with an `Answer: <number>` line.

The tokenizer is a byte-level BPE trained on the fly on this task's own text (no download),
with digits split one per token (so numbers are spelled digit by digit, which a tiny model can
learn) and Qwen-style chat special tokens plus a chat template, so the data pipeline applies a
chat template exactly as it does for a real model.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

DAPO_INSTRUCTION_PREFIX = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
DAPO_INSTRUCTION_SUFFIX = '\n\nRemember to put your answer on its own line after "Answer:".'

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


def dapo_prompt(question: str) -> str:
    """The DAPO-Math instruction wrapped around a question."""
    return f"{DAPO_INSTRUCTION_PREFIX}{question}{DAPO_INSTRUCTION_SUFFIX}"


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


def to_dapo_record(problem: ArithmeticProblem, index: int, split: str) -> dict:
    """One row of the verl/DAPO dataset schema."""
    return {
        "data_source": "synthetic/arithmetic",
        "prompt": [{"role": "user", "content": dapo_prompt(problem.question)}],
        "ability": "MATH",
        "reward_model": {"style": "rule", "ground_truth": problem.answer},
        "extra_info": {"index": index, "split": split, "question": problem.question, "answer": problem.answer},
    }


def build_tokenizer(vocab_size: int = 384, save_dir: str | Path | None = None):
    """Train the demo's byte-level BPE tokenizer on this task's text; return a HF fast tokenizer.

    Deterministic: the same corpus and settings give the same vocabulary on every machine.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

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
