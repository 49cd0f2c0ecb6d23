"""The compile stage's search: compiled configurations measured within a budget of device runs.

The eager search ranks checkpointing and batch on the eager estimate, and a compiled step
holds less than eager (a decoder's fp32 logits fused away, intermediates never stored), so
the eager pick is not the compiled optimum: on a 0.35B decoder at 8 GiB the eager pick
checkpointed 23 of 24 blocks at batch 7 (full checkpointing ran out at 8 in eager), where
compiled full checkpointing held batch 11 and ran 12% faster (issue 27). The search
therefore measures compiled variants of several eager combinations, not only of the pick:

1. Candidates (:func:`search_variants`): the eager pick's choices, the same in the plan's
   autocast precision where the pick has none (:func:`_autocast_instead`), then with the
   loss computed as the user's where the pick chunks it and the model is compiled whole
   (:func:`_users_loss_instead`), then the pick's choices with other checkpointed sets
   (none, half, all of what checkpointing offers; with the user's loss where that is
   searched), best by the estimate first, then a partitioner budget in place of the pick's
   checkpointing; at most :attr:`CompileSearch.max_candidates`. Each is compiled in its
   *search form*: each repeated block compiled (``regional``) where the profile's blocks
   repeat, which compiles about as many times faster as there are blocks (7 s against 46 s
   for 24 layers, ``docs/design.md``, "What a compile costs, by form"), unless the
   activations outside the blocks are :data:`REGIONAL_OUTSIDE_MAX` of the step's or more
   (a small LM's head and loss: the regional form leaves them eager) or one block type
   takes more than :data:`REGIONAL_MAX_SIZES` input sizes (a vision hierarchy's stages):
   then the whole model is compiled (:func:`regional_pays`); and with a dynamic batch
   (:attr:`CompileSearch.dynamic_batch`), so one graph in inductor's cache serves every
   batch the candidate's runs try; the pick is handed on static. A candidate that
   checkpoints blocks is measured static where this torch's caches do not take its graph
   (:func:`checkpointed_graphs_cached`, :attr:`CompileSearch.checkpointed_static`): each of
   its runs compiles afresh either way, and its run at the batch it is picked at is then
   the pick's verification, where a dynamic winner needs a static run more (the GPT
   example on an H100: 21.7 s of an 85 s plan). Forms that differ only so share one trial.
2. Pass 1: one run each, at the batch eager allows it (the estimate's, corrected by what the
   device found for the eager pick), so each gets a line of its compiled memory
   (:func:`~strategies._compile_model.fit_step`; from one run, eager's per-sample bytes
   scaled by what was measured). On a device that retries a run in its own process
   (``retries_in_process``: a card's fork server), a dynamic-batch run that runs out
   measures half its batch there, its graph serving it without a second compile
   (:meth:`Search._half`); such a retry is not counted among the search's runs. Where
   pass 1's group leaves the device runs free and the eager pick's runs waited on the host,
   the CUDA graphs' bets for its first candidate searched static go with it
   (:meth:`Search._pass_one_bets`, counted as graphs runs).
3. Pass 2: the candidates whose line says they could beat the eager pick, best first, one
   run more at the batch their line predicts, while the budget allows: a second point for
   the line where it matters, and the batch search's start. A candidate whose every run
   compiles afresh (checkpointed blocks on torch 2.11 CUDA) gets it only where its line is
   within :data:`SECOND_RUN_SHARE` of the best's: runs made at once wait for the slowest.
   Then, budget left, a candidate whose only run ran out gets one at half that batch
   (where its pass-1 retry in its own process ran out too, half the retry's). On a
   device of runs at once, where these runs leave runs free in their group, the leader's
   static form (the pick's verification if the leader stays the pick at that batch) goes
   with them, and those of candidates whose line is within :data:`SECOND_RUN_SHARE` of the
   leader's as room allows (:meth:`Search._static_riders`). Where the leader is searched
   static (checkpointed) and the group compiles cold anyway, a dynamic candidate's line is
   set against it at :data:`STATIC_GAIN_MAX`, and such a rider that then measures more than
   the winner's static confirmation by :data:`MIN_SPEEDUP` is the pick, as is a near
   rider that did (:meth:`Search.rode_past`). Where the search form is regional and the
   model has at most :data:`WHOLE_RIDER_MAX_BLOCKS` blocks, the whole model compiled rides
   too for the first candidate whose static form rides (else the leader), in the room left
   (:meth:`Search._whole_rider`), and is the pick where
   it ran :data:`MIN_SPEEDUP` more than the winner's static form (:meth:`Search.whole_past`).
4. The best by its line is confirmed by the device's batch search (``PickStage.confirm``)
   from its predicted batch (a line through dynamic-batch runs needs only
   :data:`DYNAMIC_ALLOWANCE` of the bar to be confirmed). Then its static form, the one the
   plan hands on and the user runs, is run once at that batch (``Search.confirm_static``):
   whether compiling pays is judged on that run, and it is the pick's verification. On a
   device of runs at once that run is made with the confirmation's first device run, at the
   predicted batch (``Search.confirm``'s ``static_beside``), and again only where the
   confirmation ends elsewhere. Where
   every run of the winner compiled afresh (:func:`compiles_every_run`: its dynamic batch
   saved nothing), the confirmation itself runs the static form, its searched runs bounding
   the descent, and no run follows it.
   With :attr:`CompileSearch.confirm_offered`, where the search form is not the offered one,
   the offered form (the whole model compiled) is confirmed from that batch too and the
   faster kept: off by default, as on a card that cost a cold whole-model compile per batch
   for a pick no faster (``docs/design.md``, "Searching under compile").

Every run counts against :attr:`CompileSearch.max_runs` (the two confirmations included:
runs are held back for them) and, before a run starts, :attr:`CompileSearch.max_seconds`.

Where the device makes several runs at once (``PickStage.concurrent_runs``: a card with room
for several budgets, each run a process capped at the budget), each pass sends its runs in
groups of that many (``PickStage.run_many``): their process starts and compiles, most of a
compiled run's 9-19 s on a card, overlap; their timed steps are taken in turn, after every
first step. The same runs are made, in the same order, as one at a time; the confirmations
are searches, a probe that may run out made at once with the batch taken next if it does
(``Prober._searched``: a compiled run runs out only after its compile).

Known limitations:
    * Whole or regional is decided from the profile (:func:`regional_pays`), not measured:
      the two thresholds come from six models on an H100 (``docs/design.md``, "Whole or
      regional"), and a model near them may search the slower form. The whole form compiles
      every candidate whole: hf_gpt2's compile stage took 169.6 s whole against 62.0 s
      regional (session 18), for a pick 1.66x faster. A regional search of a model of few
      blocks measures one candidate whole beside pass 2 (:meth:`Search._whole_rider`), not
      the others.
    * Where the winner's confirmation finds less than another candidate's own run measured,
      that candidate is confirmed too (:meth:`Search.rival`), one rival only; a candidate
      whose line was close but whose runs measured less is not.
    * Candidates vary the checkpointed set only; precision and the other choices stay the
      eager pick's.
    * The seconds budget is checked before a run starts; the confirmations are bounded in
      runs only.
    * On torch 2.11 (CUDA) inductor's caches do not take a graph with checkpointed blocks:
      every run of such a candidate compiles its blocks again, dynamic batch or not
      (``docs/design.md``, "A dynamic batch while searching"; torch 2.13 on a CPU caches it).
    * Pass 2's static riders are a bet that the pick is one of them at its pass-2 batch
      (six of six saved plans on a card kept the pass-2 batch; hf_gpt2's leader lost to a
      candidate 0.2% behind it by its line): where the pick is another, or its
      confirmation moves, the riders' runs were spent and the static form runs again; the
      group waits for their cold compiles (resnet50's pass 2 on an H200: 53.8 s with one).
    * A pass-1 retry in the run's own process starts after a failed step: its allocated
      peak is a fresh run's (the failed steps' memory freed), but the allocator's segments
      may be split, so it can run out where a fresh process would fit (the candidate then
      has no line from pass 1). Where the retry runs out too, both batches count as run out
      and pass 2 retries at half the retry's batch: a split allocator, not the batch, may
      have stopped the retry.
    * The candidates are ranked on their searched graphs, dynamic or (checkpointed, above)
      static; only the winner's static graph is run, and the riders' where pass 2 left room
      for them (a rider that ran faster is the pick: :meth:`Search.rode_past`). A static
      graph has run 17% faster than its dynamic one and as much slower, so a candidate can
      lose on its dynamic rate to one its static form would beat: hf_gpt2 on an H100
      (session 23) picked 4 blocks at 1898 on 94,943 samples/s dynamic against no
      checkpointing's 93,871 at 1020, and verified 92,847 static, where session 22's plan
      verified no checkpointing's static form at 1020 at 106,353. Where the static one runs
      out at the winner's batch, the search's pick goes to the verification, which steps the
      batch down.
    * Runs made at once time their steps in turn, after every sibling's first step (its
      compile) has ended, but a sibling's teardown may overlap them: their step times, which
      rank the candidates, are less sure than a lone run's. The winner's static run (the
      pick's verification) goes with its confirmation's first run, and those probes may
      have a partner beside them. A pick slower there than the eager pick is not handed on.
    * A static run made beside a confirmation that then ends at another batch is a compile
      spent for nothing (its process beside the other); it is counted as a static run. And
      runs at once take their timed steps after every first step, so the confirmation's
      first answer waits for the static form's cold compile (swin_t's: 55 s on a card
      against 16.5 s for its dynamic run's): where the confirmation then needs more runs,
      the plan is longer by the difference.
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from pydantic import BaseModel, ConfigDict, Field, JsonValue

from memadvisor import _torch_private
from memadvisor.errors import ProbeProcessError, is_our_bug
from memadvisor.schema.candidate import RETRY_RAN_OUT_HERE, Candidate, Measurement
from memadvisor.schema.plan import Probe, StepFit
from memadvisor.schema.profile import Profile
from memadvisor.strategy import Confirmed, Estimated, PickStage, Strategy, chosen_strategies
from strategies._compile_model import EagerLines, fit_step, predicted, samples_per_s
from strategies._compiled_forward import CompileChoice, parse_choice

__all__ = [
    "COMPILE",
    "MIN_SPEEDUP",
    "SECOND_RUN_SHARE",
    "CompileSearch",
    "Search",
    "Variant",
    "blocks_repeat",
    "checkpointed_graphs_cached",
    "static_when_checkpointed",
    "input_sizes",
    "outside_share",
    "recompute_axis",
    "recomputed_count",
    "regional_pays",
    "beats_eager",
    "could_beat",
    "search_variants",
    "worth",
]

COMPILE = "compile"
# Two timed steps a side: gains of a percent or two are within their noise, and a compiled
# model pays a compile in every process that trains it. Below this, eager is kept.
MIN_SPEEDUP = 1.03
# Runs held back from the candidates' passes: for the winner's batch search (its start ran in
# pass 2, so its edge usually costs one or two runs), and one for the offered form at the
# winner's batch.
CONFIRM_RUNS = 2
FINAL_FORM_RUNS = 1
# A candidate whose dynamic-batch compile failed is made again static (a compile per batch)
# where the eager pick checkpoints, is its own, or the eager estimate of its choices promises
# this share of the eager pick's measured samples/s (Search._worth_a_static_compile).
STATIC_RETRY_SHARE = 0.97
# Pass 2 gives a candidate whose every run compiles afresh (a checkpointed graph on torch 2.11
# CUDA: inductor's caches do not take it) a second run only where its line predicts this share
# of the best candidate's samples/s (Search._second_worth_a_compile): a line through one run
# has been off by a few percent (lm350m's winner: 103.4 samples/s dynamic, 111.3 static), not
# by a tenth.
SECOND_RUN_SHARE = 0.95
# A candidate measured with a dynamic batch is confirmed, and its static form run, where its
# line predicts this share of the bar or more: the static graph, which the pick is judged on,
# ran up to 10% faster on a card (lm350m's winner at batch 16, H100: 103.4 samples/s dynamic
# and 111.3 static in one plan, 102.2 and 112.8 in another). It also ran slower (the GPT
# example's 2-of-4-checkpointed winner at 254: 19,888 dynamic, 17,317 static), which the
# static run then says. Below this share the static form would need more than the gaps seen.
DYNAMIC_ALLOWANCE = 0.85
# How much faster a candidate's static graph has run than its dynamic one, at most: cnn's
# regional form without checkpointing at batch 2098 on an H100, 38,163 samples/s dynamic and
# 48,111 static (1.26x, session 22); hf_gpt2's whole model at 1020, 90,555 and 106,353
# (1.17x). Where pass 2's leader is searched static (checkpointed_static), a dynamic
# candidate's line is set against it at this gain (Search._static_riders).
STATIC_GAIN_MAX = 1.3
# Where this share of the step's activations or more is kept outside the repeated blocks (a
# small LM's head and loss, whose logits outweigh its blocks), candidates are compiled whole
# while searching, not block by block: the regional form leaves that part eager. On an H100 at
# 8 GiB, hf_gpt2 (0.33 of its fp32 activations outside its 4 blocks) held batch 1,339 at
# 90,619 samples/s with the whole model compiled (bf16, dynamic batch; session 17), where a
# plan's regional pick (bf16, 2 blocks checkpointed) held 879 at 47,696 (session 18); lm350m
# (0.04) ran 111.3 whole against 112.6 regional. gpt keeps 0.86 outside, the other bench
# models 0.03-0.10 (docs/design.md, "Whole or regional").
REGIONAL_OUTSIDE_MAX = 0.25
# Blocks of one type taking more input sizes than this (a vision hierarchy's stages) are
# searched with the whole model compiled: the regional form compiles the type's code again
# for each new size, and dynamo makes the dims that changed symbolic. On an H100 at 8 GiB
# (sessions 17-18), resnet50 (Bottlenecks at 4 sizes) ran 2,194 samples/s regional (1.02x
# eager) and 4,166 with the whole model compiled (188, bf16); swin_t (4 sizes) 1,706
# regional static, 3,266 whole (128). t5_base's T5Blocks take 2 (its encoder's and its
# decoder's sequence): regional ran 153.9 (24 blocks checkpointed, 57), whole at most 128.4.
REGIONAL_MAX_SIZES = 2
# Where the search form compiles each repeated block (regional) and the profile has at most
# this many blocks, one candidate's whole model compiled (its offered form, static) rides
# with pass 2 (Search._whole_rider): few blocks make the whole compile about as long as the
# group's checkpointed static runs (cnn's 6 blocks on an H200, session 42 call B: the whole
# model with 3 blocks checkpointed compiled in 25.2 s against 18.8 s regional, and ran
# 57,605 samples/s at 3203 against 50,247), where lm350m's 24 took 42-66 s whole (session 27).
WHOLE_RIDER_MAX_BLOCKS = 8
# The first torch release (major, minor) whose inductor caches were seen to take a graph with
# checkpointed blocks (checkpointed_graphs_cached): 2.13 on a CPU; 2.11 on a card never did.
CHECKPOINTED_CACHED_FROM = (2, 13)


# What runs beside pass 1 (the compile trial): why each variant it rules out may not be
# searched, by ``id`` of the variant.
Meanwhile = Callable[[], dict[int, str | None]]


class CompileSearch(BaseModel):
    """How far the compile stage searches (``Compile(search=...)``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_candidates: int = Field(
        4,
        ge=1,
        description="Compiled configurations measured at most: the eager pick's, then other "
        "checkpointed sets by the estimate, then a partitioner budget. Each is a compile in "
        "every process that runs it.",
    )
    max_runs: int = Field(
        8,
        ge=1,
        description="Device runs the stage may make, its batch searches included: each is a "
        "process that compiles (seconds for the regional form, tens of seconds whole).",
    )
    max_seconds: float | None = Field(
        None,
        gt=0,
        description="No candidate's run starts after the stage has taken this long (trials "
        "included); the confirmations still run. None: runs alone bound the stage.",
    )
    regional: bool = Field(
        True,
        description="Measure candidates with each repeated block compiled, where the "
        "profile's blocks repeat at one or two input sizes and hold most of the activations "
        "(regional_pays).",
    )
    dynamic_batch: bool = Field(
        True,
        description="Measure candidates with a dynamic batch dimension: one graph per "
        "candidate in inductor's cache serves every batch its runs try, where a static one "
        "compiles again for each new batch in each probe process. The pick is handed on in "
        "its static form, which the plan's verification runs (docs/design.md, 'A dynamic "
        "batch while searching').",
    )
    checkpointed_static: bool | None = Field(
        None,
        description="Measure candidates that checkpoint blocks in their static form though "
        "dynamic_batch is on: where inductor's caches do not take a checkpointed graph, each "
        "of their runs compiles afresh anyway, and a static run is also the verification of "
        "a pick at its batch. None: where this torch is not known to cache such graphs "
        "(checkpointed_graphs_cached; docs/design.md, 'Checkpointed candidates searched "
        "static').",
    )
    confirm_offered: bool = Field(
        False,
        description="After a regional search, also run the offered form (the whole model "
        "compiled) from the winner's batch and keep the faster. Off: the pick is the form "
        "searched. On a card (lm350m at 8 GiB, H200, docs/design.md) the whole model's "
        "confirmation cost 90 s of a 171 s compile stage, a cold whole-model compile for each "
        "batch it tried, and ran 111.3 samples/s at batch 9 against the regional pick's 112.6 "
        "at batch 10.",
    )
    whole_rider: bool = Field(
        True,
        description="Where the search form is regional and the model has at most "
        "WHOLE_RIDER_MAX_BLOCKS blocks, the whole model compiled (static, at its predicted "
        "batch) of the first candidate whose static form rides with pass 2 (else pass 2's "
        "leader) rides with pass 2 where its group has room, and is the pick "
        "where it ran MIN_SPEEDUP faster than the winner's static form: one cold compile "
        "beside the group, where confirm_offered is a batch search of its own after it "
        "(cnn at 8 GiB on an H200, session 42: whole 57,605 samples/s against regional "
        "50,247 at 3203).",
    )
    graphs_when_host_bound: bool = Field(
        True,
        description="Where the compiled pick's card waited on the host (host_bound_share), "
        "also confirm the pick replayed as CUDA graphs (reduce-overhead mode), at a batch of "
        "its own, and keep it where faster (strategies/_compile_graphs.py).",
    )
    host_bound_share: float = Field(
        0.8,
        gt=0.0,
        le=1.0,
        description="The share of a step the host takes to launch it from which the step is "
        "taken as host-bound: the GPT example's compiled pick took 0.99 of its step on an "
        "H200 while its kernels filled 0.62-0.75 of it; replayed as CUDA graphs, 0.60-0.84. "
        "Its picks whose probes read 0.81 and 0.87 launched 0.99 of a step in the user's loop "
        "and ran 0.84-0.93 of their verified rate, so the bar is 0.8, not 0.9 (docs/design.md, "
        "'CUDA graphs where the card waits on the host', sessions 29-30).",
    )
    graphs_runs: int = Field(
        3,
        ge=1,
        description="Device runs of the CUDA-graphs confirmation at most (each a compile), "
        "beyond max_runs.",
    )
    pass_one_steps: int | None = Field(
        None,
        ge=2,
        description="Steps of each pass-1 run where not the plan's (None, the default): pass "
        "1's runs rank the candidates and draw their lines, and a card's runs made at once "
        "take their timed steps in turn (t5_base's pass 1 on an H200, session 44: 18.3 s of "
        "its 48.1 s). 8, as the timing round's runs at once take, would leave 7 timed steps a "
        "run; a pick at a pass-1 batch is then run again for its own measurement. An A/B "
        "setting, not measured on a card yet.",
    )


@dataclass
class Variant:
    """One compiled configuration the search measures, and what its runs taught."""

    choices: dict[str, JsonValue]  # the eager choices and compile's search form
    # The form handed on: the offered one (confirm_offered), else the searched one, static.
    final_choices: dict[str, JsonValue]
    label: str  # 'checkpoint 12/24 blocks'
    start_batch: int  # pass 1's batch
    eager: EagerLines
    runs: dict[int, Measurement] = field(default_factory=dict)
    lowest_failure: int | None = None
    fit: StepFit | None = None
    error: str | None = None  # why its runs stopped (a device error), or why it never ran
    # Why it is searched static though the search form is dynamic: its dynamic-batch compile
    # failed (Search._static_instead), the compiler's error in one line.
    static_because: str | None = None
    trialled_as: JsonValue | None = None  # the form whose trial stands for it, where it moved
    # Its choices with the offered form, static (the whole model where the search form is
    # regional): what its whole-model rider runs (Search._whole_rider).
    offered_choices: dict[str, JsonValue] | None = None

    @property
    def static_pending(self) -> bool:
        """Sent static (:meth:`Search._static_instead`) and not yet run in that form."""
        return (
            bool(self.static_because)
            and not self.runs
            and self.error is None
            and (self.lowest_failure is None)
        )

    @property
    def trial_form(self) -> JsonValue:
        """The compile form whose trial stands for this candidate: its search form's, also
        where it went static after that form's trial passed."""
        return self.trialled_as if self.trialled_as is not None else self.form

    @property
    def form(self) -> JsonValue:
        return self.choices[COMPILE]

    def forget(self, error: str | None = None) -> None:
        """Its runs and line forgotten (made in a form not searched), ``error`` its answer."""
        self.runs.clear()
        self.lowest_failure, self.fit, self.error = None, None, error

    @property
    def static_choices(self) -> dict[str, JsonValue]:
        """Its choices with the search form's batch static: what a pick of it hands on."""
        return {**self.choices, COMPILE: _static(self.form)}

    @property
    def final_differs(self) -> bool:
        """Whether the form handed on differs from the searched one in more than a static
        batch: then it gets a run of its own (``Search.confirm_final``)."""
        searched, final = parse_choice(self.form), parse_choice(self.final_choices[COMPILE])
        same = searched is not None and final is not None and searched.static() == final
        others = {n: c for n, c in self.choices.items() if n != COMPILE}
        return not same or others != {n: c for n, c in self.final_choices.items() if n != COMPILE}


def blocks_repeat(profile: Profile) -> bool:
    """Whether two or more of the profile's blocks are of one type (a transformer's layers):
    where the regional form compiles one block for all."""
    counts = Counter(b.type_name for b in profile.blocks)
    return any(n >= 2 for n in counts.values())


def outside_share(profile: Profile) -> float:
    """The share of the fp32 step's activations (at the profile's larger batch) that no
    block keeps: the embeddings, the head, the loss. 0.0 where the profile has no blocks."""
    step = profile.steps.get("fp32")
    if step is None or not step.blocks:
        return 0.0
    batch = profile.batch_sizes[1]
    total = step.activation_total.at(batch)
    inside = sum(b.activation.at(batch) for b in step.blocks)
    return min(1.0, max(0.0, 1.0 - inside / total)) if total > 0 else 0.0


def input_sizes(profile: Profile) -> dict[str, int]:
    """By block type, how many different input sizes (bytes a sample, to the KiB) its blocks
    take in the fp32 step: 1 for a transformer's layers, 2 for an encoder's and a decoder's
    blocks of one class, one per stage for a vision hierarchy's."""
    step = profile.steps.get("fp32")
    if step is None:
        return {}
    sizes: dict[str, set[int]] = {}
    for info, block in zip(profile.blocks, step.blocks, strict=False):
        sizes.setdefault(info.type_name, set()).add(round(block.input.per_sample_bytes / 1024))
    return {name: len(found) for name, found in sizes.items()}


def regional_pays(profile: Profile) -> bool:
    """Whether the regional form is the one to search: the blocks repeat; what lies outside
    them is less than :data:`REGIONAL_OUTSIDE_MAX` of the activations (more, and the part
    the regional form leaves eager decides the step); and no block type takes more than
    :data:`REGIONAL_MAX_SIZES` input sizes (more, and the one compiled code recompiles per
    size with the changing dims made symbolic)."""
    return (
        blocks_repeat(profile)
        and outside_share(profile) < REGIONAL_OUTSIDE_MAX
        and max(input_sizes(profile).values(), default=1) <= REGIONAL_MAX_SIZES
    )


def checkpointed_graphs_cached(version: str | None = None) -> bool:
    """Whether this torch (or ``version``) is known to keep a graph with checkpointed blocks
    in inductor's FX graph and AOTAutograd caches, so that a dynamic-batch run of such a
    candidate in a new process loads it instead of compiling: torch
    :data:`CHECKPOINTED_CACHED_FROM` or newer.

    Known limitations: two points, not a rule read from torch. On torch 2.11 on a card every
    run of a checkpointed candidate said the caches would not take its graphs (session 10),
    and on torch 2.13 on a CPU the GPT example's checkpointed regional graph was found in a
    new process; 2.12, and 2.13 on a card, were not measured. Where this guesses wrong, a
    checkpointed candidate is searched in the other form: a compile more or fewer, the same
    pick."""
    text = str(torch.__version__ if version is None else version)
    found = re.match(r"(\d+)\.(\d+)", text)
    if found is None:
        return True  # an unknown build: searched as everything else is, dynamic
    return (int(found.group(1)), int(found.group(2))) >= CHECKPOINTED_CACHED_FROM


def static_when_checkpointed(settings: CompileSearch) -> bool:
    """Whether a candidate that checkpoints blocks is searched in its static form:
    :attr:`CompileSearch.checkpointed_static`, or where it is None, where this torch's
    caches are not known to take such a graph (:func:`checkpointed_graphs_cached`)."""
    if not settings.dynamic_batch:
        return True
    if settings.checkpointed_static is not None:
        return settings.checkpointed_static
    return not checkpointed_graphs_cached()


def search_form(
    choice: CompileChoice, profile: Profile, settings: CompileSearch, checkpoints: bool = False
) -> CompileChoice:
    """The form a candidate is measured in: regional where the settings ask and
    :func:`regional_pays`, with a dynamic batch where they ask for it, but for a candidate
    that ``checkpoints`` blocks where :func:`static_when_checkpointed`."""
    update: dict[str, bool] = {}
    if settings.regional and not choice.regional and regional_pays(profile):
        update["regional"] = True
    dynamic = settings.dynamic_batch and not (checkpoints and static_when_checkpointed(settings))
    if dynamic and not choice.dynamic_batch:
        update["dynamic_batch"] = True
    return choice.model_copy(update=update) if update else choice


def search_variants(
    stage: PickStage,
    eager: Confirmed,
    offered: Sequence[JsonValue],
    settings: CompileSearch,
    kept_share: Callable[[dict[str, JsonValue], int], float],
) -> tuple[list[Variant], list[str]]:
    """The candidates (:attr:`CompileSearch.max_candidates` at most, the eager pick's first)
    and the labels of those left out.

    ``kept_share(choices, batch)`` gives a partitioner budget for the eager pick's
    checkpointing (:func:`strategies._compile_stage.kept_share`).
    """
    profile, strategies = stage.profile, stage.strategies
    parsed = [p for p in (parse_choice(c) for c in offered) if p is not None]
    plain = [p for p in parsed if p.activation_memory_budget is None]
    budgeted = [p for p in parsed if p.activation_memory_budget is not None]
    own = {name: c for name, c in eager.candidate.choices.items() if name != COMPILE}
    recomputing = _recomputing(own, strategies)
    # The device's correction of the estimate for the eager pick: the others' starts take it.
    own_scored = stage.score(own)
    scale = eager.found_batch / own_scored.largest_batch if own_scored else 1.0

    found: list[tuple[dict[str, JsonValue], CompileChoice, int]] = []
    for choice in plain:
        found.append((own, choice, eager.found_batch))

    def start_of(scored: Estimated) -> int:
        """The estimate's batch for a candidate, with the device's correction."""
        return max(1, min(int(scored.largest_batch * scale), stage.config.max_batch))

    lowered = _autocast_instead(stage, own)
    lowered_searched = False
    if plain and lowered is not None:
        scored = stage.score(lowered)
        if scored is not None:
            found.append((lowered, plain[0], start_of(scored)))
            lowered_searched = True
    users_loss = _users_loss_instead(lowered or own, strategies)
    searched_loss: dict[str, JsonValue] | None = None  # users_loss, where it is searched
    if plain and users_loss is not None and not search_form(plain[0], profile, settings).regional:
        scored = stage.score(users_loss)
        if scored is not None:
            found.append((users_loss, plain[0], start_of(scored)))
            searched_loss = users_loss
    others = []
    axis = recompute_axis(stage)
    axis_name = axis[0] if axis is not None else None
    if plain and axis is not None:
        name, options = axis
        # Where the autocast candidate is searched, the checkpointing axis varies it, not
        # the eager pick's precision (_autocast_instead says why); where the user's loss is
        # searched, it varies that: compiled whole, the chunks cost more than they save
        # (_users_loss_instead says why).
        base = lowered if lowered_searched and lowered is not None else own
        if searched_loss is not None:
            base = searched_loss
        for option in _spread(options):
            choices = {n: c for n, c in base.items() if n != name}
            if not _neutral(strategies, name, option):
                choices[name] = option
            scored = stage.score(choices) if choices not in (own, base) else None
            if scored is not None:
                others.append((_worth(stage.config.objective, scored), choices, start_of(scored)))
    others.sort(key=lambda item: item[0], reverse=True)
    found += [(choices, plain[0], start) for _, choices, start in others]
    if recomputing:
        without = {n: c for n, c in own.items() if n not in recomputing}
        for choice in budgeted:
            share = kept_share(own, eager.found_batch)
            budget = choice.model_copy(update={"activation_memory_budget": share})
            found.append((without, budget, eager.found_batch))

    # The loss strategies the user's-loss candidates drop: a candidate without them computes
    # the loss as the user's (the user's-loss candidate and the axis's built on it).
    dropped = set(own) - set(searched_loss) if searched_loss is not None else set()
    variants: list[Variant] = []
    seen: set[str] = set()
    left_out: list[str] = []
    for choices, choice, start in found:
        form = search_form(choice, profile, settings, bool(_recomputing(choices, strategies)))
        variant = Variant(
            choices={**choices, COMPILE: form.to_json()},
            final_choices={
                **choices,
                COMPILE: (choice if settings.confirm_offered else form).static().to_json(),
            },
            label=label(choices, form, len(profile.blocks), strategies)
            + (
                _users_loss_words(own, choices, axis_name)
                if dropped and not dropped & set(choices)
                else "".join(f", {w}" for w in [_changed(own, choices, axis_name)] if w)
            ),
            start_batch=start,
            eager=EagerLines.of(profile, choices, stage.strategies, start),
            offered_choices={**choices, COMPILE: choice.static().to_json()},
        )
        key = repr(sorted(variant.choices.items()))
        if key in seen:
            continue
        seen.add(key)
        if len(variants) < settings.max_candidates:
            variants.append(variant)
        else:
            left_out.append(variant.label)
    return variants, left_out


def _recomputing(choices: dict[str, JsonValue], strategies: Sequence[Strategy]) -> set[str]:
    """The strategies among ``choices`` that recompute blocks (their facts say so)."""
    candidate = Candidate(batch_size=1, choices=choices)
    chosen = chosen_strategies(candidate, strategies)
    return {s.name for s, c in chosen if s.facts(c).recomputed_blocks}


def recompute_axis(stage: PickStage) -> tuple[str, list[JsonValue]] | None:
    """The first strategy whose options in this plan recompute blocks (block checkpointing),
    and those options; None when none does."""
    for strategy in stage.strategies:
        options = stage.options.get(strategy.name, [])
        if any(strategy.facts(o).recomputed_blocks for o in options if o is not None):
            return strategy.name, options
    return None


def _changed(
    own: dict[str, JsonValue], choices: dict[str, JsonValue], besides: str | None = None
) -> str:
    """``'bf16'``: the choices that differ from ``own``'s, for a candidate's label; not
    ``besides``'s (the checkpointing axis, which the label says in its own words). Empty
    for the eager pick's own choices and the budgeted ones."""
    return ", ".join(str(c) for n, c in choices.items() if n != besides and own.get(n) != c)


def _autocast_instead(stage: PickStage, own: dict[str, JsonValue]) -> dict[str, JsonValue] | None:
    """The eager pick's choices with the plan's autocast precision (bf16, fp16) where the
    pick trains without one though that precision passed its check; else None.

    Why: eager, autocast's casts can cost more than they save on a small model, and the
    eager pick keeps fp32 or tf32; compiled, the casts fuse away and the activations'
    bytes halve. On an H100 at 8 GiB, hf_gpt2's eager pick was tf32 (624 at 23,473
    samples/s against bf16's 773 at 20,038), its compiled pick tf32 too (625 at 52,706),
    while bf16 compiled held 1,339 at 90,619 with a dynamic batch (session 17): the
    search never compiled bf16.

    The checkpointing axis's candidates are built on this one where it is searched
    (:func:`search_variants`): compiled, hf_gpt2's bf16 ran 1.3-1.46x tf32's rate at batch
    1020 alone on an H100, and a tf32 eager pick's plan, whose axis varied tf32, picked
    75,238 samples/s where a bf16 eager pick's found 92,602 with 4 blocks checkpointed
    (session 21, docs/design.md).

    Known limitations: one precision, the first the plan offers with an autocast; where it
    is searched, the eager pick's precision is searched only with its own checkpointing (a
    model whose compiled step runs faster without the autocast loses the axis there)."""
    for strategy in stage.strategies:
        options = stage.options.get(strategy.name, [])
        lowering = [o for o in options if o is not None and strategy.facts(o).autocast]
        if not lowering:
            continue
        mine = own.get(strategy.name)
        if mine is not None and strategy.facts(mine).autocast:
            return None  # the pick has one already
        return {**own, strategy.name: lowering[0]}
    return None


def _users_loss_instead(
    choices: dict[str, JsonValue], strategies: Sequence[Strategy]
) -> dict[str, JsonValue] | None:
    """``choices`` without the strategies that compute the loss another way (their facts say
    ``loss_changed``: the chunked loss head); None where none of them does.

    Why: a chunked loss saves eager the fp32 logits, but compiled whole the head and the
    loss fuse, and the chunks' loop stays in the graph. On an H200 at 8 GiB (session 20)
    hf_gpt2's eager pick came out tf32 with 4 blocks checkpointed and the loss in 32 chunks
    (33,966 samples/s, its near rivals within noise); every compiled candidate kept the
    chunks, and the pick ran 64,013 samples/s where bf16 compiled with the user's loss had
    run 118,749 (session 19). The candidates are the eager pick's choices varied, so this
    one is searched beside them, and where it is, the checkpointing axis's candidates are
    built on it (:func:`search_variants`): on an H200 (session 40) hf_gpt2's eager pick again
    chunked the loss with 4 blocks checkpointed, this candidate kept the 4 blocks (57,626
    samples/s at 859), the axis kept the chunks (no checkpointing: 33,881 at 2153), and the
    pick ran 63,815, where session 39's plan of the same model (its eager pick did not
    chunk) had picked no checkpointing with the user's loss at 127,565.

    Known limitations: only where the search form compiles the whole model (regional, the
    loss stays eager and the chunks keep their saving); at the autocast precision where the
    search adds one; the chunks are then searched with the eager pick's checkpointed set
    only."""
    candidate = Candidate(batch_size=1, choices=choices)
    changed = {
        s.name for s, c in chosen_strategies(candidate, strategies) if s.facts(c).loss_changed
    }
    if not changed:
        return None
    return {n: c for n, c in choices.items() if n not in changed}


def _users_loss_words(
    own: dict[str, JsonValue], choices: dict[str, JsonValue], besides: str | None = None
) -> str:
    """``', bf16, the loss as yours'``: what sets a user's-loss candidate apart (not
    ``besides``'s choice, the checkpointing axis, which the label says in its own words)."""
    precision = _changed(own, choices, besides)
    return f"{', ' + precision if precision else ''}, the loss as yours"


def _neutral(strategies: Sequence[Strategy], name: str, choice: JsonValue) -> bool:
    strategy = next(s for s in strategies if s.name == name)
    return choice is None or strategy.is_neutral(choice)


def _spread(options: Sequence[JsonValue]) -> list[JsonValue]:
    """Of a recompute strategy's options (none first, then ever more blocks, as block
    checkpointing offers them): none, half, all."""
    if len(options) < 2:
        return []
    picks = [options[0], options[len(options) // 2], options[-1]]
    out: list[JsonValue] = []
    for option in picks:
        if option not in out:
            out.append(option)
    return out


def _worth(objective: str, scored) -> tuple:
    if objective == "largest_batch":
        return (scored.largest_batch, scored.estimate.samples_per_s)
    return (scored.estimate.samples_per_s,)


def recomputed_count(choices: dict[str, JsonValue], strategies: Sequence[Strategy]) -> int:
    """How many blocks ``choices`` recompute in backward (their strategies' facts say)."""
    chosen = chosen_strategies(Candidate(batch_size=1, choices=choices), strategies)
    return sum(len(s.facts(c).recomputed_blocks) for s, c in chosen)


def label(
    choices: dict[str, JsonValue],
    choice: CompileChoice,
    blocks: int,
    strategies: Sequence[Strategy],
) -> str:
    """``'checkpoint 12/24 blocks'``, ``'no checkpointing, partitioner budget 0.6'``: what
    sets a candidate apart, in a few words (its mode when not the default)."""
    count = recomputed_count(choices, strategies)
    words = [f"checkpoint {count}/{blocks} blocks" if count else "no checkpointing"]
    if choice.activation_memory_budget is not None:
        words.append(f"partitioner budget {choice.activation_memory_budget:g}")
    if choice.mode != "default":
        words.append(f"{choice.mode} mode")
    return ", ".join(words)


def worth(objective: str, batch: int, samples_per_s: float) -> tuple:
    """A pick of ``batch`` at ``samples_per_s``, as the objective ranks picks: by batch, then
    throughput, for ``largest_batch``; by throughput else."""
    return (batch, samples_per_s) if objective == "largest_batch" else (samples_per_s,)


def beats_eager(
    objective: str, batch: int, samples_per_s: float, eager: Confirmed, allowance: float = 1.0
) -> bool:
    """Whether a pick of ``batch`` at ``samples_per_s`` is worth a compile per process over
    ``eager``: :data:`MIN_SPEEDUP` (times ``allowance``) of its rate, or, for
    ``largest_batch``, a larger batch."""
    eager_batch = eager.candidate.batch_size
    if objective == "largest_batch" and batch != eager_batch:
        return batch > eager_batch
    return samples_per_s >= MIN_SPEEDUP * allowance * eager.measured.samples_per_s


def could_beat(
    objective: str, fit: StepFit | None, eager: Confirmed, allowance: float = 1.0
) -> bool:
    """Whether a line predicts a pick worth a compile per process over ``eager``; a line
    through dynamic-batch runs is held to ``allowance`` of the bar (:data:`DYNAMIC_ALLOWANCE`):
    the static form the pick is judged on may run faster."""
    if fit is None or fit.largest_batch < 1:
        return False
    return beats_eager(objective, fit.largest_batch, fit.samples_per_s, eager, allowance)


def _allowance(v: Variant) -> float:
    return DYNAMIC_ALLOWANCE if is_dynamic(v.form) else 1.0


def _worth_of(objective: str, v: Variant) -> tuple:
    """What ``v``'s line predicts, as the objective ranks it."""
    if v.fit is None:
        return (0, 0.0)
    return worth(objective, v.fit.largest_batch, v.fit.samples_per_s)


@dataclass
class _Asked:
    """Each candidate's number among those searched ('candidate 2/4')."""

    number: dict[int, int]
    total: int

    def of(self, v: Variant) -> tuple[int, int]:
        return self.number[id(v)], self.total


#: A candidate's CUDA graphs' first round: (choices, batch) runs (Search.graphs_ahead).
_GraphsAhead = Callable[["Variant"], list[tuple[dict[str, JsonValue], int]]]
#: A candidate's CUDA graphs' bets at a batch within some runs (Search.graphs_bet).
_GraphsBet = Callable[["Variant", int, int], list[tuple[dict[str, JsonValue], int]]]


class Search:
    """The passes over the candidates, counting the stage's device runs and time."""

    def __init__(self, stage: PickStage, settings: CompileSearch, eager: Confirmed) -> None:
        self.stage, self.settings, self.eager = stage, settings, eager
        self.runs_before = len(stage.probes)
        self.started = time.perf_counter()
        # Static forms run: the pick's (confirm_static), pass 2's riders, the confirmation's
        # static_beside. Not the search's runs.
        self.static_runs = 0
        # Pass-1 runs of a form the trial then sent static, made again: not the search's.
        self.void_runs = 0
        # Pass-1 runs retried at half their batch in their own process: not the search's.
        self.free_retries = 0
        # Runs of the pick's CUDA-graphs form (strategies/_compile_graphs.py), made after the
        # search within CompileSearch.graphs_runs, or ahead of it beside a static run (pass
        # 2's riders, the confirmation's, the pick's static run): not the search's.
        self.graphs_runs = 0
        # The CUDA graphs' first round for a candidate's static form at its predicted batch,
        # where its largest run waited on the host ([] where not, and by default): set by the
        # compile stage (_compile_graphs.first_round), which this module may not import.
        self.graphs_ahead: _GraphsAhead = lambda v: []
        # The CUDA graphs' bets for a candidate's static form at a batch, within a number of
        # runs, where the eager pick's runs waited on the host ([] where not, and by
        # default): set by the compile stage (_compile_graphs.bets_within), for pass 1.
        self.graphs_bet: _GraphsBet = lambda v, batch, room: []
        # The graphs choices riding with pass 1 or 2 (counted as graphs runs, not static ones).
        self.graphs_riding: list[dict[str, JsonValue]] = []
        # Pass 2's fallbacks (_fallback): made ahead beside a static run at its line's
        # batch, the search's runs where taken (_take_fallback, or the confirmation).
        self.fallbacks: list[tuple[dict[str, JsonValue], int]] = []
        # Candidates pass 2 left at one run (_second_worth_a_compile), by label.
        self.second_skipped: list[str] = []
        # Pass 2's riders (_static_riders): those sent, "label at batch"; and why a near
        # candidate's static form did not ride, by label (the leader's alone where pass 2
        # leaves no room): what a card's plan shows of it.
        self.riders: list[str] = []
        self.not_riding: dict[str, str] = {}
        # Candidates whose static form rode with pass 2, by id: rode_past weighs their
        # riders against the pick.
        self.rode: set[int] = set()
        # The whole model's riders (_whole_rider): the offered choices that rode, by the
        # candidate's id; whole_past weighs them against the winner's static form.
        self.whole_riders: dict[int, dict[str, JsonValue]] = {}
        # The whole model's trial in this process (the plan's compile check reuses it), made
        # beside pass 2's group where its whole model rides: set by the compile stage.
        self.trial_whole: Callable[[dict[str, JsonValue]], None] = lambda choices: None

    @property
    def runs_used(self) -> int:
        made = len(self.stage.probes) - self.runs_before
        return made - self.static_runs - self.void_runs - self.free_retries - self.graphs_runs

    @property
    def runs_left(self) -> int:
        return max(0, self.settings.max_runs - self.runs_used)

    def _allowed(self, reserve: int, free: int = 0, made: int = 0) -> int:
        """How many runs the search may make now (:meth:`_run_in_groups`' next group at most):
        those beyond ``reserve`` while time is left, and the first ``free`` of a call
        whenever any run is left at all (``made`` of them made already). :meth:`_static_riders`
        and :meth:`_pass_one_bets` size the room a first group leaves by the same count."""
        allowed = self.runs_left - reserve if self._may_run(reserve) else 0
        if made < free:
            allowed = max(allowed, min(self.runs_left, free - made))
        return allowed

    def _may_run(self, reserve: int) -> bool:
        seconds = self.settings.max_seconds
        in_time = seconds is None or time.perf_counter() - self.started < seconds
        return in_time and self.runs_left > reserve

    def best(self, variants: Sequence[Variant]) -> Variant | None:
        """The candidate whose line predicts the most (the objective's way), the first of
        equals; None when none has a line."""
        objective = self.stage.config.objective
        fitted = [v for v in variants if v.fit is not None and v.fit.largest_batch >= 1]
        if not fitted:
            return None
        return max(fitted, key=lambda v: _worth_of(objective, v))

    def measure(
        self,
        variants: Sequence[Variant],
        meanwhile: Meanwhile | None = None,
        then: Meanwhile | None = None,
    ) -> Variant | None:
        """Passes 1 and 2 (module docstring), then one retry at half the batch for candidates
        whose only run ran out; the winner by its line when it could beat the eager pick, else
        None. A retry comes last: a configuration that runs out of memory compiled where eager
        fits is rarely the best one.

        ``meanwhile`` (the compile trial in this process) is called while pass 1's runs are
        on the device, where the device makes its runs in processes of their own
        (``PickStage.concurrent_runs`` above 1); it answers, by ``id`` of a variant, why a
        variant may not be searched (its form did not compile), and may change a variant's
        choices (a dynamic form that failed, searched static): such a variant's pass-1 run
        is made again in its new form, while ``then`` (that static form's trial) runs, whose
        answer drops variants as ``meanwhile``'s does. Elsewhere both are called before
        pass 1, one after the other."""
        objective = self.stage.config.objective
        reserve = CONFIRM_RUNS + (FINAL_FORM_RUNS if any(v.final_differs for v in variants) else 0)
        number = {id(v): i for i, v in enumerate(variants, 1)}
        ask = _Asked(number, len(variants))
        # Pass 1: the first candidate runs whenever a run is left; the others within the
        # runs not held back for the confirmations.
        first = [(v, v.start_batch) for v in variants]
        if self.stage.concurrent_runs <= 1:  # runs in this process: one thing at a time
            out: set[int] = set()
            for step in (meanwhile, then):
                if step is not None:
                    out |= self._drop(variants, step())
            first = [(v, b) for v, b in first if id(v) not in out]
            meanwhile = then = None
        bets = self._pass_one_bets(first, reserve)
        if meanwhile is None:
            not_run = self._run_in_groups(first, ask, reserve, 1, riders=bets, retry=True)
        else:
            before = {id(v): dict(v.choices) for v in variants}
            not_run, dropped = self._beside(
                first, ask, reserve, 1, meanwhile, retry=True, riders=bets
            )
            out = self._drop(variants, dropped)
            changed = [v for v in variants if id(v) not in out and v.choices != before[id(v)]]
            for v in changed:  # measured in a form that is not searched: measured again
                v.forget()
            self.void_runs += sum(1 for v in changed if all(v is not w for w, _ in not_run))
            not_run = [(v, b) for v, b in not_run if id(v) not in out and v not in changed]
            again = [(v, v.start_batch) for v in changed]
            if then is None:
                not_run += self._run_in_groups(again, ask, reserve)
            else:
                left, later = self._beside(again, ask, reserve, 0, then)
                out = self._drop(variants, later)
                not_run += [(v, b) for v, b in left if id(v) not in out]
        for v, _ in not_run:
            v.error = v.error or self._spent(reserve)
        promising = [v for v in variants if could_beat(objective, v.fit, self.eager, _allowance(v))]
        ranked = sorted(promising, key=lambda v: _worth_of(objective, v), reverse=True)
        second: list[tuple[Variant, int]] = []
        for v in ranked:
            assert v.fit is not None
            batch = v.fit.largest_batch
            if v.fit.basis == "fitted" or batch in v.runs or v.error is not None:
                continue
            if v is not ranked[0] and not self._second_worth_a_compile(v, ranked[0]):
                self.second_skipped.append(v.label)
                continue
            second.append((v, batch))
        # Then a retry at half the batch for a candidate whose only run ran out: it has no
        # line, so it is none of the above, and its run goes in the same groups after them.
        retries = [
            (v, v.lowest_failure // 2)
            for v in variants
            if not v.runs
            and v.lowest_failure is not None
            and v.lowest_failure >= 2
            and v.error is None
        ]
        pass_two = second + retries
        riders = self._static_riders(ranked, pass_two, reserve)
        wholes = [c for c, _ in riders if c in self.whole_riders.values()]
        if wholes:
            # The whole model's trial here while the group runs: where its rider is the pick,
            # the plan's compile check finds it made (the Llama example on an H200, session
            # 42 call D: 13.5 s of checks after the search where it was made after).
            def trial() -> dict[int, str | None]:
                self.trial_whole(wholes[0])
                return {}

            self._beside(pass_two, ask, reserve, 0, trial, riders=riders)
        else:
            self._run_in_groups(pass_two, ask, reserve, riders=riders)
        winner = self.best([v for v in variants if v.error is None or v.runs])
        if winner is None or not could_beat(objective, winner.fit, self.eager, _allowance(winner)):
            return None
        return winner

    def _beside(
        self,
        runs: list[tuple[Variant, int]],
        ask: _Asked,
        reserve: int,
        free: int,
        call: Meanwhile,
        retry: bool = False,
        riders: Sequence[tuple[dict[str, JsonValue], int]] = (),
    ) -> tuple[list[tuple[Variant, int]], dict[int, str | None]]:
        """``runs`` made on the device (:meth:`_run_in_groups`, waited for on a thread) while
        ``call`` runs here; (the runs not made, what ``call`` answered). This thread is the
        one that compiles (dynamo and triton are not thread-safe); the other only waits on
        the device's processes.

        Where ``call`` raises (a Ctrl-C during the trial), it propagates at once, without
        waiting for the runs: the plan's end closes the device, which ends them."""
        with self.stage.side_by_side():  # the line says both: the trial here, the runs there
            # The runs' timed steps wait for this process's compile (a card's host is one),
            # held from before they start and let go before they are waited for.
            busy = contextlib.ExitStack()
            busy.enter_context(self.stage.compiling_here())
            pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="compile-runs")
            pending = pool.submit(
                self._run_in_groups, runs, ask, reserve, free, riders=riders, retry=retry
            )
            try:
                try:
                    answered = call()
                finally:
                    busy.close()
            except BaseException:
                pool.shutdown(wait=False, cancel_futures=True)
                raise
            try:
                return pending.result(), answered
            finally:
                pool.shutdown()

    def _pass_one_bets(
        self, first: Sequence[tuple[Variant, int]], reserve: int
    ) -> list[tuple[dict[str, JsonValue], int]]:
        """The CUDA graphs' bets that go with pass 1's first group where it leaves the device
        runs free (:attr:`graphs_bet`: where the eager pick's runs waited on the host): for
        the first candidate searched static (its pass-1 run is at the batch it is verified
        at where it stays there), else the first candidate, at its pass-1 batch; none where
        the device makes one run at a time, the group is full, or for ``largest_batch``.

        Why: where pass 1 decides the search (each candidate's run at the batch its line
        then predicts, no pass 2), the graphs' first round waited for the whole compile
        stage and ran alone after it: the GPT example on an H200 (session 34 call 5) ran
        pass 1's three runs at once (30.7 s, a fourth run free), then the graphs of its
        pick, the first candidate searched static (2 blocks checkpointed at 307), at 154
        and 246 alone (23.0 s). Of fourteen such plans in sessions 31-34, ten picked that
        candidate's graphs at 246, two another candidate's (4 blocks at 249), two the
        eager pick's choices (no checkpointing at 242, after a pass 2).

        Known limitations: a bet on a candidate that is not the pick, or whose own compiled
        runs then do not wait on the host, is a run spent (counted as a graphs run, and said
        where unused); it compiles beside pass 1's runs and the trial on the host's cores."""
        at_once = self.stage.concurrent_runs
        if at_once <= 1 or not first or self.stage.config.objective == "largest_batch":
            return []
        group = min(len(first), at_once, max(0, self._allowed(reserve, free=1)))
        room = at_once - group
        if group <= 0 or room <= 0:
            return []
        v, batch = next(((v, b) for v, b in first if not is_dynamic(v.form)), first[0])
        bets = self.graphs_bet(v, batch, room)
        if bets:
            self.graphs_riding.append(bets[0][0])
            batches = ", ".join(str(b) for _, b in bets)
            self.riders.append(f"CUDA graphs of {v.label} at {batches}, with pass 1")
        return bets

    @staticmethod
    def _drop(variants: Sequence[Variant], why_not: dict[int, str | None]) -> set[int]:
        """Variants ``why_not`` names (by ``id``) out of the search, their runs forgotten and
        their error its answer; returns their ids."""
        for v in variants:
            if id(v) in why_not:
                v.forget(why_not[id(v)])
        return set(why_not)

    def rival(
        self, variants: Sequence[Variant], winner: Variant, found: Confirmed | None
    ) -> Variant | None:
        """The candidate other than ``winner`` whose own run measured more than ``winner``'s
        confirmation found (anything that beats the eager pick, where it found nothing): a
        run that fitted within the pick's limit, the objective's way; None when there is none.

        Why: the winner is chosen by its line, and a line from one run (eager's bytes scaled
        by what it measured) can promise more than its confirmation then finds. On a card
        (lm350m, H100, 8 GiB) the partitioner-budget candidate's line, from one run at batch
        10 after 20 ran out, predicted 133.4 samples/s at 14; its confirmation found 12 at
        118.2, while full checkpointing had already run 126.9 at 23, its line's own edge.
        """
        objective = self.stage.config.objective
        bar = None
        if found is not None:
            bar = worth(objective, found.candidate.batch_size, found.measured.samples_per_s)
        best: Variant | None = None
        for v in variants:
            if v is winner or v.error is not None:
                continue
            for batch, m in v.runs.items():
                if self.stage.held_bytes(m) > self.stage.limit_bytes:
                    continue
                rate = m.samples_per_s
                if not beats_eager(objective, batch, rate, self.eager, _allowance(v)):
                    continue
                key = worth(objective, batch, rate)
                if bar is None or key > bar:
                    best, bar = v, key
        return best

    def confirm(
        self,
        winner: Variant,
        hold_back: int,
        static: bool = False,
        static_beside: bool = False,
        graphs_beside: Sequence[tuple[dict[str, JsonValue], int]] = (),
        graphs_next: Sequence[tuple[dict[str, JsonValue], int]] = (),
    ) -> Confirmed | None:
        """The winner's batch search from its predicted batch, ``hold_back`` runs kept for
        later; None when nothing fitted (or its runs failed: ``winner.error``). ``static``:
        in its static form, the one handed on, its searched runs bounding the descent (where
        every run of it compiles anyway: :func:`compiles_every_run`). ``static_beside``: its
        static form at the predicted batch goes with the search's first device run
        (``PickStage.confirm``'s ``beside``), counted as a static run, not the search's:
        where the search keeps that batch, :meth:`confirm_static` finds it made.
        ``graphs_beside``: the CUDA graphs' first round for the static form at that batch
        (``_compile_graphs.first_round``), sent with it as far as the device makes runs at
        once, counted as graphs runs; where the search keeps the batch, the graphs step
        finds them made. ``graphs_next``: the CUDA graphs search's first run after its bets
        (``_compile_graphs.next_round``), sent with the first device run whatever the
        form, counted as a graphs run.

        Why: the static run is a compile of its own, the search's runs one after another
        before it. On an H100 swin_t's confirmation ran 120 (out, 19.8 s) from its
        predicted 115, then its static form at 115 (58.4 s); resnet50's ran 170 (12.8 s),
        then its static form at 170 (31.7 s). Beside the first, each static run's compile
        overlaps it (docs/design.md, session 16)."""
        assert winner.fit is not None
        start = winner.fit.largest_batch
        in_static = winner.static_choices  # what is handed on
        choices = in_static if static else winner.choices
        beside: list[tuple[dict[str, JsonValue], int]] = []
        static_sent = static_beside and not static and is_dynamic(winner.form)
        if static_sent:
            beside = [(in_static, start), *graphs_beside]
        beside += list(graphs_next)
        form = " in its static form" if static else ""
        self.stage.describe(f"compile: confirming {winner.label}{form} from batch {start}")
        before = len(self.stage.probes)
        try:
            return self.stage.confirm(
                choices,
                start,
                max_runs=max(0, self.runs_left - hold_back),
                within=MIN_SPEEDUP - 1.0,
                floor_from=winner.choices if static else None,
                ceiling=confirm_ceiling(winner),
                beside=beside,
            )
        except Exception as e:  # noqa: BLE001 - a compiled run failing on the device keeps eager
            if is_our_bug(e):
                raise
            winner.error = first_line(e)
            return None
        finally:
            if static_sent:
                self.static_runs += self._made_since(before, in_static)
            if static_sent and graphs_beside:
                self.graphs_runs += self._made_since(before, graphs_beside[0][0])
            if graphs_next:
                self.graphs_runs += self._made_since(before, graphs_next[0][0])

    def confirm_final(self, winner: Variant, found: Confirmed) -> tuple[Confirmed | None, str]:
        """The offered form of ``winner`` from ``found``'s batch, judged against ``found``'s
        run (``PickStage.confirm``'s ``like``); (None, why) when it did not run."""
        batch = found.candidate.batch_size
        if self.runs_left == 0:
            return None, f"not run: the search's {self.settings.max_runs} device runs were spent"
        self.stage.describe(f"compile: the offered form at batch {batch} ({winner.label})")
        try:
            final = self.stage.confirm(
                winner.final_choices,
                batch,
                like=found,
                max_runs=self.runs_left,
                within=MIN_SPEEDUP - 1.0,
            )
        except Exception as e:  # noqa: BLE001 - as confirm: the searched form stays
            if is_our_bug(e):
                raise
            return None, first_line(e)
        return final, "" if final is not None else "no batch of it fitted within its runs"

    def confirm_static(
        self,
        winner: Variant,
        found: Confirmed,
        beside: Sequence[tuple[dict[str, JsonValue], int]] = (),
    ) -> tuple[Confirmed | None, str]:
        """The winner's static form (what the plan hands on and the user runs) at ``found``'s
        batch, one run; (None, why) where it ran out or failed. ``beside``: runs to go with
        it where the device makes runs at once, as many as it makes beside it (the CUDA
        graphs' first round, ``_compile_graphs.first_round``), counted as graphs runs, not
        the search's; their answers are recorded, for the stage to find made.

        Why: the search measures a dynamic batch, and on a card the static graph ran at
        another speed, faster or slower (lm350m at batch 16 on an H100: 103.4 samples/s
        dynamic, 111.3 static; the GPT example's winner at 254: 19,888 dynamic, 17,317
        static). Whether compiling pays is then judged on the static run. It is not
        counted in :attr:`CompileSearch.max_runs`: it is the pick's verification, made here
        (its steps are the verifying steps on a card, and the plan's verification reads it),
        not a run more."""
        static = handed_on(found)
        batch = static.candidate.batch_size
        choices = static.candidate.choices
        along = list(beside)[: max(0, self.stage.concurrent_runs - 1)]
        words = f"compile: the static form at batch {batch} ({winner.label})"
        if along:
            batches = ", ".join(str(b) for _, b in along)
            words += f"; beside it, CUDA graphs at batch {batches}"
        self.stage.describe(words)
        before = len(self.stage.probes)
        try:
            # Made already where it went beside the confirmation (Search.confirm): answered.
            if along:
                answer = self.stage.run_many([(choices, batch), *along])[0]
                if isinstance(answer, Exception):
                    raise answer
                m = answer
            else:
                m = self.stage.run(choices, batch)
        except Exception as e:  # noqa: BLE001 - a failing static form keeps the searched pick
            if is_our_bug(e):
                raise
            return None, first_line(e)
        finally:
            made = self._made_since(before, choices)
            self.static_runs += made
            self.graphs_runs += len(self.stage.probes) - before - made
        if m is None:
            return None, f"it ran out of memory at batch {batch}"
        return dataclasses.replace(static, measured=m), ""

    def _run_in_groups(
        self,
        runs: list[tuple[Variant, int]],
        ask: _Asked,
        reserve: int,
        free: int = 0,
        riders: Sequence[tuple[dict[str, JsonValue], int]] = (),
        retry: bool = False,
    ) -> list[tuple[Variant, int]]:
        """``runs`` in their order, as many at once as the device makes
        (``PickStage.concurrent_runs``), while the budget allows: runs beyond ``reserve`` are
        left, the first ``free`` of them whenever any is, and none starts once
        :attr:`CompileSearch.max_seconds` have passed. Returns those not run. ``riders``
        (choices, batch: :meth:`_static_riders`) go with the first group as far as it has
        room, each counted as a static run, their answers left in the prober's record for the
        run that asks for them. ``retry`` (pass 1): on a device that retries in the run's own
        process (``retries_in_process``: a card's fork server), a run of a dynamic-batch
        form that runs out is measured again at half its batch there (``PickStage.run_many``'s
        ``retry_at``; :meth:`_half`): that process's graph serves the smaller batch, where
        pass 2's retry was a process and a compile of its own (cnn's regional plan on an
        H200: a 21.5 s round of 88 s, session 20). Such a retry is not one of the search's
        runs."""
        left = list(runs)
        made = 0
        at_once = max(1, self.stage.concurrent_runs)
        while left:
            allowed = self._allowed(reserve, free, made)
            if allowed <= 0:
                break
            group = left[: min(at_once, allowed)]
            left = left[len(group) :]
            made += len(group)
            extra = list(riders[: at_once - len(group)])
            riders = ()  # the first group only
            if len(group) == 1 and not extra:
                v, batch = group[0]
                self._run(v, batch, *ask.of(v), retry=retry)
                continue
            riding = ""
            wholes = list(self.whole_riders.values())
            statics = [b for c, b in extra if c not in self.graphs_riding and c not in wholes]
            graphs = [b for c, b in extra if c in self.graphs_riding]
            whole = [b for c, b in extra if c in wholes]
            if statics:
                forms = "form at batch" if len(statics) == 1 else "forms at batches"
                riding = f"; the static {forms} {', '.join(str(b) for b in statics)}"
            if graphs:
                riding += f"; CUDA graphs at batch {', '.join(str(b) for b in graphs)}"
            if whole:
                riding += f"; the whole model at batch {', '.join(str(b) for b in whole)}"
            self.stage.describe(
                f"compiling candidates {', '.join(str(ask.of(v)[0]) for v, _ in group)}"
                f"/{ask.total} at once ({'; '.join(v.label for v, _ in group)}{riding})"
            )
            before = len(self.stage.probes)
            halves = [self._half(v, batch) if retry else None for v, batch in group]
            ahead = [False] * len(group) + [rider in self.fallbacks for rider in extra]
            answers = self.stage.run_many(
                [(v.choices, batch) for v, batch in group] + extra,
                retry_at=halves + [None] * len(extra) if any(halves) else None,
                ahead=ahead if any(ahead) else None,
                **self._pass_one_steps(retry),
            )
            counted: list[dict[str, JsonValue]] = []
            for rider in extra:
                choices = rider[0]
                if rider in self.fallbacks:  # the search's, counted where it is asked for
                    continue
                if choices in counted:  # two graphs riders share their choices
                    continue
                counted.append(choices)
                if choices in self.graphs_riding:
                    self.graphs_runs += self._made_since(before, choices)
                else:
                    self.static_runs += self._made_since(before, choices)
            for (v, batch), answer, half in zip(group, answers[: len(group)], halves, strict=True):
                self._take_retried(v, batch, answer, half, before)
            rode = list(zip(extra, answers[len(group) :], strict=True))
            for v, batch in group:
                self._take_fallback(v, batch, rode)
            self._again_static(group)
        return left

    def _made_since(self, before: int, choices: dict[str, JsonValue]) -> int:
        """How many of the device runs after the first ``before`` ran ``choices`` (a static
        form sent along with other runs: counted as static runs, not the search's)."""
        return sum(
            1
            for p in self.stage.probes[before:]
            if p.candidate is not None and p.candidate.choices == choices
        )

    def _static_riders(
        self, ranked: Sequence[Variant], runs: Sequence[tuple[Variant, int]], reserve: int
    ) -> list[tuple[dict[str, JsonValue], int]]:
        """The static forms to go with pass 2's runs where they leave the device runs free in
        their first group, each at its candidate's predicted batch: pass 2's leader's
        (``ranked[0]``, the best by its pass-1 line), then those of the candidates whose line
        predicts :data:`SECOND_RUN_SHARE` of the leader's samples/s or more, best first, as
        room allows; none elsewhere. Where the search then confirms one of them at that batch
        without a device run (its pass-2 run answers it), :meth:`confirm_static` finds its
        run made; a rider whose candidate is not the pick, or whose pick moves, was spent,
        and the group waited for its compile (a cold static compile may be the group's
        slowest run).

        Why: the confirmation's own ``static_beside`` needs a device run of the
        confirmation, and on a card the pick's batch was mostly its pass-2 run's: resnet50's
        static form then ran alone for 56.9 s after a 30.4 s pass 2, hf_gpt2's for 35.7 s
        (session 19). And where two lines are that close, the static forms, which differ
        from the dynamic ones by up to a tenth either way, decide: hf_gpt2's leader (4 blocks
        checkpointed, 111,497 samples/s by its line) lost to no checkpointing (111,248) once
        confirmed, and that one's static form then ran alone for 30.1 s (H200, session 19).

        The room is what pass 2's first group leaves as it is made: its runs as many as the
        search's runs allow beyond those held back, not as many as are queued (hf_gpt2 on an
        H100, session 21: four queued, two allowed, four at once; counted from the four, no
        rider went, and the winner's static form then ran alone for 13.6 s).

        None where the device makes one run at a time, where pass 2 fills its group or makes
        no run; a candidate rides not where its form is static or not the one handed on
        (its confirmation runs the offered form), nor where every run of it compiles afresh
        (the winner's confirmation then runs the static form itself). Only the leader under
        the ``largest_batch`` objective (ranked by batch, a rate's share says nothing).

        A dynamic candidate not near by its line still rides where the leader is searched
        static, the group makes a cold compile anyway (a static run, or one that compiles
        every run), and its line at :data:`STATIC_GAIN_MAX` is near: its dynamic rate
        understates its static form's by up to that much (cnn, session 22-23), and its rider
        is then weighed against the pick (:meth:`rode_past`).

        Known limitations: each rider is a cold compile beside pass 2's runs on the host's
        cores, for a candidate that may not be picked; the gain is the largest of two models'
        (cnn 1.26x, hf_gpt2 1.17x), others' may be larger."""
        at_once = self.stage.concurrent_runs
        # The first group's runs as _run_in_groups makes them: at most at_once, and only
        # those the search's runs allow beyond the ones held back for the confirmations.
        group = min(len(runs), at_once, max(0, self._allowed(reserve)))
        room = at_once - group
        if at_once <= 1 or group <= 0 or room <= 0 or not ranked:
            if ranked and group > 0 and at_once > 1:
                self.not_riding[ranked[0].label] = (
                    f"no room: pass 2 makes {group} runs at once, {at_once} at most"
                )
            return []
        leader = ranked[0]
        assert leader.fit is not None
        by_rate = self.stage.config.objective != "largest_batch"
        bar = SECOND_RUN_SHARE * leader.fit.samples_per_s
        # A leader searched static, and a cold compile in the group anyway: a dynamic
        # candidate's line is set against it at the static form's gain (STATIC_GAIN_MAX).
        unlike = (
            by_rate
            and not is_dynamic(leader.form)
            and any(not is_dynamic(v.form) or compiles_every_run(v) for v, _ in runs[:group])
        )
        riders: list[tuple[dict[str, JsonValue], int]] = []
        for v in ranked:
            assert v.fit is not None
            near = v is leader or (by_rate and v.fit.samples_per_s >= bar)
            if not near and unlike and is_dynamic(v.form):
                near = STATIC_GAIN_MAX * v.fit.samples_per_s >= bar
            if not near:
                continue
            why = _why_not_riding(v)
            if why is None and len(riders) >= room:
                why = f"no room: {room} beside pass 2's {group} runs"
            if why is not None:
                self.not_riding[v.label] = why
                continue
            riders.append((v.static_choices, v.fit.largest_batch))
            self.riders.append(f"{v.label} at {v.fit.largest_batch}")
            self.rode.add(id(v))
        for v, batch in runs[:group]:
            fallback = self._fallback(v, batch) if len(riders) < room else None
            if fallback is not None:
                riders.append(fallback)
                self.fallbacks.append(fallback)
                self.riders.append(f"{v.label} at {fallback[1]}, should {batch} run out")
        # The leader's CUDA graphs' first round too, where its runs waited on the host and
        # its static form is in the group (a rider, or its own pass-2 run where it is
        # searched static): the graphs step finds them made where the leader is the pick at
        # that batch (the GPT example on an H200, session 31 call 2: pass 2's 22.9 s round,
        # then the graphs' 20.8 s round alone).
        if by_rate and (id(leader) in self.rode or not is_dynamic(leader.form)):
            graphs = self.graphs_ahead(leader)[: max(0, room - len(riders))]
            if graphs:
                riders.extend(graphs)
                self.graphs_riding.append(graphs[0][0])
                batches = ", ".join(str(b) for _, b in graphs)
                self.riders.append(f"CUDA graphs of {leader.label} at {batches}")
        if by_rate:
            # The first candidate by its line whose static form rides, else the leader.
            target = next((v for v in ranked if id(v) in self.rode), leader)
            whole = self._whole_rider(target, room - len(riders))
            if whole is not None:
                riders.append(whole)
        return riders

    def _whole_rider(self, v: Variant, room: int) -> tuple[dict[str, JsonValue], int] | None:
        """``v``'s whole model compiled (its offered form, static) at its predicted batch,
        to go with pass 2 (:meth:`_static_riders`, after the static riders, the fallbacks
        and the CUDA graphs' first round, in the room they leave). ``v`` is the first
        candidate by its line whose static form rides, else pass 2's leader: the riders are
        the candidates whose static form may decide the pick (:meth:`rode_past`), and in
        session 42 call D's four plans (cnn and the Llama example on an H200) the pick was
        that candidate each time, pass 2's leader once (cnn's leader, 6 of 6 blocks
        checkpointed by its line, lost to no checkpointing, which rode static). None where
        it is searched whole already, the model has more than
        :data:`WHOLE_RIDER_MAX_BLOCKS` blocks, :attr:`CompileSearch.whole_rider` is off or
        :attr:`CompileSearch.confirm_offered` on (the offered form gets a confirmation of its
        own), or no room is left.

        Why: whole or regional is chosen from the profile, for the compile's cost
        (:func:`regional_pays`), and the whole model compiled has run faster: cnn's hand
        cell (the whole model, 3 blocks checkpointed) 59,119 samples/s at 2820 against the
        regional pick's 53,673 at 2026 (0.908); with the offered form confirmed after the
        search (H200, session 42 call B), the whole model ran 57,605 at 3203 where the
        regional one ran 50,247, at a compile stage of 75.9 s against 36.5 s. As a rider
        it is one cold compile beside pass 2's group, whose checkpointed candidates compile
        cold too; :meth:`whole_past` takes it where it ran :data:`MIN_SPEEDUP` faster.

        Known limitations: it rides at the candidate's predicted batch, not at the whole
        form's own edge (the whole model held 2820 where the regional held 2631, cnn's
        cells); where the winner is another candidate, its run was spent (cnn, session 42
        call D, when it rode for pass 2's leader: a group of 29-34 s against 18.7 s); the
        whole model's trial, which the plan's compile check reuses, is made in the planner's
        process beside the group (10.3 s for cnn, 18.0 s for the Llama example after the
        search, session 42 call B), whose timed steps wait for it."""
        settings = self.settings
        if not settings.whole_rider or settings.confirm_offered:
            return None
        offered, fit = v.offered_choices, v.fit
        searched = parse_choice(v.form)
        if offered is None or fit is None or searched is None or not searched.regional:
            return None
        if offered == v.static_choices or fit.largest_batch < 1:
            return None
        blocks = len(self.stage.profile.blocks)
        if blocks > WHOLE_RIDER_MAX_BLOCKS:
            self.not_riding[f"the whole model of {v.label}"] = (
                f"{blocks} blocks, more than {WHOLE_RIDER_MAX_BLOCKS}: a whole compile of each "
                "costs more than the group's runs"
            )
            return None
        if room <= 0:
            self.not_riding[f"the whole model of {v.label}"] = "no room beside pass 2"
            return None
        self.whole_riders[id(v)] = offered
        self.riders.append(f"the whole model of {v.label} at {fit.largest_batch}")
        return (offered, fit.largest_batch)

    def whole_past(self, winner: Variant, found: Confirmed) -> Confirmed | None:
        """The winner's whole model compiled, where it rode with pass 2
        (:meth:`_whole_rider`), fitted within the pick's limit and measured more than
        ``found`` (the winner's static confirmation) by :data:`MIN_SPEEDUP`, confirmed from
        that run (no device run); None elsewhere. The margin is :meth:`rode_past`'s: one
        run of the verifying steps a side."""
        offered = self.whole_riders.get(id(winner))
        if offered is None:
            return None
        c = self._rider_confirmed(offered)
        if c is None:
            return None
        objective = self.stage.config.objective
        key = worth(objective, c.candidate.batch_size, c.measured.samples_per_s)
        return c if key > self._rider_bar(found) else None

    def _fallback(self, v: Variant, batch: int) -> tuple[dict[str, JsonValue], int] | None:
        """The run to make ahead beside ``v``'s pass-2 run at ``batch`` (its static form at
        its line's batch): the same form at the plan's margin below that batch
        (``PickStage.below_failure``), made ahead (``PickStage.run_many``'s ``ahead``) and
        taken as ``v``'s pass-2 run where its own runs out (:meth:`_take_fallback`); None
        where ``v`` is searched with a dynamic batch, ``batch`` is not its line's (a retry at
        half), or the margin below is a batch it ran already or none.

        Why: pass 2 runs at the edge a line predicts, and there the step runs out about as
        often as not (t5_base on an H200: 24 blocks at 58 in session 35, at 53 in each of
        session 36's four plans, by the allocator's retries). The pass-2 leader's
        confirmation then started at the margin below, a round and a compile of its own
        (51 and 43 at once, 41.6 s of a 248.2 s plan, session 36 call 1); and a candidate
        that was not the leader kept the line of its one pass-1 run, which holds its rate at
        every batch: 24 blocks read 143 samples/s at 38 and lost to 150.5 at 30 (call 4),
        where the same configuration ran 195-202 at 51 in calls 2. Taken as the run, it
        gives the line a second point and the confirmation its batch.

        It is made ahead, not recorded, because near the limit fitting is not monotone:
        where ``v``'s run fits, a fallback that ran out would bound its pick below it.

        Known limitations: where ``v``'s run fits, the fallback was a cold compile beside
        pass 2's runs for nothing (never logged nor counted); fallbacks take the room after
        the static riders and before the leader's CUDA graphs' first round."""
        if v.fit is None or is_dynamic(v.form) or batch != v.fit.largest_batch:
            return None  # a retry at half of a candidate with no line, or dynamic
        below = self.stage.below_failure(v.choices, batch)
        if below < 1 or below >= batch or below <= max(v.runs, default=0):
            return None
        return (v.choices, below)

    def _take_fallback(
        self,
        v: Variant,
        batch: int,
        rode: Sequence[tuple[tuple[dict[str, JsonValue], int], Measurement | None | Exception]],
    ) -> None:
        """Where ``v``'s run at ``batch`` ran out and its fallback (:meth:`_fallback`) was
        made ahead beside it (``rode``: the riders and their answers), the fallback's answer
        taken as ``v``'s run, logged and counted as one of the search's runs (no device
        run: ``PickStage.run`` finds it made)."""
        if batch in v.runs or v.lowest_failure != batch:
            return
        for (choices, below), answer in rode:
            if (choices, below) not in self.fallbacks or choices != v.choices:
                continue
            if isinstance(answer, Exception):
                return  # it failed otherwise: not made, and not a run to make now
            self._take(v, below, self._answer(v, below))
            return

    def rode_past(
        self, variants: Sequence[Variant], winner: Variant, found: Confirmed
    ) -> tuple[Variant, Confirmed] | None:
        """The candidate other than ``winner`` whose static form rode with pass 2
        (:meth:`_static_riders`: near the leader by its line, or at the static form's gain
        against a static leader), fitted within the pick's limit and measured more than
        ``found``, the winner's static confirmation (the objective's way), with that run as
        its confirmation; None where none did. No device run: the rider's run answers.

        Why: the candidates are ranked on their searched graphs (dynamic, or static where
        checkpointed) and only the winner's static form is confirmed, where a static graph
        has run up to 1.26x its dynamic one and as much slower: cnn's candidate without
        checkpointing at 2098 (H100, session 22), whose line cannot show it against a static
        leader; hf_gpt2's bf16 without checkpointing at 1020, 65,274 samples/s dynamic and
        76,927 static, beside a tf32 winner whose line led by 1% and whose static form ran
        65,559 (H100, session 24). Where a rider then measured more than the winner's static
        confirmation, both runs are the form the user runs, at batches within the limit.

        A rider is taken only ahead by :data:`MIN_SPEEDUP` under a rate objective: each side
        is one run of the verifying steps, and a percent ahead is within their noise; there
        the winner stands, the pick a device of one run at a time makes (cnn's rider on a
        card was ahead by 1.06-1.09x).

        Known limitations: a device that makes one run at a time sends no riders, so there
        the winner's static form stands where a card with room beside pass 2 may pick a
        rider's that is faster by more than the noise."""
        objective = self.stage.config.objective
        bar = self._rider_bar(found)
        best: tuple[Variant, Confirmed] | None = None
        for v in variants:
            if v is winner or v.error is not None or id(v) not in self.rode:
                continue
            c = self._rider_confirmed(v.static_choices)
            if c is None:
                continue
            key = worth(objective, c.candidate.batch_size, c.measured.samples_per_s)
            if key > bar:
                best, bar = (v, c), key
        return best

    def _rider_bar(self, found: Confirmed) -> tuple:
        """What a rider must be worth to displace ``found`` (the winner's static
        confirmation): ahead by the runs' noise at least (:data:`MIN_SPEEDUP`) under a rate
        objective, since a rider a hair ahead of the winner's static run is two 20-step runs
        alike, and the winner stands, as on a device of one run at a time."""
        objective = self.stage.config.objective
        margin = MIN_SPEEDUP if objective != "largest_batch" else 1.0
        return worth(objective, found.candidate.batch_size, margin * found.measured.samples_per_s)

    def _rider_confirmed(self, choices: dict[str, JsonValue]) -> Confirmed | None:
        """``choices``' rider (a static form or the whole model that rode with pass 2) as a
        confirmation at the largest batch it fitted, answered from its record without a
        device run (counted static where one is made); None where it fitted nowhere or
        holds more than the pick's limit."""
        rode = [
            p.batch_size
            for p in self.stage.probes[self.runs_before :]
            if p.fits and p.candidate is not None and p.candidate.choices == choices
        ]
        if not rode:
            return None
        before = len(self.stage.probes)
        try:  # no run left to make: answered from the rider's record
            c = self.stage.confirm(choices, max(rode), max_runs=0, within=MIN_SPEEDUP - 1.0)
        finally:
            self.static_runs += len(self.stage.probes) - before
        if c is None or self.stage.held_bytes(c.measured) > self.stage.limit_bytes:
            return None
        return c

    def _again_static(self, group: list[tuple[Variant, int]]) -> None:
        """The runs of ``group`` that :meth:`_static_instead` sent static, made again in that
        form, together (as many at once as the device makes), and taken."""
        again = [(v, batch) for v, batch in group if v.static_pending]
        for i in range(0, len(again), max(1, self.stage.concurrent_runs)):
            part = again[i : i + max(1, self.stage.concurrent_runs)]
            self.stage.describe(
                f"compile: {'; '.join(v.label for v, _ in part)} failed to compile with a "
                "dynamic batch; static at their batches"
            )
            if len(part) == 1:
                answers = [self._answer(*part[0])]
            else:
                answers = self.stage.run_many([(v.choices, batch) for v, batch in part])
            for (v, batch), answer in zip(part, answers, strict=True):
                self._take(v, batch, answer)  # a static form failing too: its error

    def _answer(self, v: Variant, batch: int) -> Measurement | None | Exception:
        """One run of ``v`` at ``batch`` alone: its measurement, None (ran out), or what it
        raised (for :meth:`_take`)."""
        try:
            return self.stage.run(v.choices, batch)
        except Exception as e:  # noqa: BLE001 - a compiled run failing drops this candidate
            return e

    def _run(
        self, v: Variant, batch: int, index: int, total: int, retry: bool = False
    ) -> bool | None:
        """One run of ``v`` at ``batch``, its line refitted: True fitted, False ran out, None
        failed otherwise (``v.error``). ``retry``: :meth:`_run_in_groups`' (pass 1)."""
        self.stage.describe(f"compiling candidate {index}/{total} ({v.label})")
        half = self._half(v, batch) if retry else None
        shorter = self._pass_one_steps(retry)
        if half is None and not shorter:
            taken = self._take(v, batch, self._answer(v, batch))
        else:
            before = len(self.stage.probes)
            try:
                answer = self.stage.run_many(
                    [(v.choices, batch)], retry_at=[half] if half else None, **shorter
                )[0]
            except Exception as e:  # noqa: BLE001 - as _answer: the run's error is its answer
                answer = e
            taken = self._take_retried(v, batch, answer, half, before)
        if v.static_pending:
            self._again_static([(v, batch)])
            return True if v.runs else (False if v.lowest_failure is not None else None)
        return taken

    def _pass_one_steps(self, pass_one: bool) -> dict[str, int]:
        """``PickStage.run_many``'s ``steps`` for a pass-1 run where
        :attr:`CompileSearch.pass_one_steps` sets them ({} elsewhere: the stage's own steps,
        and no keyword a stage of the contract before it would not take)."""
        steps = self.settings.pass_one_steps
        return {"steps": steps} if pass_one and steps is not None else {}

    def _half(self, v: Variant, batch: int) -> int | None:
        """The batch a pass-1 run of ``v`` at ``batch`` is retried at in its own process
        where it runs out: half, for a dynamic-batch form on a device that retries in the
        run's process (``retries_in_process``); None elsewhere (pass 2 retries it)."""
        if not self.stage.device.retries_in_process or not is_dynamic(v.form) or batch < 2:
            return None
        return batch // 2

    def _take_retried(
        self,
        v: Variant,
        batch: int,
        answer: Measurement | None | Exception,
        half: int | None,
        since: int,
    ) -> bool | None:
        """:meth:`_take` for a run asked to retry at ``half``: where it ran out and measured
        ``half`` (``ran_out_first`` naming ``batch``), both are taken; a retry made in the
        run's own process is not counted as one of the search's runs (no process, no compile
        of its own), one made as a run of its own (a fork server that fell back) is. Where
        the retry ran out too (a record of ``half`` run out among the stage's records from
        ``since`` on), both are taken as run out (the retry's counted as the success's is),
        and pass 2 retries below ``half``, not at it: that batch had its answer, and a retry
        in pass 2 is a process and a compile."""
        first = answer.ran_out_first if isinstance(answer, Measurement) else None
        if first is not None and half and first.batch_size == batch:
            self._take(v, batch, None)
            self.free_retries += 1 if first.same_process else 0
            return self._take(v, half, answer)
        again = self._ran_out_at(v, half, since) if answer is None and half else None
        if again is not None:
            self._take(v, batch, None)
            # Its record is no run of the search's where it ran in the first's process.
            self.free_retries += 1 if (again.error or "").startswith(RETRY_RAN_OUT_HERE) else 0
            return self._take(v, half, None)
        return self._take(v, batch, answer)

    def _ran_out_at(self, v: Variant, batch: int, since: int) -> Probe | None:
        """The stage's record from ``since`` on of ``v`` run out at ``batch``; None."""
        return next(
            (
                p
                for p in self.stage.probes[since:]
                if not p.fits
                and p.batch_size == batch
                and p.candidate is not None
                and p.candidate.choices == v.choices
            ),
            None,
        )

    def _take(self, v: Variant, batch: int, answer: Measurement | None | Exception) -> bool | None:
        """What a run of ``v`` at ``batch`` answered, kept and its line refitted: True
        fitted, False ran out, None failed otherwise (``v.error``; our own bug raises)."""
        if isinstance(answer, Exception):
            if is_our_bug(answer):
                raise answer
            if not self._static_instead(v, answer):
                v.error = first_line(answer)
            return None
        m = answer
        if m is None:
            v.lowest_failure = batch if v.lowest_failure is None else min(v.lowest_failure, batch)
        else:
            v.runs[batch] = m
        failure = v.lowest_failure
        cfg = self.stage.config
        v.fit = fit_step(
            {b: (self.stage.held_bytes(r), r.step_ms) for b, r in v.runs.items()},
            v.eager,
            limit_bytes=self.stage.limit_bytes,
            max_batch=cfg.max_batch,
            lowest_failure=failure,
            below_failure=self.stage.below_failure(v.choices, failure) if failure else None,
            # Only beside allocated peaks (the measured margin's): a reserved one has it.
            cap_bytes=cfg.budget_bytes if cfg.measured_margin else None,
            reserved={
                b: r.reserved_peak_bytes
                for b, r in v.runs.items()
                if r.reserved_peak_bytes is not None
            }
            if cfg.measured_margin
            else None,
        )
        return m is not None

    def _static_instead(self, v: Variant, error: Exception) -> bool:
        """Whether ``v``'s run failed in the compiler with a dynamic batch and is to be made
        again in the static form (``v`` switched to it, its dynamic runs forgotten; the
        caller makes the run, :meth:`_again_static`), where it is worth a compile
        (:meth:`_worth_a_static_compile`); where not, ``v.error`` says why.

        Why: on an H100 with torch 2.11 the dynamic-batch compile of checkpointed blocks
        failed in the partitioner ("AssertionError: Node add_296 was invalid, but is
        output") for hf_gpt2 and swin_t, while the same choices compiled static at once
        (session 17, docs/design.md); the trial of the first candidate (no checkpointing)
        had passed, so only these candidates dropped out of the search and no checkpointed
        compiled configuration of either model was measured. The static form compiles once
        per batch, dearer, but it is the form the plan hands on anyway.

        The same card showed what it costs: hf_gpt2's two checkpointed candidates made
        static took 31 and 25 s one after the other, swin_t's two more than 120 s, and both
        plans outran their bench's limits (150 and 260 s) while neither model gains from
        checkpointing (eager: swin_t's all blocks 1,384 samples/s against none 1,802). Hence
        the gate on the eager estimate, and the runs made together.

        Known limitations: only the first failure switches a candidate (a static form that
        fails too is the candidate's error); one run more each, within the search's runs
        left. Where the eager pick checkpoints nothing, the gate reads the eager estimate,
        which does not see compile's own savings. Not yet run on a card in this form (the
        card ran the one-at-a-time, ungated form: session 17).
        """
        if not is_dynamic(v.form) or not compiler_failed(error) or self.runs_left <= 0:
            return False
        if not self._worth_a_static_compile(v):
            v.error = (
                f"{first_line(error)}; not searched static: its eager estimate promises less "
                f"than {STATIC_RETRY_SHARE:.2f} of the eager pick's samples/s"
            )
            return True  # answered: the error says why
        v.static_because = first_line(error)
        v.trialled_as = v.form
        v.choices = v.static_choices
        v.forget()
        return True

    def _second_worth_a_compile(self, v: Variant, best: Variant) -> bool:
        """Whether ``v`` (not the best by its line) gets its pass-2 run: yes where its graph
        came from the cache (a run of seconds), or where its line predicts
        :data:`SECOND_RUN_SHARE` of the best's samples/s or more; no where every run of it
        compiled afresh (:func:`compiles_every_run`) for a line further behind. Runs made at
        once wait for the slowest: hf_gpt2's pass 2 on an H100 (session 18) took 61 s for
        two checkpointed candidates' cold compiles beside the best's 20 s cached one."""
        if not compiles_every_run(v):
            return True
        if self.stage.config.objective == "largest_batch":
            return True  # ranked by batch: a rate's share says nothing there
        assert v.fit is not None and best.fit is not None
        return v.fit.samples_per_s >= SECOND_RUN_SHARE * best.fit.samples_per_s

    def _worth_a_static_compile(self, v: Variant) -> bool:
        """The eager pick's own choices are; so is every candidate where the eager pick
        checkpoints (memory binds eager, and compile's saving can move the best checkpointed
        set: the issue's decoder); where it checkpoints nothing, checkpointing did not pay
        eager, and compile, which lowers the activations' bytes, only weakens the case for
        it: a candidate then needs its eager estimate's promise."""
        pick = {n: c for n, c in self.eager.candidate.choices.items() if n != COMPILE}
        if {n: c for n, c in v.choices.items() if n != COMPILE} == pick:
            return True
        if _recomputing(pick, self.stage.strategies):
            return True
        limit, cap = self.stage.limit_bytes, self.stage.config.max_batch
        mine = samples_per_s(v.eager.ms, predicted(v.eager.bytes, limit, cap, None))
        theirs = self.eager.measured.samples_per_s
        return mine >= STATIC_RETRY_SHARE * theirs

    def _spent(self, reserve: int) -> str:
        if self.runs_left > reserve:
            return f"not run: the search's {self.settings.max_seconds:g} s were spent"
        return (
            f"not run: the search's {self.settings.max_runs} device runs were spent "
            f"({reserve} held back for confirming the winner)"
        )


def confirm_ceiling(v: Variant) -> int | None:
    """The batch above which ``v``'s confirmation makes no run (find_batch's ``ceiling``):
    where its line was capped by the largest allocation or by its reserved bytes
    (``StepFit.reserved_batch``: the confirmation's extrapolation reads allocated peaks),
    the cap's batch or the largest batch of ``v`` that ran, whichever is larger; None (no
    ceiling) where it was not capped.

    Why: the confirmation extrapolates from the measured peak, which does not know the block
    the allocator must find free, so above a capped line it runs where the cap said the step
    runs out (the GPT example on a card confirmed from its cap at 252 and ran 317, 306 and
    279, all out of memory, 18 s of compiled runs). A batch of ``v`` that ran found that block
    free, so batches up to it are worth a run (its pass-2 runs had fitted at 252 and 256)."""
    if v.fit is None:
        return None
    bounds = [b for b in (v.fit.cap_batch, v.fit.reserved_batch) if b is not None]
    if not bounds:
        return None
    return max(min(bounds), max(v.runs, default=0))


def compiles_every_run(v: Variant) -> bool:
    """Whether every run of ``v`` compiled its graphs afresh: inductor's caches would not
    take them (on torch 2.11 CUDA, a graph with checkpointed blocks: docs/design.md, "A
    dynamic batch while searching"). Its dynamic batch then saves no compile, and its static
    form costs a confirmation run no more than its searched form does."""
    counts = [m.compile_cache_bypasses for m in v.runs.values()]
    return bool(counts) and all(c is not None and c > 0 for c in counts)


def handed_on(found: Confirmed) -> Confirmed:
    """``found`` with its compile choice static: the form the plan verifies and the user
    runs (the search measures a dynamic batch, one graph for every batch it tries); itself
    where its form is static already."""
    form = found.candidate.choices[COMPILE]
    if not is_dynamic(form):
        return found
    choices = {**found.candidate.choices, COMPILE: _static(form)}
    return dataclasses.replace(
        found, candidate=found.candidate.model_copy(update={"choices": choices})
    )


def _why_not_riding(v: Variant) -> str | None:
    """Why ``v``'s static form may not ride with pass 2 (:meth:`Search._static_riders`);
    None where it may."""
    assert v.fit is not None
    if v.fit.largest_batch < 1:
        return "its line predicts no batch"
    if v.final_differs:
        return "the form handed on differs from the searched one (a run of its own)"
    if not is_dynamic(v.form):
        return "searched static: its pass-2 run is its static form"
    if compiles_every_run(v):
        return "every run compiles afresh: its confirmation runs the static form"
    return None


def is_dynamic(form: JsonValue) -> bool:
    """Whether a compile choice measures a dynamic batch (the search form)."""
    parsed = parse_choice(form)
    return parsed is not None and parsed.dynamic_batch


def _static(form: JsonValue) -> JsonValue:
    parsed = parse_choice(form)
    assert parsed is not None  # a searched form parses
    return parsed.static().to_json()


def compiler_failed(error: BaseException) -> bool:
    """Whether ``error`` is the compiler's failure (dynamo's ``BackendCompilerFailed``), in
    this process or reported by a probe process."""
    if isinstance(error, ProbeProcessError):
        return error.raised == "BackendCompilerFailed"
    return _torch_private.is_compiler_failure(error)


def first_line(error: BaseException) -> str:
    """``error`` in one line for a plan's record: its type and its message's first line.

    Where that line only introduces the cause (it ends in ``:``, as dynamo's
    ``BackendCompilerFailed`` does: "backend=... raised:" then the backend's own error on the
    next line, here reached through a probe process's message), the next non-empty line is
    kept with it: without it the record says a compile failed but not why.
    """
    text = str(error).strip()
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if not lines:
        return type(error).__name__
    first = lines[0][:300]
    if first.endswith(":") and len(lines) > 1:
        first = f"{first} {lines[1][:300]}"
    return f"{type(error).__name__}: {first}"
