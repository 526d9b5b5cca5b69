"""How the plan lays a job's actors onto one machine's cores, and why (``rayppo plan``'s last lines).

Two choices, both from the layout sweep in ``docs/benchmarks.md`` ("Layouts"; SmolLM2-135M,
GRPO, bf16, 2 cores):

- **threads**: where the stages take turns on this machine, a stage's actors share every core
  (``config.derived.role_threads``): the reward pass took 7.2 s on 1 thread and 4.6 s on 2.
- **learner ranks**: one rank on every core and N ranks of cores/N threads trained as fast as each
  other (26.0-30.3 s per step, within the machine's noise): gloo's gradient all-reduce costs what
  the second rank gains. One rank holds one copy of the weights and gradients instead of N, so it
  needs less memory in all (9.0 against 10.6 GiB there): the plan suggests it when that saves at
  least ``WORTH_SAYING``. It only suggests: N ranks shard the optimiser state, and the ranks are
  what a job scaled to GPUs keeps.
"""

from __future__ import annotations

from rayppo.cluster.address import machine_cores
from rayppo.cluster.placement import changed
from rayppo.config.derived import reference_in_learner
from rayppo.config.schema import Config
from rayppo.plan.footprint import Estimate, GiB, Inputs, MiB, learner_estimate

WORTH_SAYING = 1 * GiB
"""Memory a one-rank learner has to save before the plan suggests it; below it the two layouts'
difference is within what the estimate itself can tell."""


def size_text(n: float) -> str:
    """Bytes as ``1.23 GiB`` (from 1 GiB) or ``45 MiB``."""
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.0f} MiB"


def threads_line(cfg: Config, this_machine: bool) -> str:
    """Why each role has the threads the plan shows (``config.derived.role_threads``)."""
    cores = machine_cores(cfg.cluster.address) if this_machine else None
    if cores and cfg.rollout.max_staleness == 0:
        return (f"threads: the stages take turns on this machine's {cores} cores, so a stage's actors share all of "
                "them (unless <role>.threads is set): a stage alone runs on every core, as measured on SmolLM2's "
                "reward pass, 7.2 s on 1 thread, 4.6 s on 2 (docs/benchmarks.md)")
    why = ("stages overlap (rollout.max_staleness > 0)" if cfg.rollout.max_staleness else
           "the machines of a cluster are not seen from here")
    return f"threads: each actor's CPU share rounded down, as {why} (<role>.threads sets them)"


def learner_layout_advice(cfg: Config, m: Inputs, cores: int | None) -> list[str]:
    """One line suggesting ``learner.num_ranks=1`` where the learner's ranks share one machine's
    ``cores`` (None: not this machine) on CPU, the stages take turns and the user left the threads
    to the plan, when one rank on every core needs at least ``WORTH_SAYING`` less memory."""
    lr = cfg.learner
    if not cores or lr.num_ranks == 1 or lr.gpus_per_rank or lr.threads or cfg.rollout.max_staleness:
        return []
    one = changed(cfg, {"learner.num_ranks": 1})
    if one is None:
        return []
    alone = learner_estimate(one, m)
    saved = lr.num_ranks * learner_estimate(cfg, m).rss - alone.rss
    if saved < WORTH_SAYING:
        return []
    return [f"learner: 1 rank on all {cores} cores needs {size_text(saved)} less memory than {lr.num_ranks} ranks "
            f"and skips the all-reduce of {size_text(alone.parts.get('grads', 0.0))} of gradients per step; the two "
            "trained as fast as each other on 2 cores (docs/benchmarks.md, Layouts): learner.num_ranks=1"]


def reference_note(cfg: Config, est: dict[str, Estimate]) -> list[str]:
    """One line when a LoRA policy's base is its reference (``reference_in_learner``): the
    reference actors the job does not start, and the memory that saves."""
    if not reference_in_learner(cfg):
        return []
    saved = cfg.reference.num * est["reference"].peak
    where = "GPU memory" if est["reference"].device == "gpu" else "RSS"
    return [f"reference: the LoRA policy's base on the learner (its adapter off), no reference actor: "
            f"{size_text(saved)} of {where} not needed (model.reference names another model)"]
