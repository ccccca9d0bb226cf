"""The weight-sync check behind `megatron-dapo check-sync`: does the actor -> rollout engine weight
sync work here, exactly? (The command, its options and the launch of the processes: cli/check_sync.py.)

It loads the HF checkpoint into the Megatron actor (TP x PP) and into a rollout engine on rank 0,
changes every actor weight (`update="perturb"`: all weights scaled by 1 + 2^-6, so a tensor the
sync misses keeps its old value and shows up; or `"step"`: one real optimizer step), syncs the
weights with the trainer's code path (`RolloutGroup.sync_weights`, in the mode `sync_mode` picks;
`placement="spmd"`: every rank holds its shard of a TP = tp vLLM engine, the trainer's default for
vLLM), then checks:

1. per tensor: the engine's weight equals the actor's HF export bit for bit (in the engine dtype);
   a mixture of experts per expert matrix under its checkpoint name, the router included (engines
   that hold the experts fused read them back one expert at a time);
2. the engine's log-probs of responses it samples against the actor's forward-only log-probs of
   the same tokens: mean and max |diff| and the k3 KL estimate (the training / inference mismatch).

It passes when every tensor is equal and max |diff| <= the tolerance. Runs on every rank of a
world of a multiple of TP x PP processes (extra ranks are data-parallel replicas).

`placement="separate"`: the last `--rollout-ranks` processes hold the engines (one per
`--rollout-tp` of them), the weights cross the bridge as in training (`RemoteRollout.sync_weights`),
and each engine's owner compares its tensors and samples for the check
(`check_sync_separate.py`); the trainer's rank 0 reports for every engine.

It sits beside the trainer's hand-over (`handover.py`) because it drives the same path: a
`ParallelLayout` with the engine's placement and TP, `RolloutGroup.sync_weights` and its transport.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import torch
import torch.distributed as dist

from megatron_dapo.actor import ForwardSettings, PolicyBatch, ReferenceModel, build_actor, split_mini_batches
from megatron_dapo.algorithm.mismatch import log_prob_mismatch
from megatron_dapo.config import Config
from megatron_dapo.distributed import ParallelLayout, init_distributed, teardown
from megatron_dapo.errors import InputError
from megatron_dapo.model.builder import build_gpt_models
from megatron_dapo.model.hf_config import read_hf_config
from megatron_dapo.model.load import export_megatron_to_hf, load_hf_into_megatron
from megatron_dapo.rollout.base import SamplingParams
from megatron_dapo.distributed.placement import EngineDevices, SpmdSlot
from megatron_dapo.rollout.engines.embedded import EmbeddedEngine
from megatron_dapo.rollout.group import RolloutGroup

__all__ = ["PERTURB_FACTOR", "CheckSyncError", "run_check"]

PERTURB_FACTOR = 1.0 + 2.0**-6  # changes every nonzero float32 / bfloat16 / float16 value


class CheckSyncError(InputError, ValueError):
    """An option the check cannot use, found once the model and the engine are up (e.g. --corrupt-tensor NAME)."""


class _Printer:
    """Prints on rank 0 only."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled

    def __call__(self, text: str = "") -> None:
        if self.enabled:
            print(text, flush=True)


def engine_tp(args: argparse.Namespace) -> int:
    """The TP size of the engine the check builds: each separate engine at --rollout-tp; SGLang and
    the spmd placement at --tp (as the trainer builds them, rollout.tp = parallel.tp); the embedded
    engine and a leader vLLM at 1."""
    if args.placement == "separate":
        return args.rollout_tp
    if args.engine == "sglang" or args.placement == "spmd":
        return args.tp
    return 1


