"""Score a whole batch of responses: decode, rule scoring (in worker processes, `pool.py`), the
overlong penalty added once.

Where the time goes (see docs/PERF.md): for the DAPO math reward, decoding the token ids costs
four to five times as much as scoring the text, so a pool that only scores saves little. With
worker processes, each chunk therefore travels as token ids (a flat integer array plus
offsets: cheap to send) and the worker decodes it with its own copy of the tokenizer (one batched
``batch_decode`` call per chunk) before scoring; decoded text comes back for logging. When the
tokenizer cannot be pickled, or with ``num_workers=0``, the parent decodes the whole batch in one
batched call instead.

A reward function must never crash or stall the step: one that raises gives that sample
`min_reward` and a warning on the ``megatron_dapo.reward`` logger; one that hangs or kills its
worker is stopped by the pool (`pool.WorkerPool`: per-sample timeout, worker replaced) and its
sample gets `min_reward` too. Functions travel to the workers by reference; functions loaded from
a file (`loader.load_reward_function`) travel as file path + name and are loaded again in each
worker on first use.
"""

from __future__ import annotations

import itertools
import logging
import math
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import numpy as np
import torch

from megatron_dapo.reward.loader import RewardFunctionRef, load_reward_function, reward_function_ref
from megatron_dapo.reward.overlong import overlong_penalty, validate_overlong_settings
from megatron_dapo.reward.pool import WorkerPool, default_start_method
from megatron_dapo.reward.scoring import Chunk, SampleResult, ScoringTask, accepted_keywords, batch_decode, score_texts

__all__ = ["RewardManager", "RewardResult"]

logger = logging.getLogger("megatron_dapo.reward")

ScoreFunction = Callable[..., Union[float, dict]]

# Per call, at most this many failures are logged one by one; the rest are summed up in one line.
_MAX_FAILURE_LOGS = 10


# --------------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------------


@dataclass
class RewardResult:
    """Rewards of one batch; every tensor is ``[B]`` on CPU."""

    scores: torch.Tensor
    """float32: the reward used for advantages, raw score (or `min_reward`) + overlong penalty."""
    raw_scores: torch.Tensor
    """float32: the reward function's score before the penalty (`min_reward` where it failed)."""
    acc: torch.Tensor
    """bool: the reward function's correctness, never shaped (False where it failed)."""
    preds: list[Any]
    """The reward function's extracted prediction per sample (None where it gave none)."""
    overlong_penalty: torch.Tensor
    """float32: the penalty included in `scores` (zeros when not applied)."""
    failed: torch.Tensor
    """bool: the reward function raised, returned something unusable or timed out."""
    responses: list[str]
    """Decoded responses (special tokens skipped)."""
    errors: list[Optional[str]] = field(default_factory=list)
    """Per sample: why the reward function failed ("ValueError: ...", a timeout, a crash), None where it
    scored. Travels with the samples so that dynamic sampling can name failures as the cause when
    every group looks all wrong (`algorithm.sampling.DynamicSamplingBuffer`)."""


# --------------------------------------------------------------------------------------------
# Token ids of a batch
# --------------------------------------------------------------------------------------------


