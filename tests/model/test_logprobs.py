"""Tests for vocab-parallel per-token log-probs and entropy (megatron_dapo/model/logprobs.py).

References are independent: ``torch.log_softmax(...).gather`` and ``-(p * log p).sum()`` on the full
vocabulary, differentiated by ordinary autograd. Multi-rank cases launch this file as a script, one
process per rank, over gloo (no shared launcher, independent of pytest's import mode).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # when run as a rank script
    sys.path.insert(0, str(REPO_ROOT))

from megatron_dapo.distributed.launch import find_free_port  # noqa: E402
from megatron_dapo.model.logprobs import token_log_probs_and_entropy  # noqa: E402


def reference(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Naive full-vocabulary log p(target) and entropy, differentiable by autograd."""
    log_softmax = torch.log_softmax(logits, dim=-1)
    log_probs = log_softmax.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_softmax.exp() * log_softmax).sum(-1)
    return log_probs, entropy


def values_and_grads(fn, logits, targets, weights_lp, weights_h, **kwargs):
    x = logits.detach().clone().requires_grad_()
    log_probs, entropy = fn(x, targets, **kwargs)
    ((log_probs * weights_lp).sum() + (entropy * weights_h).sum()).backward()
    return log_probs.detach(), entropy.detach(), x.grad


# ----------------------------------------------------------------------------- single process


@pytest.mark.parametrize("chunk_size", [1, 7, 64, 4096])
def test_float32_matches_log_softmax(chunk_size):
    torch.manual_seed(0)
    logits = torch.randn(3, 37, 101) * 4.0  # [b, s, v]; 111 tokens, chunk sizes that don't divide it
    targets = torch.randint(0, 101, (3, 37))
    log_probs, entropy = token_log_probs_and_entropy(logits, targets, chunk_size=chunk_size)
    ref_lp, ref_h = reference(logits.double(), targets)
    assert log_probs.dtype == torch.float32 and entropy.dtype == torch.float32
    assert log_probs.shape == targets.shape and entropy.shape == targets.shape
    torch.testing.assert_close(log_probs.double(), ref_lp, rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy.double(), ref_h, rtol=0, atol=1e-5)
    # Same computation in float32 on both sides: within 1e-6.
    ref32_lp, ref32_h = reference(logits, targets)
    torch.testing.assert_close(log_probs, ref32_lp, rtol=0, atol=2e-6)
    torch.testing.assert_close(entropy, ref32_h, rtol=0, atol=2e-6)


@pytest.mark.parametrize("chunk_size", [5, 16, 1000])
def test_float64_values_and_gradients_match_autograd(chunk_size):
    torch.manual_seed(1)
    logits = torch.randn(2, 21, 53, dtype=torch.float64) * 3.0
    targets = torch.randint(0, 53, (2, 21))
    w_lp, w_h = torch.randn(2, 21, dtype=torch.float64), torch.randn(2, 21, dtype=torch.float64)
    lp, h, grad = values_and_grads(token_log_probs_and_entropy, logits, targets, w_lp, w_h, chunk_size=chunk_size)
    ref_lp, ref_h, ref_grad = values_and_grads(reference, logits, targets, w_lp, w_h)
    assert lp.dtype == torch.float64
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-12)
    torch.testing.assert_close(h, ref_h, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=0, atol=1e-12)


def test_gradcheck_each_output_separately():
    torch.manual_seed(2)
    logits = torch.randn(9, 13, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 13, (9,))
    assert torch.autograd.gradcheck(lambda z: token_log_probs_and_entropy(z, targets, chunk_size=4)[0], (logits,))
    assert torch.autograd.gradcheck(lambda z: token_log_probs_and_entropy(z, targets, chunk_size=4)[1], (logits,))
    assert torch.autograd.gradcheck(
        lambda z: token_log_probs_and_entropy(z, targets, chunk_size=2, compute_entropy=False)[0], (logits,)
    )