def _make_engine(args: argparse.Namespace, device, torch_dtype, devices: Optional[EngineDevices] = None):
    """rank 0's engine (leader placement), this rank's shard of a TP = --tp vLLM engine (spmd), or an
    engine owner's (separate: on `devices`, its group's GPUs; None off the GPU)."""
    if args.engine == "embedded":
        return EmbeddedEngine(args.hf_dir, dtype=torch_dtype, device=device)
    # vLLM and SGLang are optional installs: their modules load only when the check uses them.
    if args.engine == "sglang":
        from megatron_dapo.rollout.engines.sglang.engine import SGLangEngine

        # As the trainer builds it (rollout.tp = parallel.tp): SGLang's own TP ranks load their
        # slices of the full tensors, and named_weights gathers them back.
        return SGLangEngine(
            args.hf_dir,
            tensor_parallel_size=engine_tp(args),
            dtype=args.dtype,
            mem_fraction_static=args.gpu_memory_utilization,
            max_model_len=args.prompt_length + args.max_new_tokens + 8,
            seed=args.seed,
            device=device.type,
            skip_tokenizer_init=True,  # token ids in and out; the check needs no tokenizer
            **({} if devices is None else {"base_gpu_id": devices.base_gpu_id, "gpu_id_step": devices.gpu_id_step}),
        )
    from megatron_dapo.rollout.engines.vllm.engine import VLLMEngine

    # vLLM logs every start-up detail at INFO; keep the check's report readable (override to see them).
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    kwargs: dict[str, Any] = {}
    kv_mb = args.kv_cache_mb if args.kv_cache_mb is not None else (256 if device.type == "cpu" else None)
    if kv_mb is not None:
        kwargs["kv_cache_memory_bytes"] = int(kv_mb) << 20
    return VLLMEngine(
        args.hf_dir,
        tensor_parallel_size=engine_tp(args),
        placement="spmd" if args.placement == "spmd" else "leader",  # a separate engine is its owner's, as a leader's
        visible_devices=devices.cuda_visible_devices if devices is not None else None,
        # The check samples (--update step) and counts stale tensors before the push: real weights, not
        # the dummy ones an spmd engine of the trainer starts on.
        load_checkpoint=True,
        dtype=args.dtype,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.prompt_length + args.max_new_tokens + 8,
        seed=args.seed,
        **kwargs,
    )


def _actor_config(args: argparse.Namespace, is_moe: bool):
    cfg = Config()
    cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.vpp, cfg.parallel.ep = args.tp, args.pp, args.vpp, args.ep
    # As the trainer must (config check): an MoE at TP > 1 runs with sequence parallelism.
    cfg.parallel.sequence_parallel = is_moe and args.tp > 1
    cfg.optimizer.lr = args.lr
    cfg.optimizer.warmup_steps = 0
    cfg.rollout.temperature = args.temperature
    cfg.rollout.max_response_length = args.max_new_tokens
    cfg.trainer.micro_batch_size = args.num_prompts * args.responses_per_prompt
    return cfg


def _sample(engine, prompts, args, seed: int) -> dict:
    """Rank 0 samples; every rank gets the responses (and rank 0's log-probs)."""
    payload = [None]
    if engine is not None:
        params = SamplingParams(
            n=args.responses_per_prompt, temperature=args.temperature, max_new_tokens=args.max_new_tokens, seed=seed
        )
        out = engine.generate(prompts, params)
        payload = [{
            "prompt_index": list(out.prompt_index),
            "responses": [list(r) for r in out.response_ids],
            "log_probs": [lp.tolist() for lp in out.log_probs],
        }]  # fmt: skip
    dist.broadcast_object_list(payload, src=0)
    return payload[0]


def _as_batch(prompts, sampled: dict):
    return PolicyBatch.from_token_lists([prompts[i] for i in sampled["prompt_index"]], sampled["responses"])


class TensorComparison:
    """The actor's HF export, tensor by tensor, against an engine's weights (`engine.named_weights()`).

    `add` each exported (name, tensor) in order, then `finish`: it checks a tied LM head the engine
    keeps as a copy against the embedding and notes the engine's tensors the export did not name.
    `say` prints one line per tensor (only the differing ones with `only_failures`). Used where the
    engine is: rank 0 in the colocated placements, each engine owner in the separate one.
    """

    def __init__(self, state: Iterable[tuple[str, torch.Tensor]], tied: bool, say: Callable[[str], None], only_failures: bool) -> None:
        self.state, self.tied, self.say, self.only_failures = dict(state), tied, say, only_failures
        self.equal = self.compared = 0
        self.problems: list[str] = []
        self._embedding: Optional[torch.Tensor] = None

    def add(self, name: str, tensor: torch.Tensor) -> None:
        self.compared += 1
        self._compare(name, self.state.pop(name, None), tensor)
        if self.tied and name == "model.embed_tokens.weight":
            self._embedding = tensor.detach().clone()

    def finish(self) -> tuple[int, int, list[str]]:
        """(equal, compared, the names of the tensors that differ or are missing)."""
        # Engines that keep a separate copy of a tied LM head list it: it must equal the embedding.
        if self._embedding is not None and "lm_head.weight" in self.state:
            self.compared += 1
            self._compare("lm_head.weight", self.state.pop("lm_head.weight"), self._embedding, "  (tied: vs the embedding)")
        for name in sorted(self.state):
            self.say(f"   NOTE  {name}: in the engine but not in the actor's export (not checked)")
        self.state = {}
        return self.equal, self.compared, self.problems

    def _compare(self, name: str, have: Optional[torch.Tensor], tensor: torch.Tensor, label: str = "") -> None:
        say, shape = self.say, list(tensor.shape)
        if have is None:
            self.problems.append(name)
            say(f"   MISSING {name}: the engine has no tensor of this name")
            return
        want = tensor.detach().to(device=have.device, dtype=have.dtype)
        if tuple(have.shape) != tuple(want.shape):
            self.problems.append(name)
            say(f"   DIFF  {name:<56} shape {list(have.shape)} in the engine, {shape} in the actor{label}")
        elif torch.equal(have, want):
            self.equal += 1
            if not self.only_failures:
                say(f"   OK    {name:<56} {str(shape):<14} {str(have.dtype).replace('torch.', '')}{label}")
        else:
            self.problems.append(name)
            diff = (have.double() - want.double()).abs()
            say(f"   DIFF  {name:<56} {str(shape):<14} max|diff| {float(diff.max()):.3e}, "
                f"{int((diff > 0).sum())} of {diff.numel()} elements differ{label}")  # fmt: skip