class _TokenBatch:
    """Valid token ids of every response, as python lists or as flat arrays for a chunk."""

    def __init__(
        self,
        response_ids: Union[torch.Tensor, Sequence[Sequence[int]]],
        response_lengths: Union[torch.Tensor, Sequence[int], None],
    ) -> None:
        self._rows: Optional[list[list[int]]] = None
        self._padded: Optional[np.ndarray] = None
        if isinstance(response_ids, torch.Tensor):
            if response_ids.dim() != 2 or response_ids.dtype.is_floating_point or response_ids.dtype == torch.bool:
                raise ValueError(
                    "response_ids must be a [B, T] integer tensor, "
                    f"got {response_ids.dtype} {tuple(response_ids.shape)}"
                )
            if response_lengths is None:
                raise ValueError("response_lengths is required with a padded response_ids tensor")
            self.lengths = self._check_lengths(response_lengths, [response_ids.shape[1]] * response_ids.shape[0])
            self._padded = response_ids.detach().cpu().to(torch.int64).numpy()
        else:
            rows = [r.tolist() if isinstance(r, torch.Tensor) else list(r) for r in response_ids]
            if response_lengths is None:
                self.lengths = [len(r) for r in rows]
            else:
                self.lengths = self._check_lengths(response_lengths, [len(r) for r in rows])
                rows = [row if n == len(row) else row[:n] for row, n in zip(rows, self.lengths)]
            self._rows = rows

    @staticmethod
    def _check_lengths(response_lengths: Union[torch.Tensor, Sequence[int]], limits: list[int]) -> list[int]:
        values = response_lengths.tolist() if isinstance(response_lengths, torch.Tensor) else response_lengths
        lengths = [int(n) for n in values]
        if len(lengths) != len(limits):
            raise ValueError(f"response_lengths has {len(lengths)} entries for {len(limits)} responses")
        for index, (length, limit) in enumerate(zip(lengths, limits)):
            if not 0 <= length <= limit:
                raise ValueError(f"response_lengths[{index}]={length} is outside [0, {limit}]")
        return lengths

    def __len__(self) -> int:
        return len(self.lengths)

    def rows(self, indices: Optional[Sequence[int]] = None) -> list[Union[np.ndarray, list[int]]]:
        """Token ids of all responses (or those at `indices`): array views or the lists given."""
        if indices is None:
            indices = range(len(self))
        if self._rows is not None:
            return [self._rows[i] for i in indices]
        assert self._padded is not None
        return [self._padded[i, : self.lengths[i]] for i in indices]

    def take(self, indices: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """(flat int64 ids, offsets) of the responses at `indices`: a compact message for a worker."""
        offsets = np.zeros(len(indices) + 1, dtype=np.int64)
        np.cumsum([self.lengths[i] for i in indices], out=offsets[1:])
        if self._padded is not None:
            parts = [self._padded[i, : self.lengths[i]] for i in indices]
            flat = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        else:
            assert self._rows is not None
            rows = self._rows
            chained = itertools.chain.from_iterable(rows[i] for i in indices)
            flat = np.fromiter(chained, dtype=np.int64, count=int(offsets[-1]))
        return flat, offsets


# --------------------------------------------------------------------------------------------
# The manager
# --------------------------------------------------------------------------------------------


class RewardManager:
    """Decode, score and shape the rewards of a batch of responses.

    Args:
        tokenizer: anything with ``batch_decode(list_of_id_lists, skip_special_tokens=True)``.
        score_fn: ``(response, ground_truth, **extra) -> float | dict`` (dict: ``"score"`` and
            optional ``"acc"``/``"pred"``; without ``"acc"``, acc = score > 0); or a
            `loader.load_reward_function` spec string; None = `math_dapo.compute_score`. A
            function that names ``validating``, ``data_source`` or ``extra_info`` (or takes
            ``**kwargs``) receives them; the signature is inspected once, here.
        num_workers: scoring processes; 0 scores serially in this process (then a hanging reward
            function cannot be interrupted: use workers for untrusted functions).
        timeout_s: per-sample limit enforced on the workers (see the module docstring).
        overlong_enable, overlong_buffer_length, overlong_penalty_factor, max_response_length:
            the soft overlong punishment (`overlong.overlong_penalty`).
        min_reward: score of a sample whose reward function raised, returned garbage or timed out.
        chunk_size: samples per message to a worker; None picks one (`pool.default_chunk_size`).
        decode_in_workers: workers decode token ids themselves (None: when there are workers and
            the tokenizer pickles); False: the parent decodes the batch in one batched call.
        start_method: multiprocessing start method; None = 'forkserver' where available, else 'spawn'.
    """

    def __init__(
        self,
        tokenizer: Any,
        score_fn: Union[ScoreFunction, str, None] = None,
        *,
        num_workers: int = 0,
        timeout_s: float = 10.0,
        overlong_enable: bool = False,
        overlong_buffer_length: int = 0,
        overlong_penalty_factor: float = 1.0,
        max_response_length: Optional[int] = None,
        min_reward: float = -1.0,
        chunk_size: Optional[int] = None,
        decode_in_workers: Optional[bool] = None,
        start_method: Optional[str] = None,
    ) -> None:
        if num_workers < 0:
            raise ValueError(f"'reward.num_workers' must be >= 0, got {num_workers}")
        if not timeout_s > 0:
            raise ValueError(f"'reward.timeout_s' must be > 0, got {timeout_s}")
        if not math.isfinite(min_reward):
            raise ValueError(f"'reward.min_reward' must be finite, got {min_reward}")
        if chunk_size is not None and chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
        if overlong_enable:
            if max_response_length is None:
                raise ValueError("the overlong penalty needs 'rollout.max_response_length'")
            validate_overlong_settings(max_response_length, overlong_buffer_length, overlong_penalty_factor)

        self.tokenizer = tokenizer
        if score_fn is None or isinstance(score_fn, str):
            score_fn = load_reward_function(score_fn)
        if not callable(score_fn):
            raise ValueError(f"score_fn must be callable or a 'module:function' string, got {type(score_fn).__name__}")
        self.score_fn: ScoreFunction = score_fn
        self._accepted = accepted_keywords(score_fn)
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self.overlong_enable = overlong_enable
        self.overlong_buffer_length = overlong_buffer_length
        self.overlong_penalty_factor = overlong_penalty_factor
        self.max_response_length = max_response_length
        self.min_reward = float(min_reward)
        self.chunk_size = chunk_size
        self.start_method = start_method or default_start_method()

        self._task: Optional[ScoringTask] = None
        if num_workers > 0:
            ref, function = self._function_for_workers(score_fn)
            self._task = ScoringTask(ref, function, self._tokenizer_for_workers(decode_in_workers))
        self.decode_in_workers = self._task is not None and self._task.tokenizer_pickle is not None
        self._pool: Optional[WorkerPool] = None
        self.samples_scored = 0
        """Samples scored by this manager so far."""
        self.samples_failed = 0
        """Of those, samples whose reward function raised, returned something unusable or timed out."""
        self.first_failure: Optional[str] = None
        """The first failure's reason ("ValueError: ..."), for the message that names failures as a cause."""

    @staticmethod
    def _function_for_workers(function: ScoreFunction) -> tuple[Optional[RewardFunctionRef], Optional[ScoreFunction]]:
        ref = reward_function_ref(function)
        if ref is not None:
            return ref, None
        try:
            pickle.dumps(function)
        except Exception as error:
            raise ValueError(
                f"reward function {function!r} cannot be sent to worker processes ({error}); define it at module "
                "level, give it as 'module:function' or '/path/file.py:function', or use num_workers=0"
            ) from error
        return None, function

    def _tokenizer_for_workers(self, decode_in_workers: Optional[bool]) -> Optional[bytes]:
        if decode_in_workers is False:
            return None
        try:
            return pickle.dumps(self.tokenizer)
        except Exception as error:
            if decode_in_workers:
                raise ValueError(f"decode_in_workers=True but the tokenizer cannot be pickled: {error}") from error
            logger.info("tokenizer cannot be pickled (%s); the parent process will decode", error)
            return None

    # -- lifecycle ---------------------------------------------------------------------------

    def _ensure_pool(self) -> WorkerPool:
        if self._pool is None:
            assert self._task is not None
            # The forkserver imports the task's module (`scoring`, without torch) and the tokenizer's once
            # for all workers.
            preload = [ScoringTask.__module__] + ([type(self.tokenizer).__module__] if self.decode_in_workers else [])
            self._pool = WorkerPool(self.num_workers, self._task, self.timeout_s, self.start_method, preload)
        return self._pool

    def close(self) -> None:
        """Stop the worker processes (a later `score` starts new ones)."""
        if self._pool is not None:
            self._pool.close()
            self._pool = None

    def __enter__(self) -> "RewardManager":
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    # -- scoring -----------------------------------------------------------------------------

    def score(
        self,
        response_ids: Union[torch.Tensor, Sequence[Sequence[int]]],
        ground_truths: Sequence[str],
        response_lengths: Union[torch.Tensor, Sequence[int], None] = None,
        data_sources: Optional[Sequence[Any]] = None,
        extra_infos: Optional[Sequence[Any]] = None,
        validating: bool = False,
        apply_overlong: bool = True,
    ) -> RewardResult:
        """Score a batch.

        Args:
            response_ids: a right-padded ``[B, T]`` integer tensor (then `response_lengths` is
                required) or B sequences of token ids (each cut to its length when lengths are given).
            ground_truths: B ground-truth strings.
            response_lengths: B valid token counts; these also drive the overlong penalty.
            data_sources, extra_infos: optional per-sample values for functions that accept them
                (as ``data_source=`` / ``extra_info=``).
            validating: passed as ``validating=`` to functions that accept it.
            apply_overlong: add the overlong penalty (if enabled); set it from
                ``algorithm.overlong_buffer.apply_in_validation`` for validation batches.
        """
        tokens = _TokenBatch(response_ids, response_lengths)
        count = len(tokens)
        named = (("ground_truths", ground_truths), ("data_sources", data_sources), ("extra_infos", extra_infos))
        for label, values in named:
            if values is not None and len(values) != count:
                raise ValueError(f"{label} has {len(values)} entries for {count} responses")
        ground_truths = list(ground_truths)
        common: dict[str, Any] = {"validating": validating} if "validating" in self._accepted else {}
        extras = self._per_sample_kwargs(count, data_sources, extra_infos)

        lost: dict[int, str] = {}
        if count == 0:
            responses: list[str] = []
            results: list[Optional[SampleResult]] = []
        elif self.num_workers == 0:
            responses = batch_decode(self.tokenizer, tokens.rows())
            results = list(score_texts(self.score_fn, responses, ground_truths, extras, common))
        elif self.decode_in_workers:

            def build(indices: list[int]) -> Chunk:
                flat, offsets = tokens.take(indices)
                labels = [ground_truths[i] for i in indices]
                return Chunk(labels, _pick(extras, indices), common, flat_ids=flat, offsets=offsets)

            outputs, lost = self._ensure_pool().run(count, build, self.chunk_size)
            results = [None if output is None else output[0] for output in outputs]
            texts = [None if output is None else output[1] for output in outputs]
            missing = [i for i, text in enumerate(texts) if text is None]
            if missing:  # samples lost with a timed-out or crashed worker
                for index, text in zip(missing, batch_decode(self.tokenizer, tokens.rows(missing))):
                    texts[index] = text
            responses = texts  # type: ignore[assignment]
        else:
            responses = batch_decode(self.tokenizer, tokens.rows())

            def build(indices: list[int]) -> Chunk:
                labels = [ground_truths[i] for i in indices]
                return Chunk(labels, _pick(extras, indices), common, texts=[responses[i] for i in indices])

            outputs, lost = self._ensure_pool().run(count, build, self.chunk_size)
            results = [None if output is None else output[0] for output in outputs]

        return self._assemble(results, lost, responses, tokens.lengths, apply_overlong)

    def _per_sample_kwargs(
        self, count: int, data_sources: Optional[Sequence[Any]], extra_infos: Optional[Sequence[Any]]
    ) -> Optional[list[Optional[dict[str, Any]]]]:
        pass_source = data_sources is not None and "data_source" in self._accepted
        pass_info = extra_infos is not None and "extra_info" in self._accepted
        if not (pass_source or pass_info):
            return None
        extras: list[Optional[dict[str, Any]]] = []
        for index in range(count):
            extra: dict[str, Any] = {}
            if pass_source:
                extra["data_source"] = data_sources[index]  # type: ignore[index]
            if pass_info:
                extra["extra_info"] = extra_infos[index]  # type: ignore[index]
            extras.append(extra)
        return extras

    def _assemble(
        self,
        results: list[Optional[SampleResult]],
        lost: dict[int, str],
        responses: list[str],
        lengths: list[int],
        apply_overlong: bool,
    ) -> RewardResult:
        count = len(results)
        # Python lists first, one tensor each at the end (item-wise tensor writes cost ~5 us apiece).
        raw_list: list[float] = [self.min_reward] * count
        acc_list: list[bool] = [False] * count
        failed_list: list[bool] = [False] * count
        preds: list[Any] = [None] * count
        failures: list[tuple[int, str]] = []
        for index, result in enumerate(results):
            if result is None or result[3] is not None:
                failed_list[index] = True
                failures.append((index, lost.get(index) or (result[3] if result is not None else "no result")))
            else:
                raw_list[index], acc_list[index], preds[index] = result[0], result[1], result[2]
        raw = torch.tensor(raw_list, dtype=torch.float64)
        acc = torch.tensor(acc_list, dtype=torch.bool)
        failed = torch.tensor(failed_list, dtype=torch.bool)
        errors: list[Optional[str]] = [None] * count
        for index, reason in failures:
            errors[index] = reason
        self.samples_scored += count
        self.samples_failed += len(failures)
        if failures and self.first_failure is None:
            self.first_failure = failures[0][1]
        for index, reason in failures[:_MAX_FAILURE_LOGS]:
            logger.warning(
                "reward function failed on sample %d: %s; it gets min_reward=%g", index, reason, self.min_reward
            )
        if len(failures) > _MAX_FAILURE_LOGS:
            logger.warning("reward function failed on %d of %d samples in this batch", len(failures), count)

        if self.overlong_enable and apply_overlong and count:
            assert self.max_response_length is not None
            penalty = overlong_penalty(
                lengths,
                self.max_response_length,
                self.overlong_buffer_length,
                self.overlong_penalty_factor,
                dtype=torch.float64,
            )
        else:
            penalty = torch.zeros(count, dtype=torch.float64)
        # Summed in float64 and rounded once, like verl's python-float reward written to a float32 tensor.
        return RewardResult(
            scores=(raw + penalty).to(torch.float32),
            raw_scores=raw.to(torch.float32),
            acc=acc,
            preds=preds,
            overlong_penalty=penalty.to(torch.float32),
            failed=failed,
            responses=responses,
            errors=errors,
        )


def _pick(values: Optional[list[Any]], indices: list[int]) -> Optional[list[Any]]:
    return None if values is None else [values[i] for i in indices]