def test_entropy_gradient_formula():
    """dH/dz = -p (log p + H), checked against autograd of the entropy definition."""
    torch.manual_seed(3)
    z = torch.randn(4, 17, dtype=torch.float64, requires_grad=True)
    log_p = torch.log_softmax(z, -1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    (autograd_grad,) = torch.autograd.grad(entropy.sum(), z)
    formula = -log_p.exp() * (log_p + entropy[:, None])
    torch.testing.assert_close(autograd_grad, formula.detach(), rtol=0, atol=1e-14)


def test_input_is_not_modified_and_layouts_agree():
    torch.manual_seed(4)
    logits_sbv = torch.randn(11, 3, 29)  # Megatron's [s, b, v/tp]
    targets_sb = torch.randint(0, 29, (11, 3))
    before = logits_sbv.clone()
    lp_sb, h_sb = token_log_probs_and_entropy(logits_sbv, targets_sb, chunk_size=4)
    assert torch.equal(logits_sbv, before), "the fp32 input must not be overwritten by in-place chunk math"
    # The same data as [b, s, v] (a non-contiguous transpose) gives the transposed result.
    lp_bs, h_bs = token_log_probs_and_entropy(logits_sbv.transpose(0, 1), targets_sb.t(), chunk_size=5)
    torch.testing.assert_close(lp_bs, lp_sb.t(), rtol=0, atol=1e-6)
    torch.testing.assert_close(h_bs, h_sb.t(), rtol=0, atol=1e-6)


def test_bfloat16_input_is_reduced_in_float32():
    torch.manual_seed(5)
    logits = (torch.randn(2, 50, 300) * 5).to(torch.bfloat16)
    targets = torch.randint(0, 300, (2, 50))
    w_lp, w_h = torch.randn(2, 50), torch.randn(2, 50)
    lp, h, grad = values_and_grads(token_log_probs_and_entropy, logits, targets, w_lp, w_h, chunk_size=33)
    ref_lp, ref_h, ref_grad = values_and_grads(reference, logits.double(), targets, w_lp.double(), w_h.double())
    assert lp.dtype == torch.float32 and grad.dtype == torch.bfloat16
    # The bf16 values themselves are exact; only fp32 reduction error remains.
    torch.testing.assert_close(lp.double(), ref_lp, rtol=0, atol=1e-5)
    torch.testing.assert_close(h.double(), ref_h, rtol=0, atol=1e-5)
    # The gradient is rounded to bf16 (8 mantissa bits) when written back.
    torch.testing.assert_close(grad.double(), ref_grad, rtol=1e-2, atol=1e-4)


def test_vocab_padding_columns_are_excluded():
    torch.manual_seed(6)
    real_vocab, padded_vocab = 40, 48
    logits = torch.randn(15, padded_vocab, dtype=torch.float64) * 2
    logits[:, real_vocab:] = 5.0  # large padding logits would visibly change the softmax if counted
    targets = torch.randint(0, real_vocab, (15,))
    w_lp, w_h = torch.randn(15, dtype=torch.float64), torch.randn(15, dtype=torch.float64)
    lp, h, grad = values_and_grads(
        token_log_probs_and_entropy, logits, targets, w_lp, w_h, chunk_size=4, vocab_size=real_vocab
    )
    ref_lp, ref_h, ref_grad = values_and_grads(reference, logits[:, :real_vocab], targets, w_lp, w_h)
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-12)
    torch.testing.assert_close(h, ref_h, rtol=0, atol=1e-12)
    torch.testing.assert_close(grad[:, :real_vocab], ref_grad, rtol=0, atol=1e-12)
    assert torch.count_nonzero(grad[:, real_vocab:]) == 0


def test_only_log_probs_requested():
    torch.manual_seed(7)
    logits = torch.randn(10, 31, dtype=torch.float64)
    targets = torch.randint(0, 31, (10,))
    x = logits.clone().requires_grad_()
    lp, h = token_log_probs_and_entropy(x, targets, compute_entropy=False, chunk_size=3)
    assert h is None
    lp.sum().backward()
    y = logits.clone().requires_grad_()
    reference(y, targets)[0].sum().backward()
    torch.testing.assert_close(x.grad, y.grad, rtol=0, atol=1e-12)
    # The entropy computed but unused in the loss: its gradient is simply not requested.
    z = logits.clone().requires_grad_()
    lp2, _ = token_log_probs_and_entropy(z, targets, chunk_size=3)
    lp2.sum().backward()
    torch.testing.assert_close(z.grad, y.grad, rtol=0, atol=1e-12)