def _compare_tensors(engine, models, hf_cfg, say: _Printer, only_failures: bool) -> tuple[int, int, list[str]]:
    """Stream the actor's HF export and compare each tensor with the engine's (rank 0). Collective.

    Prints one line per tensor (only the differing ones with `only_failures`; nothing when `say` is
    disabled). Returns (equal, compared, problems) on rank 0; (0, 0, []) elsewhere.
    """
    comparison = None
    if engine is not None:
        comparison = TensorComparison(engine.named_weights(), bool(getattr(hf_cfg, "tie_word_embeddings", False)), say, only_failures)
    for name, tensor in export_megatron_to_hf(models, hf_cfg):
        if comparison is not None:
            comparison.add(name, tensor)
    return comparison.finish() if comparison is not None else (0, 0, [])


class _ColocatedEngine:
    """The engine in the colocated placements: on rank 0 (leader) or as TP shards on every rank
    (spmd). What `run_check` asks of the engines, the same as `check_sync_separate.RemoteEngines`."""

    count = 1

    def __init__(self, args: argparse.Namespace, ctx: Any, torch_dtype: torch.dtype) -> None:
        self.args, self.ctx = args, ctx
        self.engine = _make_engine(args, ctx.device, torch_dtype) if ctx.rank == 0 or args.placement == "spmd" else None

    @staticmethod
    def placement_text(args: argparse.Namespace) -> str:
        return "on rank 0" if args.placement == "leader" else f"spmd, TP={args.tp} shards on every rank"

    def ready(self) -> None:
        dist.barrier()

    def sample(self, prompts: list, seed: int) -> list[dict]:
        return [_sample(self.engine, prompts, self.args, seed)]

    def compare(self, models, hf_cfg, say: _Printer, only_failures: bool) -> list[tuple[int, int, list[str]]]:
        return [_compare_tensors(self.engine, models, hf_cfg, say, only_failures)]

    def sync(self, models, hf_cfg):
        layout = self.ctx.layout
        slot = SpmdSlot(self.ctx.rank, self.ctx.world_size, layout.rollout_tp) if layout.placement == "spmd" else None
        rollout = RolloutGroup(
            self.engine, sync_mode=self.args.sync_mode, engine_kind=self.args.engine, device_type=self.ctx.device.type,
            spmd=slot, layout=layout,
        )  # fmt: skip
        try:
            return rollout.sync_weights(models, hf_cfg, self.args.bucket_mb), rollout.sync_mode
        finally:
            rollout.close_weight_sync()

    def corrupt(self, name: str, hf_cfg) -> None:
        if self.engine is not None:
            corrupt_engine_tensor(self.engine, name, hf_cfg)

    def close(self) -> None:
        if self.engine is not None:
            engine, self.engine = self.engine, None
            engine.shutdown()


def corrupt_engine_tensor(engine, name: str, hf_cfg) -> None:
    """The self-test of --corrupt-tensor: overwrite `name` in the engine with a perturbed copy."""
    current = dict(engine.named_weights())
    if name not in current:
        raise CheckSyncError(f"--corrupt-tensor {name!r}: the engine has no such tensor")
    bad = current[name].clone()
    bad.add_(0.05 * bad.abs().max().clamp(min=1e-3))
    # The whole state again with one tensor changed: vLLM takes a fused layer (gate_up_proj,
    # qkv_proj, a layer's experts) only whole, and a tied engine's read-back LM head is not a
    # tensor to load.
    skip = "lm_head.weight" if hf_cfg.tie_word_embeddings else None
    engine.load_weights((n, bad if n == name else tensor) for n, tensor in current.items() if n != skip)


