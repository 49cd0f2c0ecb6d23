"""Strategies rewrite the training step: the model, the forward and the loss together.

Rules checked here: :func:`memadvisor.step.running` runs a rewritten step under the user's
batch rules; a strategy that changes the loss is applied by every path that runs a candidate
(the simulated device's probes, ``optimize()``, ``apply_plan`` from a plan and from its JSON
file), and the user trains with ``model.memadvisor_step``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import memadvisor
from memadvisor.errors import BadInputError
from memadvisor.schema.candidate import Candidate
from memadvisor.step import Step, base_step, running, step_from_call_form
from memadvisor.strategy import apply_candidate, load_strategies
from memadvisor.workload import Workload, train_step

# A third party's strategy that changes how the loss is computed: the user's loss over each
# half of the batch, averaged (the same value for a mean loss, by another route), and marks
# every call so that a test can see the rewritten loss ran.
TOY_MODULE = """
import torch
from memadvisor.strategy import Advice, Strategy

CALLS = []


class HalvesLoss(Strategy):
    name = "toy_halves"
    states = frozenset({"loss_changed"})

    def facts(self, choice):
        from memadvisor.schema.facts import Facts

        return Facts(loss_changed=choice == "halves")

    def choices(self, profile, config):
        # toy_halves="always" (a strategy's own setting, by its name): the only choice.
        return ["halves"] if config.options.get(self.name) == "always" else ["off", "halves"]

    def effect(self, profile, choice, model):
        pass

    def apply(self, step, choice):
        forward, loss = step.forward, step.loss

        def halves(output, batch):
            CALLS.append(output.shape[0])
            x, y = batch
            n = output.shape[0] // 2
            if n == 0:
                return loss(output, batch)
            first = loss(output[:n], (x[:n], y[:n]))
            second = loss(output[n:], (x[n:], y[n:]))
            return (first * n + second * (output.shape[0] - n)) / output.shape[0]

        return step.replace(loss=halves, loss_changed_by=(*step.loss_changed_by, self.name))

    def explain(self, choice, profile):
        return Advice(strategy=self.name, title="Halves", sentence="Loss over halves.")
"""


@pytest.fixture
def toy_halves(install_plugin):
    """A package 'toy_halves_memadvisor', registered only through a dist-info on sys.path."""
    install_plugin(
        "toy_halves_memadvisor", TOY_MODULE, {"toy_halves": "toy_halves_memadvisor:HalvesLoss"}
    )
    import toy_halves_memadvisor

    return toy_halves_memadvisor


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))


def _loss_fn(out: torch.Tensor, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.mse_loss(out, batch[1])


def _batch(n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(n, 8, generator=g), torch.randn(n, 1, generator=g)


def test_running_swaps_the_forward_and_the_loss_and_keeps_the_batch_rules() -> None:
    """A step whose loss is replaced: train_step on ``running(workload, step)`` calls the new
    loss with the workload's batch of any size, and the original workload is unchanged."""
    workload = Workload(model=_model(), sample_batch=_batch(), loss_fn=_loss_fn)
    seen: list[int] = []

    def doubled(output, batch):
        seen.append(batch[0].shape[0])
        return 2 * _loss_fn(output, batch)

    step = base_step(workload).replace(loss=doubled, loss_changed_by=("test",))
    run = running(workload, step)
    batch = run.batch(6)
    with torch.no_grad():  # train_step's loss is the one before its optimizer step
        expected = 2 * _loss_fn(workload.model(batch[0]), batch)
    opt = run.make_optimizer(run.model)
    loss = train_step(run, run.model, opt, batch)
    assert seen == [6]
    assert torch.allclose(loss, expected, atol=1e-6)
    assert workload.loss_fn is _loss_fn and run.loss_fn is doubled


def test_apply_candidate_returns_the_step_a_loss_strategy_rewrote(toy_halves) -> None:
    """The rewritten step's loss is the strategy's, its value the user's loss by another
    route, and ``loss_changed_by`` names the strategy; the model is the same object."""
    workload = Workload(model=_model(), sample_batch=_batch(), loss_fn=_loss_fn)
    step = apply_candidate(
        base_step(workload), Candidate(batch_size=8, choices={"toy_halves": "halves"})
    )
    assert step.model is workload.model and step.loss_changed_by == ("toy_halves",)
    batch = _batch()
    toy_halves.CALLS.clear()
    assert torch.allclose(step(batch), _loss_fn(workload.model(batch[0]), batch), atol=1e-6)
    assert toy_halves.CALLS == [8]