def test_empty_input_and_shape_errors():
    lp, h = token_log_probs_and_entropy(torch.zeros(0, 8, requires_grad=True), torch.zeros(0, dtype=torch.long))
    assert lp.shape == (0,) and h.shape == (0,)
    with pytest.raises(ValueError, match="target_ids shape"):
        token_log_probs_and_entropy(torch.zeros(4, 8), torch.zeros(5, dtype=torch.long))
    with pytest.raises(ValueError, match="chunk_size"):
        token_log_probs_and_entropy(torch.zeros(4, 8), torch.zeros(4, dtype=torch.long), chunk_size=0)


# ----------------------------------------------------------------------------- tensor parallel over gloo

SHARD_WIDTH = 13  # vocabulary columns per rank at TP=4; TP=2 uses 26
BATCH, SEQ = 3, 23


def _full_problem(seed: int, vocab: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(BATCH, SEQ, vocab, generator=gen, dtype=torch.float64).to(dtype) * 3
    targets = torch.randint(0, vocab, (BATCH, SEQ), generator=gen)
    w_lp = torch.randn(BATCH, SEQ, generator=gen, dtype=torch.float64).to(dtype)
    w_h = torch.randn(BATCH, SEQ, generator=gen, dtype=torch.float64).to(dtype)
    return logits, targets, w_lp, w_h


def _check_tp(group, rank_in_group: int, tp: int, seed: int, dtype: torch.dtype, vocab_size=None, explicit_start=False):
    """This rank's shard against the TP=1 result of the same function and against the naive reference."""
    width = 4 * SHARD_WIDTH // tp
    padded_vocab = width * tp
    logits, targets, w_lp, w_h = _full_problem(seed, padded_vocab, dtype)
    if vocab_size is not None:
        targets = targets % vocab_size
    kwargs = dict(chunk_size=10, vocab_size=vocab_size)  # 69 tokens: chunks don't divide them
    single_lp, single_h, single_grad = values_and_grads(
        token_log_probs_and_entropy, logits, targets, w_lp, w_h, **kwargs
    )
    real = padded_vocab if vocab_size is None else vocab_size
    ref_lp, ref_h, ref_grad = values_and_grads(
        reference, logits[..., :real].double(), targets, w_lp.double(), w_h.double()
    )

    lo = rank_in_group * width
    shard = logits[..., lo : lo + width]
    if explicit_start:
        kwargs["vocab_start"] = lo
    lp, h, grad = values_and_grads(token_log_probs_and_entropy, shard, targets, w_lp, w_h, tp_group=group, **kwargs)

    tol = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(lp, single_lp, rtol=0, atol=tol)
    torch.testing.assert_close(h, single_h, rtol=0, atol=tol)
    torch.testing.assert_close(grad, single_grad[..., lo : lo + width], rtol=0, atol=tol)
    torch.testing.assert_close(lp.double(), ref_lp, rtol=0, atol=max(tol, 2e-5))
    torch.testing.assert_close(h.double(), ref_h, rtol=0, atol=max(tol, 2e-5))
    ref_grad_shard = torch.zeros_like(grad, dtype=torch.float64)
    real_in_shard = max(0, min(width, real - lo))
    ref_grad_shard[..., :real_in_shard] = ref_grad[..., lo : lo + real_in_shard]
    torch.testing.assert_close(grad.double(), ref_grad_shard, rtol=0, atol=max(tol, 2e-6))


def _rank_main(rank: int, world_size: int, port: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        # TP=4 over the whole world.
        world = dist.group.WORLD
        for dtype in (torch.float32, torch.float64):
            _check_tp(world, rank, 4, seed=10, dtype=dtype)
        # Megatron vocab padding: 52 columns, 45 real (rank 3 holds 6 real columns) ...
        _check_tp(world, rank, 4, seed=11, dtype=torch.float64, vocab_size=45)
        # ... and 38 real: rank 3 (ids 39..51) holds padding only.
        _check_tp(world, rank, 4, seed=12, dtype=torch.float64, vocab_size=38)
        # TP=2 in two sub-groups (as in TP=2 x DP=2): each pair reduces only within itself.
        pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        pair = pairs[rank // 2]
        for dtype in (torch.float32, torch.float64):
            _check_tp(pair, rank % 2, 2, seed=20 + rank // 2, dtype=dtype, explicit_start=True)
        _check_tp(pair, rank % 2, 2, seed=30 + rank // 2, dtype=torch.float64, vocab_size=47)
        dist.barrier()
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_tensor_parallel_2_and_4_match_single_process():
    world_size, port = 4, find_free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO_ROOT), OMP_NUM_THREADS="1")
    procs = [
        subprocess.Popen(
            [sys.executable, __file__, "tp-rank", str(rank), str(world_size), str(port)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in range(world_size)
    ]
    outputs = []
    for proc in procs:
        try:
            out, _ = proc.communicate(timeout=150)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        outputs.append((proc.returncode, out))
    failed = [f"rank {r} exit {code}:\n{out[-3000:]}" for r, (code, out) in enumerate(outputs) if code != 0]
    assert not failed, "\n".join(failed)


# ----------------------------------------------------------------------------- memory

MEMORY_SCRIPT = r"""
import json, resource, sys, torch
sys.path.insert(0, sys.argv[1])
from megatron_dapo.model.logprobs import token_log_probs_and_entropy
tokens, width, chunk = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
torch.set_num_threads(2)

def current_rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()

def peak_rss():  # VmHWM, the peak since the last reset_peak(), in kB
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM"))

def reset_peak():  # Linux: writing 5 to clear_refs resets VmHWM to the current RSS
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")

torch.manual_seed(0)
logits = torch.empty(tokens, width, dtype=torch.bfloat16)
for i in range(0, tokens, chunk):  # fill in place, chunk by chunk: no full-size temporaries
    logits[i:i + chunk].normal_(0, 3)
targets = torch.randint(0, width, (tokens,))
w_lp, w_h = torch.randn(tokens), torch.randn(tokens)
logits.requires_grad_()
reset_peak()  # set-up transients (imports, the fill) must not count: only what the call below adds
base_current, base_peak = current_rss(), peak_rss()

log_probs, entropy = token_log_probs_and_entropy(
    logits, targets, chunk_size=chunk)
((log_probs * w_lp).sum() + (entropy * w_h).sum()).backward()
after_peak = peak_rss()
assert logits.grad is not None and torch.isfinite(log_probs).all() and torch.isfinite(entropy).all()

# Control: materialising one fp32 [tokens, width] copy must show up in the same measurement.
control = logits.detach().float()
control_peak = peak_rss()
print(json.dumps(dict(base_current=base_current, base_peak=base_peak, after_peak=after_peak,
                      control_peak=control_peak, input_bytes=logits.numel() * 2)))
"""


@pytest.mark.timeout(120)
def test_forward_backward_memory_stays_far_below_fp32_full_vocab():
    """A 20k-token response, bf16 logits, forward + backward: peak RSS growth ~ the bf16 gradient.

    Run here: 20000 tokens x 9504 columns (Qwen2.5's 152064 vocabulary over TP=16; the TP=8 width
    19008 works the same but takes twice as long on 2 CPU cores) with chunks of 1024 tokens. The
    bf16 input is 380 MB; one fp32 [tokens, V/tp] tensor would be 760 MB.
    """
    tokens, width, chunk = 20000, 152064 // 16, 1024
    result = subprocess.run(
        [sys.executable, "-c", MEMORY_SCRIPT, str(REPO_ROOT), str(tokens), str(width), str(chunk)],
        capture_output=True,
        text=True,
        timeout=110,
        env=dict(os.environ, OMP_NUM_THREADS="2"),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    m = json.loads(result.stdout.strip().splitlines()[-1])
    input_bytes = m["input_bytes"]
    fp32_full = 2 * input_bytes
    chunk_fp32 = chunk * width * 4
    # The measurement is valid: no transient during set-up raised the peak above the baseline much...
    assert m["base_peak"] - m["base_current"] < chunk_fp32 * 2 + 64 * 2**20
    # ... and it sees a full fp32 copy when one is made.
    assert m["control_peak"] - m["after_peak"] > 0.5 * fp32_full
    growth = m["after_peak"] - m["base_current"]
    # Expected: the bf16 gradient (= input size) + a few fp32 chunk buffers; allow 6 of them + 64 MiB.
    budget = input_bytes + 6 * chunk_fp32 + 64 * 2**20
    assert growth < budget, f"peak grew by {growth / 2**20:.0f} MiB, budget {budget / 2**20:.0f} MiB"
    assert growth < input_bytes + 0.5 * fp32_full, "some fp32 [tokens, vocab/tp] tensor was materialised"


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "tp-rank":
    _rank_main(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