def _build_actor(args: argparse.Namespace, hf_cfg, layout, torch_dtype):
    cfg = _actor_config(args, hf_cfg.is_moe)
    models = build_gpt_models(
        hf_cfg, layout, torch_dtype, transformer_engine=args.transformer_engine, init_weights=False,
        sequence_parallel=cfg.parallel.sequence_parallel,
    )  # fmt: skip
    load_hf_into_megatron(models, args.hf_dir, hf_cfg)
    if args.update == "step":
        return build_actor(cfg, models, vocab_size=hf_cfg.vocab_size)
    return ReferenceModel(models, ForwardSettings.from_config(cfg, hf_cfg.vocab_size))


def check_layout(args: argparse.Namespace) -> ParallelLayout:
    """The actor's layout and the engines' placement the check runs with (the world size from the launch)."""
    separate = args.placement == "separate"
    return ParallelLayout(
        tp=args.tp, pp=args.pp, vpp=args.vpp, ep=args.ep, rollout_tp=engine_tp(args), placement=args.placement,
        rollout_ranks=args.rollout_ranks if separate else 0,
    )  # fmt: skip


def run_check(args: argparse.Namespace, env: Optional[dict] = None, result_file: Optional[Path] = None) -> bool:
    """Run the check on every rank of the launch described by `env` (None: this process's
    environment; {}: a private world of one); True when it passed (the same on every trainer rank;
    the separate placement's rollout ranks return True: the verdict is the trainer's).

    `args`: the options of `megatron-dapo check-sync` (cli/check_sync.py). `result_file`: rank 0
    also writes the verdict there as JSON ({"passed": bool}), for a parent process to read.
    """
    torch_dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[args.dtype]
    # Collectives wait up to --timeout-s, the bridge to separate engines too (not the trainer's hours).
    ctx = init_distributed(check_layout(args), timeout_s=args.timeout_s, seed=args.seed, env=env, gather_timeout_s=args.timeout_s)
    say = _Printer(ctx.rank == 0)
    engines = None
    passed = False
    finished = False  # every rank got to the end: they leave together (distributed.setup.leave_together)
    try:
        if ctx.role == "rollout":
            from megatron_dapo.trainer.check_sync_separate import serve_check

            serve_check(args, ctx, lambda devices: _make_engine(args, ctx.device, torch_dtype, devices))
            finished = True
            return True
        hf_cfg = read_hf_config(args.hf_dir)
        layout = ctx.layout
        started = time.perf_counter()
        if layout.separate:
            from megatron_dapo.trainer.check_sync_separate import RemoteEngines

            engines = RemoteEngines(args, ctx)
        say(f"check-sync: {args.hf_dir} ({hf_cfg.architecture}, {hf_cfg.num_layers} layers)")
        say(f"  actor: tp={layout.tp} pp={layout.pp}{f' vpp={layout.vpp}' if layout.vpp else ''}"
            f"{f' ep={layout.ep}' if layout.ep > 1 else ''} dp={layout.dp} "
            f"{args.dtype} on {ctx.device.type} ({ctx.backend});  engine: {args.engine} {args.dtype} "
            f"{engines.describe() if engines is not None else _ColocatedEngine.placement_text(args)}")  # fmt: skip

        actor = _build_actor(args, hf_cfg, layout, torch_dtype)
        if engines is None:
            engines = _ColocatedEngine(args, ctx, torch_dtype)
        engines.ready()
        say(f"1. loaded the checkpoint into the actor and the engine{'s' if engines.count > 1 else ''} "
            f"({time.perf_counter() - started:.1f} s)")

        generator = torch.Generator().manual_seed(args.seed)
        prompts = torch.randint(0, hf_cfg.vocab_size, (args.num_prompts, args.prompt_length), generator=generator).tolist()
        if args.update == "step":
            batch = _as_batch(prompts, engines.sample(prompts, seed=args.seed)[0])
            batch.old_log_probs = actor.compute_log_probs(batch)
            batch.advantages = torch.where(torch.rand(batch.num_sequences, generator=generator) < 0.5, -1.0, 1.0)
            metrics = actor.update(split_mini_batches(batch, 1))
            say(f"2. one optimizer step (lr {args.lr:g}, grad norm {metrics['grad_norm']:.3g}) on {batch.num_sequences} sampled responses")
        else:
            with torch.no_grad():
                for model in actor.gpt_models:
                    for param in model.parameters():
                        param.mul_(PERTURB_FACTOR)
            say("2. scaled every actor weight by 1 + 2^-6")
        # How stale is the engine now? Only tensors that differ before the sync can reveal a missed one.
        stale_equal, stale_compared, _ = _worst(engines.compare(actor.gpt_models, hf_cfg, _Printer(False), True))
        say(f"   before the sync, {stale_compared - stale_equal} of {stale_compared} engine tensors differ from the actor"
            + ("" if stale_equal == 0 else f" ({stale_equal} unchanged by the update: a missed sync of those cannot show)"))

        stats, sync_mode = engines.sync(actor.gpt_models, hf_cfg)
        moved = "MB of this rank's own slices" if sync_mode in ("shared_memory", "tp_shards") else "MB"
        say(f"3. synced {stats.num_tensors} tensors ({sync_mode}), {stats.bytes / 1e6:.1f} {moved} in {stats.num_buckets} "
            f"bucket(s) (largest {stats.peak_bucket_bytes / 1e6:.1f} MB) in {stats.seconds:.3f} s = {stats.gb_per_s:.2f} GB/s")  # fmt: skip
        if args.corrupt_tensor:
            engines.corrupt(args.corrupt_tensor, hf_cfg)
            say(f"   (self-test: overwrote {args.corrupt_tensor} in the engine with a perturbed copy)")

        say("4. per-tensor equality, engine vs the actor's HF export (bit for bit):")
        equal, compared, problems = _worst(engines.compare(actor.gpt_models, hf_cfg, say, args.only_failures))
        say(f"   {equal} of {compared} tensors equal")

        worst = None
        for index, sampled in enumerate(engines.sample(prompts, seed=args.seed + 1)):
            batch = _as_batch(prompts, sampled)
            trainer = actor.compute_log_probs(batch)
            rollout = torch.zeros_like(trainer)
            for row, values in enumerate(sampled["log_probs"]):
                rollout[row, : len(values)] = torch.tensor(values, dtype=rollout.dtype)
            mismatch = log_prob_mismatch(rollout, trainer, batch.response_valid_mask())
            of_engine = f" of engine {index + 1}" if engines.count > 1 else ""
            say(f"5. log-prob mismatch, engine vs actor, on {batch.num_sequences} sampled responses{of_engine} "
                f"({int(mismatch.num_tokens)} tokens, temperature {args.temperature:g}):")  # fmt: skip
            say(f"   mean |diff| {mismatch.mean_abs_diff:.3e}   max |diff| {mismatch.max_abs_diff:.3e}   "
                f"k3 KL {mismatch.k3_kl:.3e}   (tolerance on max |diff|: {args.tolerance:g})")  # fmt: skip
            if worst is None or mismatch.max_abs_diff > worst.max_abs_diff:
                worst = mismatch

        verdict = [not problems, worst.max_abs_diff <= args.tolerance]
        if ctx.rank == 0:
            passed = all(verdict)
            if passed:
                say("PASS: every tensor equal, log-prob mismatch within tolerance")
            else:
                reasons = []
                if problems:
                    shown = ", ".join(problems[:5]) + (" ..." if len(problems) > 5 else "")
                    reasons.append(f"{len(problems)} tensor(s) differ ({shown})")
                if not verdict[1]:
                    reasons.append(f"max |diff| {worst.max_abs_diff:.3e} > tolerance {args.tolerance:g}")
                say("FAIL: " + "; ".join(reasons))
        flag = torch.tensor([1 if passed else 0], dtype=torch.long, device=ctx.device)
        dist.broadcast(flag, src=0)
        passed = bool(flag.item())
        if ctx.rank == 0 and result_file is not None:
            result_file.write_text(json.dumps({"passed": passed}))
        finished = True
    finally:
        if engines is not None:
            engines.close()
        teardown(together=finished)
    return passed


def _worst(results: list[tuple[int, int, list[str]]]) -> tuple[int, int, list[str]]:
    """One (equal, compared, problems) over every engine: the fewest equal, every problem once."""
    equal = min(r[0] for r in results)
    compared = max(r[1] for r in results)
    problems = list(dict.fromkeys(name for r in results for name in r[2]))
    return equal, compared, problems