def test_a_third_party_loss_strategy_plans_applies_and_trains(toy_halves, tmp_path) -> None:
    """Registered only through an entry point: the simulated device's probes run its loss,
    the plan picks it, optimize() and apply_plan() (from the Plan and from its JSON file,
    given the user's loss_fn) hand back a step that runs it, and training lowers the loss."""
    assert "toy_halves" in [s.name for s in load_strategies()]
    toy_halves.CALLS.clear()
    tuned = memadvisor.optimize(
        _model(),
        _batch(),
        loss_fn=_loss_fn,
        budget_gb=0.05,
        device="cpu",
        strategies=["toy_halves", "batch_size"],
        max_batch=64,
        toy_halves="always",
    )
    plan = tuned.memadvisor_plan
    assert plan.candidate.choices.get("toy_halves") == "halves"
    assert toy_halves.CALLS, "the device's runs never called the rewritten loss"
    step = tuned.memadvisor_step
    assert isinstance(step, Step) and step.loss_changed_by == ("toy_halves",)
    assert step.model is tuned

    opt = torch.optim.SGD(tuned.parameters(), lr=0.05)
    batch = _batch(32)
    losses = []
    for _ in range(20):
        toy_halves.CALLS.clear()
        loss = step(batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
        assert toy_halves.CALLS == [32]
    assert losses[-1] < losses[0]

    path = tmp_path / "plan.json"
    plan.to_json(path)
    again = memadvisor.apply_plan(_model(), path, loss_fn=_loss_fn)
    assert again.memadvisor_step.loss_changed_by == ("toy_halves",)
    toy_halves.CALLS.clear()
    value = again.memadvisor_step(batch)
    assert toy_halves.CALLS == [32]
    assert torch.allclose(value, _loss_fn(again(batch[0]), batch), atol=1e-6)


def test_a_plan_file_step_without_the_users_loss_fn_says_to_pass_it(toy_halves, tmp_path) -> None:
    """A plan made with a loss_fn, applied from its file without one: calling the step raises
    BadInputError naming apply_plan's loss_fn (a plan file holds no code)."""
    plan = memadvisor.plan(
        _model(), _batch(), loss_fn=_loss_fn, budget_gb=0.05, device="cpu",
        strategies=["toy_halves", "batch_size"], max_batch=64, toy_halves="always",
    )  # fmt: skip
    path = tmp_path / "plan.json"
    plan.to_json(path)
    model = memadvisor.apply_plan(_model(), path)
    with pytest.raises(BadInputError, match=r"apply_plan\(model, plan, loss_fn="):
        model.memadvisor_step(_batch())


def test_the_plain_step_of_a_call_form_follows_the_workload_rules() -> None:
    """Tensor, tuple and mapping batches call the model as the workload does; a scalar output
    is the loss."""
    model = nn.Linear(3, 1)
    step = step_from_call_form(model, None)
    x = torch.randn(4, 3)
    assert torch.equal(step.forward(model, x), model(x))
    assert torch.equal(step.forward(model, (x, None)), model(x))
    assert torch.equal(step.forward(model, {"input": x}), model(input=x))
    scalar = torch.tensor(2.0)
    assert step.loss(scalar, x) == scalar
    with pytest.raises(BadInputError, match="loss_fn"):
        step.loss(torch.ones(4, 1), x)


def test_the_reports_loop_trains_with_the_rewritten_step(toy_halves, tmp_path) -> None:
    """The report's "train with it in your own loop" code for a plan whose loss changed
    calls ``model.memadvisor_step(batch)`` (apply_plan given the user's loss_fn), and runs as
    printed: the toy's loss is what the loop trains with."""
    plan = memadvisor.plan(
        _model(), _batch(), loss_fn=_loss_fn, budget_gb=0.05, device="cpu",
        strategies=["toy_halves", "batch_size"], max_batch=16, toy_halves="always",
    )  # fmt: skip
    path = tmp_path / "plan.json"
    plan.to_json(path)
    from memadvisor.report._adopt import adoption_snippet

    code = adoption_snippet(memadvisor.Plan.load(path))
    assert "loss = model.memadvisor_step(batch)" in code
    assert "apply_plan(model, plan, loss_fn=loss_fn)" in code
    x, y = _batch(48)
    toy_halves.CALLS.clear()
    exec(  # the printed code, as a user pastes it
        code,
        {
            "model": _model(),
            "plan": memadvisor.Plan.load(path),
            "dataset": torch.utils.data.TensorDataset(x, y),
            "loss_fn": _loss_fn,
        },
    )
    b = plan.candidate.batch_size
    assert toy_halves.CALLS and set(toy_halves.CALLS) <= {b, 48 % b}
