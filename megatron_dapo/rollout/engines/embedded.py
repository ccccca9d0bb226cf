"""The embedded rollout engine: batched sampling with a plain HF transformers model.

No extra dependency: this is the default engine on CPU (CI, the tiny demo) and on a GPU machine where
neither vLLM nor SGLang is installed. The decode loop is our own (not `model.generate`) so that we
control every detail the trainer relies on:

- prompts are left-padded, with position ids counting real tokens only (a padded prompt gives the
  logits of the same prompt alone, up to rounding);
- each prompt is prefilled once, then its KV cache is repeated for its `n` samples;
- finished rows leave the running batch (their KV-cache rows are dropped, in batches of a quarter of
  the rows) so that a few long responses do not pay for the many short ones;
- weight pushes may land between two decode steps (`generate(..., pushes=)`, partial rollouts): the
  running rows continue with the new weights, their KV cache recomputed with them (one prefill of
  prompt + response so far), so no token is ever computed from a mix of versions;
- the log-prob of each sampled token is taken under the temperature-scaled FULL distribution,
  `log_softmax(logits / T)`, before top-k / top-p filtering. That is what the actor recomputes
  (`log_softmax(logits / T)` over the whole vocabulary), so rollout and actor log-probs are
  comparable token by token. vLLM's default (`logprobs_mode="raw_logprobs"`, V1) is instead the
  log-prob under the raw logits (T = 1, before any processing), and its `processed_logprobs` mode is
  after temperature AND top-k/top-p renormalisation; both agree with ours when T = 1 and no top-k /
  top-p filtering is used (the DAPO recipe's setting). Greedy decoding (T = 0) reports
  `log_softmax(logits)`, i.e. T = 1, like vLLM's raw mode.

Usage:
    engine = EmbeddedEngine(hf_dir, dtype=torch.bfloat16, device="cuda", max_batch_tokens=65536)
    out = engine.generate(prompt_ids, SamplingParams(n=8, temperature=1.0, max_new_tokens=512, seed=0))
    engine.load_weights(actor_hf_named_tensors)
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional, Sequence, Union

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

from megatron_dapo.model.hf_routing import RoutingRecorder
from megatron_dapo.model.hf_experts import expert_slot, is_fused_experts, slots_per_fused, unfused_experts
from megatron_dapo.rollout.base import (
    GenerationOutput, RolloutEngine, SamplingParams, VersionSpans, WeightPushes, check_memory_tags, version_spans,
)  # fmt: skip

FINISH_STOP = "stop"
FINISH_LENGTH = "length"

# Finished rows are dropped from the running batch (a KV-cache copy) once they make up this share
# of it; below that, computing a few dead rows is cheaper than copying the cache at every finish.
_COMPACT_FRACTION = 0.25


# --------------------------------------------------------------------------------------------------
# Sampling
# --------------------------------------------------------------------------------------------------


def filter_top_k_top_p(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Set the logits outside the top-k, then outside the top-p nucleus, to -inf (rows independent).

    Top-p keeps the smallest set of most likely tokens whose probability reaches `top_p` (the most
    likely token is always kept), computed on the distribution left after top-k, as vLLM does.
    """
    if top_k != -1 and top_k < logits.shape[-1]:
        kth_largest = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if top_p < 1.0:
        sorted_logits, sorted_index = torch.sort(logits, dim=-1, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # Probability mass strictly before each token: a token is kept while that mass is < top_p.
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop_sorted = mass_before >= top_p
        drop_sorted[..., 0] = False
        drop = torch.zeros_like(drop_sorted).scatter(-1, sorted_index, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def sample_next_tokens(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Pick one token per row of float32 `logits` [rows, vocab]; return (tokens, log-probs or None).

    Temperature 0 is greedy. The log-prob is `log_softmax(logits / T)` of the chosen token over the
    full vocabulary, before top-k/top-p (module docstring explains why); T = 1 for greedy.
    """
    if params.temperature == 0:
        tokens = torch.argmax(logits, dim=-1)
        scaled = logits
    else:
        scaled = logits / params.temperature
        filtered = filter_top_k_top_p(scaled, params.top_k, params.top_p)
        probs = torch.softmax(filtered, dim=-1)
        tokens = torch.multinomial(probs, num_samples=1, generator=generator).squeeze(-1)
    if not params.logprobs:
        return tokens, None
    log_probs = torch.log_softmax(scaled, dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return tokens, log_probs


# --------------------------------------------------------------------------------------------------
# Batching
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _RowGroup:
    """`count` samples of one prompt, numbered `first_sample`.. within that prompt's n."""

    prompt_index: int
    first_sample: int
    count: int


def plan_sub_batches(
    prompt_lengths: Sequence[int], n: int, max_new_tokens: int, max_batch_tokens: Optional[int]
) -> list[list[_RowGroup]]:
    """Split prompt x n rows into sub-batches of at most `max_batch_tokens` padded tokens each.

    A sub-batch costs rows x (longest prompt + max_new_tokens), the size of its KV cache at the
    end. Prompts are taken longest first so that prompts of similar length share a sub-batch (less
    padding); a prompt whose n rows do not fit alone is split across sub-batches. A single row is
    always allowed, even over the budget (it cannot be made smaller).
    """
    if max_batch_tokens is None:
        return [[_RowGroup(index, 0, n) for index in range(len(prompt_lengths))]]
    order = sorted(range(len(prompt_lengths)), key=lambda index: -prompt_lengths[index])
    batches: list[list[_RowGroup]] = []
    current: list[_RowGroup] = []
    current_rows = 0
    current_width = 0
    for index in order:
        width = prompt_lengths[index] + max_new_tokens
        remaining = n
        while remaining > 0:
            # Longest first: the batch's width is that of its first prompt, so `width` never grows it.
            batch_width = current_width if current else width
            fit = max_batch_tokens // batch_width - current_rows
            if fit <= 0 and current:
                batches.append(current)
                current, current_rows, current_width = [], 0, 0
                continue
            take = min(remaining, max(fit, 1))
            current.append(_RowGroup(index, n - remaining, take))
            current_rows += take
            current_width = batch_width
            remaining -= take
    if current:
        batches.append(current)
    return batches


def left_pad(prompts: Sequence[Sequence[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask, position_ids) [rows, longest] for left-padded prompts.

    Positions count real tokens only, so each prompt's first token is at position 0 whatever its padding.
    """
    width = max(len(prompt) for prompt in prompts)
    input_ids = torch.zeros(len(prompts), width, dtype=torch.long)
    attention_mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        if len(prompt):
            input_ids[row, width - len(prompt) :] = torch.as_tensor(list(prompt), dtype=torch.long)
            attention_mask[row, width - len(prompt) :] = 1
    position_ids = (attention_mask.cumsum(dim=-1) - 1).clamp(min=0)
    return input_ids.to(device), attention_mask.to(device), position_ids.to(device)


# --------------------------------------------------------------------------------------------------
# The engine
# --------------------------------------------------------------------------------------------------


def _as_id_list(value) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(token) for token in value]


class EmbeddedEngine(RolloutEngine):
    """A rollout engine running an HF causal LM in this process (see the module docstring).

    Args:
        hf_dir_or_model: an HF model directory, or an already built HF causal LM (used in place,
            moved to `device` and `dtype`, not copied).
        dtype: parameter dtype of the model (sampling math is always float32).
        device: where to run; default CUDA when available, else CPU.
        eos_token_ids: tokens that end a response; default: the generation config's EOS, the
            model config's EOS and the tokenizer's EOS (whichever exist).
        max_batch_tokens: bound on rows x (longest prompt + max_new_tokens) per sub-batch.
        tokenizer: used for stop strings only; default: loaded from `hf_dir_or_model` when it is a
            directory holding a tokenizer.
    """

    def __init__(
        self,
        hf_dir_or_model: Union[str, Path, torch.nn.Module],
        dtype: torch.dtype = torch.float32,
        device: Union[str, torch.device, None] = None,
        eos_token_ids: Optional[Sequence[int]] = None,
        max_batch_tokens: Optional[int] = None,
        tokenizer=None,
    ) -> None:
        if max_batch_tokens is not None and max_batch_tokens < 1:
            raise ValueError(f"max_batch_tokens must be >= 1 or None, got {max_batch_tokens}")
        self.device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = dtype
        self.max_batch_tokens = max_batch_tokens
        if isinstance(hf_dir_or_model, torch.nn.Module):
            model = hf_dir_or_model
        else:
            model = AutoModelForCausalLM.from_pretrained(str(hf_dir_or_model), dtype=dtype)
            if tokenizer is None:
                tokenizer = _load_tokenizer_if_present(Path(hf_dir_or_model))
        self.model = model.to(device=self.device, dtype=dtype).eval()
        self.tokenizer = tokenizer
        self.eos_token_ids = (
            tuple(int(token) for token in eos_token_ids)
            if eos_token_ids is not None
            else self._default_eos_token_ids(self.model, tokenizer)
        )
        self._params_by_name = dict(self.model.named_parameters(remove_duplicate=False))
        self._loaded_params: set[int] = set()
        # Fused expert parameters (transformers' MoE layout) fill slice by slice: the slots loaded so far.
        self._loaded_expert_slots: dict[int, set] = {}
        self._asleep = False

    @staticmethod
    def _default_eos_token_ids(model: torch.nn.Module, tokenizer) -> tuple[int, ...]:
        ids: list[int] = []
        generation_config = getattr(model, "generation_config", None)
        ids += _as_id_list(getattr(generation_config, "eos_token_id", None))
        ids += _as_id_list(getattr(model.config, "eos_token_id", None))
        if tokenizer is not None:
            ids += _as_id_list(getattr(tokenizer, "eos_token_id", None))
        return tuple(dict.fromkeys(ids))

    def _check_usable(self) -> None:
        if self.model is None:
            raise RuntimeError("EmbeddedEngine was shut down")
        if self._asleep:
            raise RuntimeError("EmbeddedEngine is asleep: call wake_up() before generating")

    # ---------------------------------------------------------------------------------- generation

    takes_pushes_while_generating = True

    def generate(
        self, prompt_ids: Sequence[Sequence[int]], params: SamplingParams, pushes: Optional[WeightPushes] = None
    ) -> GenerationOutput:
        """Sample `params.n` responses per prompt; outputs prompt-major (see `GenerationOutput`).

        `pushes`: weight pushes that may land while this call decodes (`WeightPushes`): asked before
        each sub-batch and between any two decode steps; a push received there is loaded in place,
        the running rows' KV cache is recomputed with the new weights, and the outputs carry each
        response's `weight_versions`."""
        self._check_usable()
        if pushes is not None and params.return_routed_experts:
            raise ValueError("routed experts are not recorded across weight pushes: pass pushes or return_routed_experts, not both")
        if any(len(prompt) == 0 for prompt in prompt_ids):
            raise ValueError("every prompt needs at least one token")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer: pass tokenizer= to EmbeddedEngine")
        if len(prompt_ids) == 0:
            return GenerationOutput(
                prompt_index=[], response_ids=[], truncated=torch.zeros(0, dtype=torch.bool),
                log_probs=[] if params.logprobs else None, finish_reasons=[],
                routed_experts=[] if params.return_routed_experts else None,
            )
        generator = torch.Generator(device=self.device)
        if params.seed is not None:
            generator.manual_seed(params.seed)
        else:
            generator.seed()

        num_responses = len(prompt_ids) * params.n
        responses: list[Optional[list[int]]] = [None] * num_responses
        log_probs: list[Optional[torch.Tensor]] = [None] * num_responses
        routing: list[Optional[torch.Tensor]] = [None] * num_responses
        reasons: list[str] = [""] * num_responses
        versions: list[Optional[VersionSpans]] = [None] * num_responses
        lengths = [len(prompt) for prompt in prompt_ids]
        for groups in plan_sub_batches(lengths, params.n, params.max_new_tokens, self.max_batch_tokens):
            slots = [
                group.prompt_index * params.n + group.first_sample + k for group in groups for k in range(group.count)
            ]
            batch_prompts = [prompt_ids[group.prompt_index] for group in groups]
            counts = [group.count for group in groups]
            landed: list[tuple[int, int]] = []  # (tokens every running row had, version): pushes in this sub-batch
            if pushes is not None and pushes.pending():  # between two sub-batches: nothing to recompute
                self._receive_push(pushes)
            start_version = pushes.version if pushes is not None else 0
            with torch.no_grad():
                batch_tokens, batch_log_probs, batch_reasons, batch_routing = self._generate_sub_batch(
                    batch_prompts, counts, params, generator, pushes, landed
                )
            for row, slot in enumerate(slots):
                if pushes is not None:
                    versions[slot] = version_spans(start_version, landed, len(batch_tokens[row]))
                responses[slot] = batch_tokens[row]
                log_probs[slot] = batch_log_probs[row] if params.logprobs else None
                reasons[slot] = batch_reasons[row]
                routing[slot] = batch_routing[row] if batch_routing is not None else None

        return GenerationOutput(
            prompt_index=[index for index in range(len(prompt_ids)) for _ in range(params.n)],
            response_ids=responses,  # type: ignore[arg-type]
            truncated=torch.tensor([reason == FINISH_LENGTH for reason in reasons], dtype=torch.bool),
            log_probs=log_probs if params.logprobs else None,  # type: ignore[arg-type]
            finish_reasons=reasons,
            routed_experts=routing if params.return_routed_experts else None,  # type: ignore[arg-type]
            weight_versions=versions if pushes is not None else None,  # type: ignore[arg-type]
        )

    def _receive_push(self, pushes: WeightPushes) -> int:
        """Load the waiting push in place (no forward pass runs now); the new version."""
        return pushes.receive(self.load_weights, lambda: None)

    def _generate_sub_batch(
        self,
        prompts: Sequence[Sequence[int]],
        counts: Sequence[int],
        params: SamplingParams,
        generator: torch.Generator,
        pushes: Optional[WeightPushes] = None,
        landed: Optional[list[tuple[int, int]]] = None,
    ) -> tuple[list[list[int]], list[torch.Tensor], list[str], Optional[list[torch.Tensor]]]:
        """Decode `counts[i]` samples of `prompts[i]`; rows in order (prompt 0's samples first).
        A push received between two decode steps is appended to `landed` as (tokens of every
        running row, the version it brought)."""
        device = self.device
        input_ids, attention_mask, position_ids = left_pad(prompts, device)
        cache = _new_cache(self.model)
        # Routing of every token the model reads: the prefill's, then one token per row per decode step.
        recorder = RoutingRecorder(self.model) if params.return_routed_experts else contextlib.nullcontext()
        # Prefill each distinct prompt once; only the last position's logits are needed.
        with recorder:
            out = self.model(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
            )
        prompt_routing = recorder.take(*input_ids.shape) if params.return_routed_experts else None
        expand = torch.repeat_interleave(
            torch.arange(len(prompts), device=device), torch.as_tensor(list(counts), device=device)
        )
        cache.batch_select_indices(expand)
        logits = out.logits[:, -1, :].float()[expand]
        attention_mask = attention_mask[expand]
        next_position = position_ids[expand, -1] + 1
        del out

        num_rows = int(expand.numel())
        max_new = params.max_new_tokens
        stop_ids = torch.tensor(
            sorted(set(self.eos_token_ids) | set(params.stop_token_ids)), dtype=torch.long, device=device
        )
        max_stop_bytes = max((len(text.encode("utf-8")) for text in params.stop), default=0)
        # Outputs stay on the device until the end; the only per-step host sync is "how many alive?".
        out_tokens = torch.zeros(num_rows, max_new, dtype=torch.long, device=device)
        out_log_probs = torch.zeros(num_rows, max_new, dtype=torch.float32, device=device)
        response_lengths = torch.full((num_rows,), max_new, dtype=torch.long, device=device)
        stopped = torch.zeros(num_rows, dtype=torch.bool, device=device)
        if prompt_routing is not None:
            response_routing = torch.zeros(num_rows, max_new, *prompt_routing.shape[2:], dtype=torch.int32, device=device)

        # `live` maps each row of the running batch to its output row; `alive` marks the rows still
        # decoding (a finished row stays in the batch, ignored, until the next compaction). Every
        # alive row has exactly `step` tokens at the start of a step, so `step` is the write column.
        live = torch.arange(num_rows, device=device)
        alive = torch.ones(num_rows, dtype=torch.bool, device=device)
        for step in range(max_new):
            tokens, token_log_probs = sample_next_tokens(logits, params, generator)
            rows = live[alive]
            out_tokens[rows, step] = tokens[alive]
            if token_log_probs is not None:
                out_log_probs[rows, step] = token_log_probs[alive]
            hit = torch.isin(tokens, stop_ids) & alive
            if params.stop:
                hit |= self._stop_string_hits(out_tokens, live, alive, step, params.stop, max_stop_bytes)
            stopped[live[hit]] = True
            response_lengths[live[hit]] = step + 1
            alive = alive & ~hit
            num_alive = int(alive.sum())
            if num_alive == 0 or step + 1 == max_new:
                break  # rows still alive end by length, with max_new tokens

            next_tokens = tokens
            if live.numel() - num_alive >= max(1, math.ceil(_COMPACT_FRACTION * live.numel())):
                keep = alive.nonzero().squeeze(-1)
                cache.batch_select_indices(keep)
                live, alive, next_tokens = live[keep], alive[keep], tokens[keep]
                attention_mask, next_position = attention_mask[keep], next_position[keep]
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones(attention_mask.shape[0], 1)], dim=-1)
            if pushes is not None and pushes.pending():
                # Every running row has step + 1 tokens; the next one is sampled with the new weights,
                # from a KV cache recomputed with them (prompt + response so far, one prefill).
                landed.append((step + 1, self._receive_push(pushes)))
                cache = _new_cache(self.model)
                sequences = torch.cat([input_ids[expand[live]], out_tokens[live, : step + 1]], dim=-1)
                out = self.model(
                    input_ids=sequences,
                    attention_mask=attention_mask,
                    position_ids=(attention_mask.cumsum(dim=-1) - 1).clamp(min=0),
                    past_key_values=cache,
                    use_cache=True,
                    logits_to_keep=1,
                )
                logits = out.logits[:, -1, :].float()
                next_position = next_position + 1
                del out
                continue
            with recorder:
                out = self.model(
                    input_ids=next_tokens.unsqueeze(-1),
                    attention_mask=attention_mask,
                    position_ids=next_position.unsqueeze(-1),
                    past_key_values=cache,
                    use_cache=True,
                )
            if prompt_routing is not None:  # the routing of response token `step`, read in this forward
                response_routing[live, step] = recorder.take(live.numel(), 1)[:, 0]
            logits = out.logits[:, -1, :].float()
            next_position = next_position + 1
            del out

        lengths = response_lengths.tolist()
        tokens_cpu, log_probs_cpu, stopped_cpu = out_tokens.cpu(), out_log_probs.cpu(), stopped.tolist()
        routing = None
        if prompt_routing is not None:
            # Prompt tokens (right-aligned in the left-padded prefill), then the response tokens but the last.
            width, prompt_rows = input_ids.shape[1], expand.tolist()
            prompt_cpu, response_cpu = prompt_routing.cpu(), response_routing.cpu()
            routing = [
                torch.cat([prompt_cpu[prompt_rows[row], width - len(prompts[prompt_rows[row]]) :],
                           response_cpu[row, : max(lengths[row] - 1, 0)]])  # fmt: skip
                for row in range(num_rows)
            ]
        return (
            [tokens_cpu[row, : lengths[row]].tolist() for row in range(num_rows)],
            [log_probs_cpu[row, : lengths[row]].clone() for row in range(num_rows)],
            [FINISH_STOP if stopped_cpu[row] else FINISH_LENGTH for row in range(num_rows)],
            routing,
        )

    def _stop_string_hits(
        self,
        out_tokens: torch.Tensor,
        live: torch.Tensor,
        alive: torch.Tensor,
        step: int,
        stops: Sequence[str],
        max_stop_bytes: int,
    ) -> torch.Tensor:
        """bool [running rows]: alive rows whose text now ends a stop string (text checked, not cut).

        Only the last max_stop_bytes + 1 tokens are decoded: a stop string of b UTF-8 bytes spans
        at most that many tokens (each token is at least one byte, the first may overlap it partly),
        and an occurrence ending earlier would have stopped the row at an earlier step.
        """
        start = max(0, step - max_stop_bytes)
        tails = out_tokens[live, start : step + 1].tolist()
        alive_cpu = alive.tolist()
        hits = [False] * len(tails)
        for index, tail in enumerate(tails):
            if alive_cpu[index]:
                text = self.tokenizer.decode(tail, skip_special_tokens=False)
                hits[index] = any(stop in text for stop in stops)
        return torch.tensor(hits, dtype=torch.bool, device=alive.device)

    # ---------------------------------------------------------------------------------- weights

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the model's parameters in place (streamed, any order).

        Raises KeyError for a name the model does not have and ValueError for a shape mismatch.
        Tied embeddings stay one Parameter, so loading either of its names updates both. Per-expert
        names of an MoE layer (`...experts.E.gate_proj.weight`) go into their slice of the fused
        parameter transformers holds (`model.hf_experts`).
        """
        if self.model is None:
            raise RuntimeError("EmbeddedEngine was shut down")
        for name, tensor in weights:
            param = self._params_by_name.get(name)
            slot = expert_slot(name) if param is None else None
            fused = self._params_by_name.get(slot.fused_name) if slot is not None else None
            if param is None and fused is None:
                raise KeyError(f"load_weights: the model has no parameter named {name!r}")
            target = param.data if fused is None else slot.view(fused.data)
            if tuple(tensor.shape) != tuple(target.shape):
                raise ValueError(
                    f"load_weights: shape mismatch for {name!r}: "
                    f"got {tuple(tensor.shape)}, model has {tuple(target.shape)}"
                )
            target.copy_(tensor, non_blocking=False)
            if fused is None:
                self._loaded_params.add(id(param))
                continue
            slots = self._loaded_expert_slots.setdefault(id(fused), set())
            slots.add((slot.expert, slot.half))
            if len(slots) == slots_per_fused(slot.fused_name, fused):
                self._loaded_params.add(id(fused))

    def missing_after_load(self) -> list[str]:
        """Parameters (one name per tied group) not loaded since construction or `reset_load_tracking`.

        A debug check for weight sync: after a full push this is empty; a tied model does not need
        `lm_head.weight` because loading the embedding covers it.
        """
        if self.model is None:
            raise RuntimeError("EmbeddedEngine was shut down")
        return [name for name, param in self.model.named_parameters() if id(param) not in self._loaded_params]

    def reset_load_tracking(self) -> None:
        """Forget which parameters were loaded (call before a weight push to check that push alone)."""
        self._loaded_params.clear()
        self._loaded_expert_slots.clear()

    def named_weights(self) -> Iterable[tuple[str, torch.Tensor]]:
        """The current weights under their checkpoint names, without duplicates: a tied `lm_head.weight`
        is not listed, and fused MoE experts are listed expert by expert (as pushed and saved)."""
        if self.model is None:
            raise RuntimeError("EmbeddedEngine was shut down")
        parameter_names = set(self._params_by_name)
        for name, param in self.model.named_parameters():
            if is_fused_experts(name, param):
                yield from unfused_experts(name, param.detach())
            else:
                yield name, param.detach()
        # Persistent buffers that are part of the checkpoint (none in the supported dense LMs).
        for name, tensor in self.model.state_dict().items():
            if name not in parameter_names:
                yield name, tensor

    # ---------------------------------------------------------------------------------- memory

    def sleep(self, level: int = 1) -> None:
        """Move the weights to host memory where they live on an accelerator (`sleep_moves_weights`)
        and release its cached memory; on every device the engine is asleep until the weights wake.

        The KV cache lives only inside a `generate` call, so there is nothing else to free; level 2
        keeps the weights too (in host memory), which a full push then overwrites. Being asleep on
        the CPU as well (nothing moves there) makes a generate before `wake_up` fail on any machine,
        as with vLLM and SGLang, so a wrong order in the trainer shows in CPU tests.
        """
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2 (rollout.sleep_level), got {level}")
        if self.model is None or self._asleep:
            return
        if sleep_moves_weights(self.device):
            self.model.to("cpu")
            torch.cuda.empty_cache()
        self._asleep = True

    def wake_up(self, tags: Optional[Sequence[str]] = None) -> None:
        """Bring the weights back (to the accelerator they left) when `tags` includes "weights" (or is None).

        Weights loaded while asleep are kept; "kv_cache" alone has nothing to restore.
        """
        if "weights" not in check_memory_tags(tags) or self.model is None or not self._asleep:
            return
        if sleep_moves_weights(self.device):
            self.model.to(self.device)
        self._asleep = False

    def shutdown(self) -> None:
        """Drop the model; the engine cannot be used afterwards."""
        self.model = None
        self._params_by_name = {}
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def sleep_moves_weights(device: torch.device) -> bool:
    """Whether `sleep` moves the weights off `device`: only CUDA memory is worth freeing for the
    actor (on the CPU the weights already are in host memory)."""
    return torch.device(device).type == "cuda"


def _new_cache(model: torch.nn.Module):
    """An empty dynamic KV cache laid out for `model` (sliding-window layers included)."""
    return DynamicCache(config=model.config)


def _load_tokenizer_if_present(hf_dir: Path):
    """The directory's tokenizer, or None when it has no tokenizer files."""
    if not any((hf_dir / name).exists() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None

    return AutoTokenizer.from_pretrained(str(hf_dir))
