"""torch.compile: the model's forward (and so its backward) compiled by inductor.

Inductor fuses the model's operations into fewer, larger kernels: on a card that can buy a
large speed-up at the same peak, for a first step that compiles for tens of seconds
(``docs/design.md``, "torch.compile", has the measurement).

Choices:
    * ``"off"``.
    * ``"default"``: ``torch.compile`` in its default mode.
    * ``{"mode": "default", "activation_memory_budget": 0.5}``: the same, with the min-cut
      partitioner told to keep at most half the activations for backward and recompute the
      rest. For a compiled model this is the recompute knob: it recomputes cheap pointwise
      ops inside the fused graph, where block checkpointing recomputes whole blocks.

How the planner uses them (:meth:`Compile.refine`, ``strategies/_compile_stage.py``): after
the device has chosen the eager pick, it searches compiled configurations: the pick's
choices and the same with other checkpointed sets compiled with ``"default"``, and a choice
with a budget in place of the pick's checkpointing (its budget set to the share of
activations the pick keeps). A compiled step holds less than eager, so its best
checkpointed set and batch are not eager's; each candidate's compiled memory is learned from
a run or two (``strategies/_compile_model.py``), the best is confirmed by the device's batch
search, all within :class:`~strategies._compile_search.CompileSearch`'s budget of runs
(``strategies/_compile_search.py``). The compiled pick is kept only when it beats eager's
measured throughput; :meth:`Compile.trial` and :attr:`Compile.gains` keep what was measured
for :meth:`Compile.check` and :meth:`Compile.explain`.

Offered only for a profile of a device that compiles (``can_compile``: a CUDA card).
Compiled memory and speed are not predicted by the eager profile (fusion removes
intermediates, the partitioner chooses what to save): Compile is a
:class:`~memadvisor.strategy.Measured` strategy and :meth:`Compile.effect` leaves the
estimate as eager, so compiled candidates must be measured on the device. The simulated CPU
device cannot measure them: with its ``TorchDispatchMode`` active dynamo attempts no frame
at all and the step runs eagerly (measured here on torch 2.13: no frame counted, the same
peak bytes and allocation count as eager), and a fake-tensor profile has no device to run on.

Other modes, accepted as choices but not offered by default:
    * ``"max-autotune-no-cudagraphs"``: benchmarks matmul and kernel configurations while
      compiling. Minutes of compile per process and shape (each probe is one), for a few
      percent on matmul-bound models: worth it for a long run, not for every probe. Offer it
      through ``Compile(choices=[...])`` when the plan is for weeks of training.
    * ``"reduce-overhead"`` and ``"max-autotune"``: CUDA graphs. They remove launch
      overhead (small batches, many small kernels) but keep static input and output buffers
      and a private memory pool alive between steps, which a memory planner must count and
      which every input shape pays again; the probes measure this when asked, but a card
      that is already full rarely has the room. The compile stage tries ``reduce-overhead``
      on its own pick where that pick's card waited on the host, at a batch of its own
      (``strategies/_compile_graphs.py``).

Applying installs :class:`~strategies._compiled_forward.CompiledForward` on the model's root
module: parameter names and ``state_dict`` keys are unchanged (``torch.compile(model)``
would add ``_orig_mod.``), and the wrappers other strategies installed (autocast,
checkpointed blocks) are compiled with the model.

Known limitations:
    * The loss (the workload's ``loss_fn``) stays outside the compiled region.
    * Each process compiles again (seconds to minutes); inductor's on-disk cache
      (:mod:`memadvisor.compile_cache`) only helps where the same graph is compiled at the
      same shapes.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch
from pydantic import JsonValue

from memadvisor.process_state import environ_set
from memadvisor.schema.advice import Advice, Check, LoopLines, ReportPart
from memadvisor.schema.call import CallForm
from memadvisor.schema.facts import Facts
from memadvisor.step import Step
from memadvisor.strategy import (
    RUNS_COMPILE_VARIABLE,
    Checked,
    Configured,
    Confirmed,
    Described,
    EffectOrder,
    Measured,
    PickStage,
    Refinement,
    Strategy,
)
from strategies import _forward
from strategies._compile_cache import SharedCompileCache, shared_compile_cache
from strategies._compile_graphs import GRAPHS_MODE
from strategies._compile_search import CompileSearch
from strategies._compile_stage import DeviceGain, compiled_pick, parse_setting, policy_of
from strategies._compile_trial import (
    MAX_GRAPH_BREAKS,
    STRATEGY_NAME,
    CompileResult,
    try_compile,
)
from strategies._compiled_forward import (
    MODES,
    CompileChoice,
    CompiledForward,
    compile_targets,
    parse_choice,
)
from strategies._format import loss_line

if TYPE_CHECKING:
    from memadvisor.estimate import StepModel
    from memadvisor.schema.candidate import Candidate
    from memadvisor.schema.config import PlanConfig
    from memadvisor.schema.device import DeviceCapabilities
    from memadvisor.schema.plan import Plan
    from memadvisor.schema.profile import Profile
    from memadvisor.workload import Workload

__all__ = [
    "DEFAULT_CHOICES",
    "MAX_GRAPH_BREAKS",
    "MODES",
    "Compile",
    "CompileChoice",
    "CompileResult",
    "CompileSearch",
    "CompiledForward",
    "DeviceGain",
    "advice",
    "check_from",
    "parse_choice",
    "try_compile",
]

#: The compiled choices offered by default. Each one the planner measures costs a compile in
#: every probe process, so two: the default mode, and the default mode recomputing half.
DEFAULT_CHOICES: tuple[JsonValue, ...] = (
    "default",
    {"mode": "default", "activation_memory_budget": 0.5},
)
# What check() calls fine: compiled fp32 should match eager to rounding; dropout under
# inductor draws other masks, which moves the loss by up to a few percent on small batches.
LOSS_TOLERANCE = 0.02
# The loop's line under a CUDA-graphs pick: the next step overwrites this step's outputs.
_GRAPHS_NOTE = "# CUDA graphs: the next step overwrites this one's outputs; keep loss.item()"


class Compile(Strategy, Measured, Described, Checked, Configured):
    """Compile the model's forward with torch.compile (inductor).

    Args:
        choices: the compiled choices to offer (``"off"`` is always first); default
            :data:`DEFAULT_CHOICES`.
        search: how far the planner's compile stage searches (candidates, device runs,
            seconds, the regional form while searching); default :class:`CompileSearch`'s.

    Raises:
        BadInputError: a choice is not a compile choice.
    """

    name = STRATEGY_NAME
    # After every strategy that wraps the forward (precision 0, checkpointing 50, offload
    # 60): compiling wraps what they installed, so they are compiled with the model.
    effect_order = EffectOrder.COMPILE
    installs = "compile"

    def __init__(
        self, choices: Sequence[JsonValue] | None = None, search: CompileSearch | None = None
    ) -> None:
        self.search = search if search is not None else CompileSearch()
        offered = DEFAULT_CHOICES if choices is None else tuple(choices)
        parsed = [parse_choice(c) for c in offered]
        # Normalised, so the same setting is always the same JSON in a plan.
        self.offered: list[JsonValue] = [p.to_json() for p in parsed if p is not None]
        self.results: dict[CompileChoice, CompileResult] = {}
        self.gains: dict[CompileChoice, DeviceGain] = {}
        self._plan_cache: SharedCompileCache | None = None  # while a plan's scope is open

    def choices(self, profile: Profile, config: PlanConfig) -> list[JsonValue]:
        if not profile.device.capabilities.can_compile:
            return ["off"]  # nothing here can measure a compiled step (module docstring)
        return ["off", *self.offered]

    def effect(self, profile: Profile, choice: JsonValue, model: StepModel) -> None:
        """Nothing: the estimate stays eager's (a Measured strategy), for a valid choice.

        Eager is a fair bracket to start probing from: compiling kept the peak of the model
        measured, and a partitioner budget below 1 is meant to lower it (``docs/design.md``,
        "torch.compile").
        """
        parse_choice(choice)

    def apply(self, step: Step, choice: JsonValue) -> Step:
        """Compile ``model``'s forward in place ('off' takes a previous compile off).

        Lazy: nothing compiles until the first forward. Applying twice updates the settings.

        Raises:
            BadInputError: ``choice`` is not a compile choice.
        """
        model = step.model
        parsed = parse_choice(choice)
        # Another form of compile may be installed (whole model vs each block): off first.
        for module in model.modules():
            _forward.remove(module, CompiledForward)
        if parsed is None:
            return step
        for module in compile_targets(model, parsed):
            _forward.install(
                module,
                CompiledForward,
                mode=parsed.mode,
                activation_memory_budget=parsed.activation_memory_budget,
                dynamic_batch=parsed.dynamic_batch,
            )
        return step

    def describe(self, choice: JsonValue, plan: Plan) -> ReportPart | None:
        """The choice under "Also" (the plan's measured stage has its own row), and a loader
        that drops the last, smaller batch: a second shape would compile a second graph; a
        CUDA-graphs pick's loop also says to keep ``loss.item()``, not the tensor."""
        part = super().describe(choice, plan)
        if part is not None:
            parsed = parse_choice(choice)
            graphs = parsed is not None and parsed.mode == GRAPHS_MODE
            part.loop = LoopLines(
                loader_args=", drop_last=True",
                loader_comment="one shape: no second compile",
                forward_notes=[_GRAPHS_NOTE] if graphs else [],
            )
        return part

    states = frozenset({"compiled", "compile_mode", "compiled_whole", "compiled_regional"})

    def facts(self, choice: JsonValue) -> Facts:
        parsed = parse_choice(choice)
        if parsed is None:
            return Facts()
        whole = not parsed.regional and parsed.activation_memory_budget is None
        return Facts(
            compiled=True,
            compile_mode=parsed.mode,
            compiled_whole=whole,
            compiled_regional=parsed.regional,
        )

    def explain(self, choice: JsonValue, profile: Profile) -> Advice | None:
        """The advice; its effect quotes the trial :meth:`check` ran, when there was one."""
        parsed = parse_choice(choice)
        if parsed is None:
            return None
        return advice(
            parsed,
            self._result_for(parsed),
            self.gains.get(parsed),
            form=profile.call_form if profile is not None else None,
            blocks=_repeated_container(profile) if profile is not None else None,
        )

    def _result_for(self, parsed: CompileChoice) -> CompileResult | None:
        """The trial kept for ``parsed``, or for its dynamic-batch form (the plan's trial
        compiles the searched form, the same model and graph breaks as the static pick's),
        or for either without a partitioner budget (which changes what backward recomputes,
        not what is computed; the compile stage trials a budget form only where no such
        trial ran), or, for CUDA graphs, any of these in default mode (the same graph,
        replayed: the compile stage tries graphs on its pick, strategies/_compile_graphs.py)."""
        forms = [parsed, parsed.model_copy(update={"dynamic_batch": True})]
        if parsed.activation_memory_budget is not None:  # its trial may stand for it
            forms += [f.model_copy(update={"activation_memory_budget": None}) for f in forms]
        if parsed.mode == GRAPHS_MODE:  # the same graph, replayed: the default mode's trial
            forms += [f.model_copy(update={"mode": "default"}) for f in forms]
        return next((self.results[f] for f in forms if f in self.results), None)

    def plan_scope(
        self, config: PlanConfig, device: DeviceCapabilities
    ) -> contextlib.AbstractContextManager | None:
        """On a device that compiles, one inductor cache for the whole plan, set before the
        fork server starts: its children compile into it, and the compiled probes need no
        fresh server for it. And ``MEMADVISOR_RUNS_COMPILE=1``
        (:data:`~memadvisor.strategy.RUNS_COMPILE_VARIABLE`; a user's ``0`` is kept): the
        fork server imports inductor's compiler once for its children."""
        if not device.can_compile or policy_of(config) == "off":
            return None
        return self._whole_plan_cache()

    @contextlib.contextmanager
    def _whole_plan_cache(self) -> Iterator[SharedCompileCache]:
        # The fork server started inside imports inductor's compiler once, after it is
        # ready, for the compiled runs' children (memadvisor.device._zygote._warm_compiler);
        # a value the user set ("0": not) is kept.
        runs_compile = os.environ.get(RUNS_COMPILE_VARIABLE) or "1"
        with shared_compile_cache() as cache, environ_set({RUNS_COMPILE_VARIABLE: runs_compile}):
            self._plan_cache = cache
            try:
                yield cache
            finally:
                self._plan_cache = None

    def check_setting(self, value: JsonValue) -> None:
        """A plan's ``compile=`` setting: ``"auto"``, ``"off"``, ``"on"``, or
        ``{"policy": ..., "search": {CompileSearch's fields}}``
        (:func:`~strategies._compile_stage.parse_setting`), checked before the plan runs.

        Raises:
            BadInputError: anything else, with the value and what to pass.
        """
        parse_setting(value)

    def refine(self, stage: PickStage, eager: Confirmed) -> Refinement | None:
        """Compiled configurations searched on the device from the eager pick, kept when
        faster (:func:`strategies._compile_stage.compiled_pick`). The plan's
        ``options["compile"]`` says whether: ``"auto"`` (default: on CUDA), ``"off"`` or
        ``"on"``."""
        return compiled_pick(stage, eager, self, cache=self._plan_cache)

    def check(self, workload: Workload, choice: JsonValue) -> Check | None:
        """Compile ``choice`` on copies of the workload and compare with eager (see try_compile).

        Runs on CUDA when there is one (compiled choices are offered for CUDA profiles only;
        the user's model may sit on the CPU), else on the model's device. A trial this
        instance already ran for ``choice`` (the planner's, see :meth:`trial`) is reused
        rather than compiled again. The result is kept: :meth:`explain` quotes it.
        """
        parsed = parse_choice(choice)
        if parsed is None:
            return None
        result = self._result_for(parsed)
        if result is None:
            device = "cuda" if torch.cuda.is_available() else None
            result = self.trial(workload, choice, device=device)
        return check_from(result)

    def trial(
        self,
        workload: Workload,
        choice: JsonValue,
        *,
        candidate: Candidate | None = None,
        device: torch.device | str | None = None,
    ) -> CompileResult:
        """:func:`try_compile` ``choice`` and keep the result for :meth:`check` and :meth:`explain`.

        Raises:
            BadInputError: as :func:`try_compile` does (an off or malformed choice, a
                workload whose eager step fails).
        """
        result = try_compile(workload, choice, candidate=candidate, device=device)
        parsed = parse_choice(result.choice)
        if parsed is not None:
            self.results[parsed] = result
        return result


def check_from(result: CompileResult) -> Check:
    """``result`` as the Check a plan lists: passed when it compiled and matched eager."""
    close = result.loss_rel_diff is not None and result.loss_rel_diff <= LOSS_TOLERANCE
    summary = result.summary
    if result.ok and not close:
        summary += (
            f" The first loss differs from eager's by more than {LOSS_TOLERANCE:.0%} "
            "(dropout draws differ under inductor; without dropout this is worth a look)."
        )
    numbers = {
        "batch_size": result.batch_size,
        "eager_step_ms": result.eager_step_ms,
        "graphs": result.graphs,
        "graph_breaks": result.graph_breaks,
        "first_step_ms": result.first_step_ms,
        "compiled_step_ms": result.compiled_step_ms,
        "compile_ms": result.compile_ms,
        "loss_rel_diff": result.loss_rel_diff,
        "grad_rel_diff": result.grad_rel_diff,
    }
    return Check(
        strategy=STRATEGY_NAME,
        choice=result.choice,
        summary=summary,
        passed=result.ok and close,
        metrics={k: float(v) for k, v in numbers.items() if v is not None},
    )


def advice(
    choice: CompileChoice,
    result: CompileResult | None = None,
    gain: DeviceGain | None = None,
    *,
    form: CallForm | None = None,
    blocks: str | None = None,
) -> Advice:
    """The advice for ``choice``, quoting ``result`` (a trial at some batch) and ``gain`` (the
    planner's measurement against eager) when given."""
    budget = choice.activation_memory_budget
    title = "torch.compile" + (f" ({choice.mode} mode)" if choice.mode != "default" else "")
    if choice.regional:
        title += ", each repeated block"
    sentence = (
        "Compile the model with torch.compile: inductor fuses its operations into fewer, "
        "larger kernels, which speeds up the step; the first step compiles (once per process "
        "and input shape). Train through the compiled module and save the original's "
        "state_dict, whose keys stay as they are."
    )
    if choice.regional:
        sentence += (
            " Compile each instance of the repeated block (the transformer's layers) rather "
            "than the whole model: one compiled code object serves every layer, so the first "
            "step compiles about as many times faster as there are layers; the embeddings and "
            "the head stay eager."
        )
    if choice.mode == GRAPHS_MODE:
        sentence += (
            " Its mode replays the step as CUDA graphs: the card no longer waits for Python to "
            "launch each kernel, and a memory pool of the graphs' own stays allocated between "
            "steps. A step's outputs are overwritten by the next step: take loss.item() (or "
            "loss.detach().clone()) before the next step rather than keeping the tensor."
        )
    if budget is not None:
        title += f", activation memory budget {budget:g}"
        sentence += (
            f" Set the partitioner's activation memory budget to {budget:g} before the first "
            "step: it keeps at most that share of the activations for backward and recomputes "
            "the rest inside the compiled graph (the compiled form of activation checkpointing)."
        )
    if result is not None and result.ok:
        first_s, compile_s = (result.first_step_ms or 0) / 1e3, (result.compile_ms or 0) / 1e3
        effect = (
            f"measured at batch {result.batch_size}: first step {first_s:.1f} s (about "
            f"{compile_s:.1f} s of compiling, once), then {result.compiled_step_ms:.1f} ms a "
            f"step vs {result.eager_step_ms:.1f} ms eager; the plan's throughput is the steady "
            "state"
        )
        if gain is not None:
            ratio = gain.samples_per_s / gain.eager_samples_per_s
            effect = (
                f"on the device {gain.samples_per_s:.1f} samples/s at batch {gain.batch_size} "
                f"vs {gain.eager_samples_per_s:.1f} eager at batch {gain.eager_batch_size} "
                f"({ratio:.2f}x, steady state); the trial {effect}"
            )
    else:
        effect = (
            "not estimated: compiled memory and speed are measured on the device; the first "
            "step also compiles, seconds to minutes once per process and input shape"
        )
    return Advice(
        strategy=STRATEGY_NAME,
        title=title,
        sentence=sentence,
        snippet=_snippet(choice, form, blocks),
        effect=effect,
    )


def _repeated_container(profile: Profile) -> str | None:
    """The name of the container most of the profile's blocks sit in (``"model.layers"`` for
    blocks ``model.layers.0`` ...), for the regional snippet; None when blocks are not numbered
    children of one container."""
    parents = [
        b.name.rpartition(".")[0] for b in profile.blocks if b.name.rpartition(".")[2].isdigit()
    ]
    if not parents:
        return None
    return max(set(parents), key=parents.count)


def _snippet(choice: CompileChoice, form: CallForm | None = None, blocks: str | None = None) -> str:
    lines = ["import torch", ""]
    budget = choice.activation_memory_budget
    if budget is not None:
        lines += [
            "import torch._functorch.config",
            "",
            "# Before the first compiled step: keep at most this share of the activations for",
            "# backward, recompute the rest in the compiled backward.",
            f"torch._functorch.config.activation_memory_budget = {budget:g}",
        ]
    mode = f', mode="{choice.mode}"' if choice.mode != "default" else ""
    if choice.regional:
        lines += [
            "# Each layer compiled in place (state_dict keys unchanged); one compile serves all.",
            f"for block in model.get_submodule({blocks!r}):"
            if blocks
            else "for block in model.layers:  # your model's repeated blocks (its nn.ModuleList)",
            f"    block.compile({mode.removeprefix(', ')})",
            "",
            loss_line(form, model="model"),
            "loss.backward()",
            "optimizer.step()",
            "optimizer.zero_grad(set_to_none=True)",
            "",
            "# A last, smaller batch compiles once more (dynamic shapes):",
            "# DataLoader(drop_last=True) keeps every step at the compiled shape.",
        ]
        return "\n".join(lines) + "\n"
    lines += [
        f"compiled = torch.compile(model{mode})  # shares model's parameters; compiles on 1st call",
        "",
        loss_line(form, model="compiled") + "  # train through `compiled`",
        "loss.backward()",
        "optimizer.step()",
        "optimizer.zero_grad(set_to_none=True)",
        "",
        "# A last, smaller batch compiles once more (dynamic shapes): DataLoader(drop_last=True)",
        "# keeps every step at the compiled shape.",
        "",
        '# Save `model`, not `compiled`, whose state_dict keys gain an "_orig_mod." prefix.',
        'torch.save(model.state_dict(), "checkpoint.pt")',
    ]
    return "\n".join(lines) + "\n"
