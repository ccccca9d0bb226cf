"""What a reward worker runs, and the scoring it shares with the in-process path: decode token ids
(one batched call), call the reward function on each sample, read its result.

Its own module, which imports no torch: the reward pool's forkserver preloads the module of its
task (`pool.WorkerPool`), and torch there would cost every run's first scoring ~2 s of start-up
(docs/PERF.md, "What the reward pool's forkserver imports"). The manager (`manager.py`) builds the
chunks and shapes the results.
"""

from __future__ import annotations

import inspect
import math
import pickle
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import numpy as np

from megatron_dapo.reward.loader import RewardFunctionRef
from megatron_dapo.reward.pool import SampleClock, WorkerCannotWork

__all__ = ["Chunk", "OPTIONAL_KEYWORDS", "SampleResult", "ScoringTask", "accepted_keywords", "batch_decode", "interpret", "score_texts"]

# Keyword arguments a reward function may opt into by naming them (or by taking **kwargs).
OPTIONAL_KEYWORDS = ("validating", "data_source", "extra_info")


def batch_decode(tokenizer: Any, rows: list[Union[np.ndarray, list[int]]]) -> list[str]:
    """One batched ``batch_decode(..., skip_special_tokens=True)`` call.

    Hugging Face tokenizers receive 1-D integer arrays: they turn each into a list with one C-level
    ``tolist()``, whereas a python list gets an element-by-element type check first (about 35% of
    the whole decode time for ~500-token responses; see docs/PERF.md). Any other tokenizer gets
    the lists of ints the interface promises.
    """
    if not rows:
        return []
    transformers = sys.modules.get("transformers")
    if transformers is None or not isinstance(tokenizer, transformers.PreTrainedTokenizerBase):
        rows = [row.tolist() if isinstance(row, np.ndarray) else row for row in rows]
    texts = list(tokenizer.batch_decode(rows, skip_special_tokens=True))
    if len(texts) != len(rows):
        raise RuntimeError(f"tokenizer.batch_decode returned {len(texts)} strings for {len(rows)} sequences")
    return texts


# --------------------------------------------------------------------------------------------
# Calling the reward function (shared by the in-process path and the workers)
# --------------------------------------------------------------------------------------------


def accepted_keywords(function: Callable[..., Any]) -> frozenset[str]:
    """Which of `OPTIONAL_KEYWORDS` the function takes, by name or through **kwargs."""
    try:
        parameters = inspect.signature(function).parameters.values()
    except (TypeError, ValueError):  # some builtins and C callables have no signature
        return frozenset()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return frozenset(OPTIONAL_KEYWORDS)
    by_name = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    names = {p.name for p in parameters if p.kind in by_name}
    return frozenset(k for k in OPTIONAL_KEYWORDS if k in names)


def interpret(output: Any) -> tuple[float, bool, Any]:
    """(score, acc, pred) from a float-like or ``{"score", "acc"?, "pred"?}`` return value."""
    if isinstance(output, dict):
        if "score" not in output:
            raise ValueError(f"reward function returned a dict without 'score' (keys: {sorted(map(str, output))})")
        score = float(output["score"])
        acc = bool(output["acc"]) if "acc" in output else score > 0
        pred = output.get("pred")
    else:
        score = float(output)
        acc, pred = score > 0, None
    if not math.isfinite(score):
        raise ValueError(f"reward function returned a non-finite score {score}")
    if pred is not None and not isinstance(pred, (str, int, float, bool)):
        pred = str(pred)  # keeps results small and always picklable
    return score, acc, pred


# One result per sample: (score, acc, pred, error message or None).
SampleResult = tuple[float, bool, Any, Optional[str]]


@dataclass
class Chunk:
    """Work for one message: texts, or token ids for the worker to decode, plus the labels."""

    ground_truths: list[str]
    extras: Optional[list[Optional[dict[str, Any]]]]
    keywords: dict[str, Any]
    """Keyword arguments of every sample (``validating=``)."""
    texts: Optional[list[str]] = None
    flat_ids: Optional[np.ndarray] = None
    offsets: Optional[np.ndarray] = None


def score_texts(
    function: Callable[..., Any],
    texts: Sequence[str],
    ground_truths: Sequence[str],
    extras: Optional[Sequence[Optional[dict[str, Any]]]],
    common_kwargs: dict[str, Any],
    clock: Optional[SampleClock] = None,
) -> list[SampleResult]:
    """Score in order; exceptions become error results. `clock`: a worker's, told as each sample starts."""
    results: list[SampleResult] = []
    for position, (text, ground_truth) in enumerate(zip(texts, ground_truths)):
        if clock is not None:
            clock.start(position)
        try:
            extra = extras[position] if extras is not None else None
            kwargs = common_kwargs if extra is None else {**common_kwargs, **extra}
            score, acc, pred = interpret(function(text, ground_truth, **kwargs))
            results.append((score, acc, pred, None))
        except Exception as error:  # any failure of user code is a failed sample, never a failed step
            results.append((math.nan, False, None, f"{type(error).__name__}: {error}"))
    return results


# --------------------------------------------------------------------------------------------
# What a worker runs
# --------------------------------------------------------------------------------------------


@dataclass
class ScoringTask:
    """A worker's task (`pool.WorkerPool`): a reference to load (or the function itself) and,
    optionally, the tokenizer; both loaded once per worker, on its first chunk."""

    ref: Optional[RewardFunctionRef]
    function: Optional[Callable[..., Any]]
    tokenizer_pickle: Optional[bytes]
    _loaded_function: Optional[Callable[..., Any]] = field(default=None, init=False, repr=False)
    _tokenizer: Any = field(default=None, init=False, repr=False)

    def __call__(self, chunk: Chunk, clock: SampleClock) -> list[tuple[SampleResult, Optional[str]]]:
        """(result, decoded text or None where the chunk brought texts) per sample of the chunk."""
        step = "loading the reward function"
        try:
            if self._loaded_function is None:
                self._loaded_function = self.ref.load() if self.ref is not None else self.function
            texts = chunk.texts
            if texts is None:
                step = "loading the tokenizer"
                if self._tokenizer is None:
                    self._tokenizer = pickle.loads(self.tokenizer_pickle)  # type: ignore[arg-type]
                step = "decoding"
                bounds = chunk.offsets.tolist()  # type: ignore[union-attr]
                rows = [chunk.flat_ids[bounds[i] : bounds[i + 1]] for i in range(len(chunk.ground_truths))]  # type: ignore[index]
                texts = batch_decode(self._tokenizer, rows)
        except Exception as error:
            # Not a per-sample failure: this worker cannot do any work, and neither could the next.
            raise WorkerCannotWork(
                f"{step} in a reward worker failed: {type(error).__name__}: {error}. The parent process loaded the "
                "same function and tokenizer, so the workers see a different environment (sys.path, files); "
                "RewardManager(decode_in_workers=False) keeps decoding in the parent"
            ) from error
        results = score_texts(self._loaded_function, texts, chunk.ground_truths, chunk.extras, chunk.keywords, clock)  # type: ignore[arg-type]
        decoded = chunk.texts is None
        return [(result, text if decoded else None) for result, text in zip(results, texts)]
