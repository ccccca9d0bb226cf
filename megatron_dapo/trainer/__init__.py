"""The DAPO trainer, one job per module.

    loop.py           DAPOTrainer: `fit` (the loop) and `train_step` (the paper's Algorithm 1); `train`
    startup.py        pre-flight checks, process groups, tokenizer, the one load path of the weights
    parts.py          what a run builds from its config: actor and reference, data, reward manager, ...
    samples.py        generate and score prompts, pool the replicas' samples, the actor's batch
    seeds.py          generation seeds that a resumed run reproduces
    handover.py       the GPU changing hands between the rollout engine and the actor
    validation.py     avg@n / pass@k / maj@n over the validation set
    metrics.py        every metric name a run logs, and their values
    preemption.py     SIGTERM: where all ranks stop together, and what they leave behind
    checkpointing.py  the run's checkpoint (actor + step + prompt sampler): save and resume
    output_dir.py     what a run writes under trainer.output_dir; the rules for a previous run there
    sft.py            the supervised warm start

Importing the package imports none of them.
"""
