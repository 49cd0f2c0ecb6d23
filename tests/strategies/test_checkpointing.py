"""Activation checkpointing: exact gradients, unchanged keys, pickles, no recompute in eval."""

from __future__ import annotations

import copy
import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from memadvisor.errors import BadInputError
from memadvisor.estimate import StepModel
from memadvisor.schema.config import PlanConfig
from strategies import _forward, checkpointing
from strategies.checkpointing import ActivationCheckpointing, CheckpointedForward
from tests.fixtures.steps import applied

CKPT = ActivationCheckpointing()
CONFIG = PlanConfig(budget_bytes=2**30)


def _gpt(gpt_example, dropout: float = 0.1) -> tuple[nn.Module, tuple, object]:
    built = gpt_example.build(
        batch_size=3, dropout=dropout, block_size=16, n_layer=3, vocab_size=256
    )
    return built["model"], built["sample_batch"], built["loss_fn"]


def _grads(model: nn.Module, batch, loss_fn, seed: int = 7) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss_fn(model(batch[0]), batch).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _count_calls(module: nn.Module) -> list[int]:
    calls = [0]
    # A pre-hook: a recompute stops early (early_stop) once it has what backward needs, so
    # a forward hook of the block's last module may never fire during it.
    module.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def test_gradients_equal_the_original_exactly_in_fp32_with_dropout(gpt_example) -> None:
    """Recompute replays the RNG: dropout masks and so gradients are bit-identical."""
    model, batch, loss_fn = _gpt(gpt_example, dropout=0.2)
    tuned = applied(CKPT, copy.deepcopy(model), ["h.0", "h.2"], None)
    expected, got = _grads(model, batch, loss_fn), _grads(tuned, batch, loss_fn)
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), name


def test_recompute_happens_in_training(gpt_example) -> None:
    """In train mode with grad enabled a checkpointed block's forward runs twice per step."""
    model, batch, loss_fn = _gpt(gpt_example)
    applied(CKPT, model, ["h.1"], None)
    calls = _count_calls(model.h[1].mlp)
    loss_fn(model(batch[0]), batch).backward()
    assert calls[0] == 2


@pytest.mark.parametrize("mode", ["eval", "no_grad", "inference_mode"])
def test_no_recompute_in_eval_or_without_grad(gpt_example, mode: str) -> None:
    """eval(), no_grad and inference_mode run each block once and save nothing to recompute."""
    model, batch, loss_fn = _gpt(gpt_example)
    applied(CKPT, model, ["h.0", "h.1", "h.2"], None)
    calls = _count_calls(model.h[1].mlp)
    if mode == "eval":
        model.eval()
        loss_fn(model(batch[0]), batch).backward()  # grad enabled, but eval: no checkpoint
    else:
        ctx = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
        with ctx:
            model(batch[0])
    assert calls[0] == 1


def test_parameter_names_and_state_dict_keys_are_unchanged(gpt_example) -> None:
    model, _, _ = _gpt(gpt_example)
    before = (list(model.state_dict()), [n for n, _ in model.named_parameters()])
    applied(CKPT, model, ["h.0", "h.1"], None)
    assert (list(model.state_dict()), [n for n, _ in model.named_parameters()]) == before


def test_torch_save_load_round_trip_and_load_state_dict_into_the_original_class(
    gpt_example,
) -> None:
    """A saved tuned model loads back still checkpointed; its weights load into a plain GPT."""
    model, batch, loss_fn = _gpt(gpt_example, dropout=0.1)
    tuned = applied(CKPT, copy.deepcopy(model), ["h.1"], None)
    buf = io.BytesIO()
    torch.save(tuned, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    wrapper = loaded.h[1].__dict__["forward"]
    assert isinstance(wrapper, CheckpointedForward) and wrapper.module is loaded.h[1]
    calls = _count_calls(loaded.h[1].mlp)
    assert all(
        torch.equal(a, b)
        for a, b in zip(
            _grads(loaded, batch, loss_fn).values(),
            _grads(model, batch, loss_fn).values(),
            strict=True,
        )
    )
    assert calls[0] == 2  # still checkpointed after loading

    buf = io.BytesIO()
    torch.save(tuned.state_dict(), buf)
    buf.seek(0)
    plain = gpt_example.GPT(model.cfg)
    plain.load_state_dict(torch.load(buf), strict=True)
    for (n, a), b in zip(plain.state_dict().items(), tuned.state_dict().values(), strict=True):
        assert torch.equal(a, b), n


def test_deepcopy_binds_the_wrapper_to_the_copy(gpt_example) -> None:
    model, _, _ = _gpt(gpt_example)
    applied(CKPT, model, ["h.0"], None)
    twin = copy.deepcopy(model)
    assert twin.h[0].forward.module is twin.h[0]


def test_applying_twice_does_not_wrap_twice(gpt_example) -> None:
    model, batch, loss_fn = _gpt(gpt_example)
    applied(CKPT, model, ["h.0"], None)
    applied(CKPT, model, ["h.0", "h.1"], None)
    assert len(list(_forward.wrappers(model.h[0]))) == 1
    calls = _count_calls(model.h[0].mlp)
    loss_fn(model(batch[0]), batch).backward()
    assert calls[0] == 2  # one forward, one recompute: not a recompute of a recompute


def test_unknown_block_is_bad_input(gpt_example) -> None:
    model, _, _ = _gpt(gpt_example)
    with pytest.raises(BadInputError, match="no such submodule"):
        applied(CKPT, model, ["h.9"], None)
    with pytest.raises(BadInputError, match="list of block names"):
        applied(CKPT, model, "h.0", None)


# -- HF-style decoder layers --------------------------------------------------------------------


def _hf_grads(model: nn.Module, batch, seed: int = 3, output_attentions: bool = False):
    model.zero_grad(set_to_none=True)
    ids, mask = batch
    torch.manual_seed(seed)
    logits, attentions = model(ids, mask, output_attentions=output_attentions)
    loss = F.cross_entropy(logits.flatten(0, 1), ids.flatten())
    if attentions:
        loss = loss + sum(a.square().mean() for a in attentions)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("output_attentions", [False, True])
def test_hf_style_layer_with_kwargs_and_tuple_outputs_gives_exact_gradients(
    hf_model, hf_batch, output_attentions: bool
) -> None:
    """Keyword masks/position ids reach the layer, tuples come back, gradients are exact."""
    tuned = applied(CKPT, copy.deepcopy(hf_model), ["layers.0", "layers.1", "layers.2"], None)
    loss_a, expected = _hf_grads(hf_model, hf_batch, output_attentions=output_attentions)
    loss_b, got = _hf_grads(tuned, hf_batch, output_attentions=output_attentions)
    assert torch.equal(loss_a, loss_b)
    for name in expected:
        assert torch.equal(expected[name], got[name]), name
    assert tuned.layers[1].calls == 2  # forward + recompute


def test_an_in_place_kv_cache_is_dropped_in_training_as_hf_does(hf_model, toy_cache_class) -> None:
    """A cache updated in place would be appended twice by the recompute: like HF's own
    checkpointing, the layer runs with no cache and use_cache=False, and is checkpointed."""
    checkpointing._warned.clear()
    applied(CKPT, hf_model, ["layers.0"], None)
    layer = hf_model.layers[0]
    cache = toy_cache_class()
    x = torch.randn(2, 5, 16, requires_grad=True)
    with pytest.warns(UserWarning, match="KV cache"):
        outputs = layer(x, past_key_value=cache, use_cache=True)
    outputs[0].sum().backward()
    assert len(outputs) == 1 and cache.keys == [] and layer.calls == 2


class _CachedBlock(nn.Module):
    """An HF-style block that takes a KV cache, with no state of its own that a call
    changes (a counter would be a side effect dynamo refuses inside a checkpoint)."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.k, self.v = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor, past_key_value=None, use_cache: bool = False) -> tuple:
        k, v = self.k(x), self.v(x)
        if past_key_value is not None:
            k, v = past_key_value.update(k, v)
        out = x + (x @ k.transpose(1, 2)).softmax(-1) @ v
        return (out, past_key_value) if use_cache else (out,)


def test_a_compiled_checkpointed_block_given_a_kv_cache_traces_as_one_graph(
    toy_cache_class,
) -> None:
    """Rule: dropping the cache does not break a compiled graph. The warning that says so is
    not issued while dynamo traces: ``warnings.warn`` is a builtin dynamo cannot trace, and
    the call broke the graph at every checkpointed block of a compiled Hugging Face model
    (the hf_gpt2 example: 6 graphs and 8 breaks there, 2 graphs without it). Compiled with
    ``fullgraph=True``, which raises at any graph break, the block runs and trains; an eager
    call still warns."""
    checkpointing._warned.clear()
    model = nn.Sequential(_CachedBlock())
    applied(CKPT, model, ["0"], None)
    compiled = torch.compile(model[0], backend="eager", fullgraph=True)
    x = torch.randn(2, 5, 16, requires_grad=True)
    cache = toy_cache_class()
    outputs = compiled(x, past_key_value=cache, use_cache=True)
    outputs[0].sum().backward()
    assert len(outputs) == 1 and cache.keys == [] and x.grad is not None
    assert "_CachedBlock" not in checkpointing._warned  # not warned while tracing
    with pytest.warns(UserWarning, match="KV cache"):
        model[0](x, past_key_value=toy_cache_class(), use_cache=True)


def test_a_kv_cache_is_used_as_given_in_eval(hf_model, toy_cache_class) -> None:
    applied(CKPT, hf_model, ["layers.0"], None)
    hf_model.eval()
    cache = toy_cache_class()
    _, returned = hf_model.layers[0](torch.randn(2, 5, 16), past_key_value=cache, use_cache=True)
    assert returned is cache and len(cache.keys) == 1


def test_a_cache_is_recognised_by_what_it_is_under_any_name_or_position(
    hf_model, toy_cache_class
) -> None:
    """The cache is found by type, not by the argument's name: transformers renamed it
    (``past_key_value`` -> ``cache``) and some models pass it by position."""
    checkpointing._warned.clear()
    layer = hf_model.layers[0]
    seen: list[object] = []
    inner = layer.forward

    def spy(x, *rest, **kwargs):
        seen.extend([*rest, *kwargs.values()])
        return inner(x, **{k: v for k, v in kwargs.items() if k != "some_new_name"})

    layer.forward = spy
    applied(CKPT, hf_model, ["layers.0"], None)
    cache = toy_cache_class()
    x = torch.randn(2, 5, 16, requires_grad=True)
    with pytest.warns(UserWarning, match="KV cache"):
        layer(x, cache, some_new_name=cache, use_cache=True)[0].sum().backward()
    assert cache.keys == [] and not any(s is cache for s in seen)
    assert checkpointing.is_mutable_cache(cache)
    assert not checkpointing.is_mutable_cache((torch.zeros(1), torch.zeros(1)))


def _hf_exactness(
    transformers, model: nn.Module, blocks: list[str], batch: dict, counted: str
) -> None:
    """Loss, every gradient and the state_dict keys of ``model`` with ``blocks`` checkpointed
    equal the unwrapped model's, and the last block recomputes; failures name the
    transformers release met."""
    version = f"transformers {transformers.__version__}"
    tuned = applied(CKPT, copy.deepcopy(model), blocks, None)
    calls = _count_calls(tuned.get_submodule(counted))
    results = []
    for m in (model, tuned):
        torch.manual_seed(1)
        out = m(**batch)
        out.loss.backward()
        results.append((out.loss.detach(), {n: p.grad for n, p in m.named_parameters()}))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.equal(loss_a, loss_b), f"{version}: loss {loss_a} != {loss_b}"
    unequal = [n for n in grads_a if not torch.equal(grads_a[n], grads_b[n])]
    assert not unequal, f"{version}: gradients differ for {unequal}"
    assert calls[0] == 2, f"{version}: {counted} ran {calls[0]} times, not forward + recompute"
    assert list(tuned.state_dict()) == list(model.state_dict()), version


def test_a_real_hf_llama_checkpoints_exactly_with_masks_dropout_and_its_default_cache() -> None:
    """transformers' LlamaForCausalLM (use_cache on by default builds a DynamicCache in
    training, passed by keyword): gradients equal the unwrapped model's exactly and every
    layer recomputes."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attention_dropout=0.1,
        use_cache=True,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).train()
    ids = torch.randint(0, 64, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    _hf_exactness(
        transformers,
        model,
        ["model.layers.0", "model.layers.1"],
        {"input_ids": ids, "attention_mask": mask, "labels": ids},
        counted="model.layers.1.self_attn",
    )


def test_a_real_hf_gpt2_with_its_default_config_checkpoints_exactly() -> None:
    """GPT-2 with its shipped ``use_cache=True`` passes its cache to each block by position:
    the README's Hugging Face example crashed on it. (Dropout is off here: GPT-2's attention
    dropout recomputes within 5e-8 rather than bit-exactly; Llama above covers dropout.)"""
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_embd=32,
        n_layer=2,
        n_head=4,
        vocab_size=64,
        n_positions=32,
        bos_token_id=0,
        eos_token_id=0,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    assert config.use_cache
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config).train()
    ids = torch.randint(0, 64, (2, 9))
    _hf_exactness(
        transformers,
        model,
        ["transformer.h.0", "transformer.h.1"],
        {"input_ids": ids, "labels": ids},
        counted="transformer.h.1.attn",
    )


# -- choices, effect, explain -------------------------------------------------------------------


def test_choices_are_ranked_prefixes_by_bytes_freed_per_ms(profile_factory) -> None:
    """(activation - input) / forward_ms ranks blocks; a block that frees nothing is left out."""
    # per sample: (activation MiB, input MiB, forward ms)
    profile = profile_factory([(10, 2, 4), (10, 2, 1), (3, 3, 1), (20, 2, 2)])
    # freed per ms: 2.0, 8.0, none, 9.0 -> order layers.3, layers.1, layers.0
    assert CKPT.choices(profile, CONFIG) == [
        [],
        ["layers.3"],
        ["layers.1", "layers.3"],
        ["layers.0", "layers.1", "layers.3"],
    ]


def test_effect_marks_the_named_blocks_checkpointed(profile_factory) -> None:
    profile = profile_factory([(10, 2, 1)] * 3)
    model = StepModel(profile, batch_size=4)
    CKPT.effect(profile, ["layers.0", "layers.2"], model)
    assert model.checkpointed == [True, False, True]
    with pytest.raises(BadInputError, match="does not have"):
        CKPT.effect(profile, ["layers.7"], model)


def test_explain_is_none_when_off_and_its_snippet_checkpoints_exactly(
    profile_factory, gpt_example
) -> None:
    """The pasted snippet gives the same gradients and does recompute (runs twice)."""
    profile = profile_factory([(10, 2, 1)] * 3)
    assert CKPT.explain([], profile) is None
    advice = CKPT.explain(["layers.0", "layers.2"], profile)
    assert advice.title == "Checkpoint 2 of 3 blocks"
    assert "32.0 MiB" in advice.effect  # (10 - 2) MiB x 2 samples x 2 blocks

    model, batch, loss_fn = _gpt(gpt_example, dropout=0.1)
    pasted = copy.deepcopy(model)
    snippet = advice.snippet.replace("['layers.0', 'layers.2']", "['h.0', 'h.2']")
    exec(snippet, {"model": pasted})  # noqa: S102 - the advice is code meant to be run
    calls = _count_calls(pasted.h[2].mlp)
    expected, got = _grads(model, batch, loss_fn), _grads(pasted, batch, loss_fn)
    assert all(torch.equal(expected[n], got[n]) for n in expected)
    assert calls[0] == 2


# -- buffers a forward mutates ------------------------------------------------------------


def _train(model: nn.Module, batch, loss_fn, steps: int) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(5)
    for _ in range(steps):
        loss_fn(model(batch[0]), batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def test_nothing_is_lost_buffers_and_parameters_equal_after_n_steps(cnn_example) -> None:
    """Rule: a checkpointed CNN trains to exactly the unwrapped one's state: every parameter
    and every buffer (BatchNorm's running stats and num_batches_tracked among them)."""
    built = cnn_example.build(batch_size=4)
    plain = built["model"]
    wrapped = copy.deepcopy(plain)
    names = [f"layers.{i}" for i in range(len(wrapped.layers))]
    applied(CKPT, wrapped, names, None)
    _train(plain, built["sample_batch"], built["loss_fn"], steps=3)
    _train(wrapped, built["sample_batch"], built["loss_fn"], steps=3)
    assert int(wrapped.layers[0].bn1.num_batches_tracked) == 3
    mine, theirs = wrapped.state_dict(), plain.state_dict()
    assert list(mine) == list(theirs)
    for key in theirs:
        assert torch.equal(mine[key], theirs[key]), key


class _Counting(nn.Module):
    """A forward that reads a buffer it mutates, in place and by reassignment."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros(()))
        self.register_buffer("last", torch.zeros(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        self.last = x.detach().mean(0)
        return torch.tanh(self.lin(x) * self.calls)


@pytest.mark.parametrize("steps", [1, 3])
def test_any_mutated_buffer_changes_once_and_the_recompute_sees_what_forward_saw(
    steps: int,
) -> None:
    """Rule: the recompute neither applies a forward's buffer updates a second time nor
    reads the updated values: buffers and gradients equal the unwrapped model's."""
    torch.manual_seed(0)
    plain = nn.Sequential(_Counting(), _Counting())
    wrapped = copy.deepcopy(plain)
    applied(CKPT, wrapped, ["0", "1"], None)
    x = torch.randn(3, 4)
    for model in (plain, wrapped):
        for _ in range(steps):
            model.zero_grad(set_to_none=True)
            model(x).pow(2).sum().backward()
    assert float(wrapped[0].calls) == steps
    for (name, a), (_, b) in zip(plain.named_buffers(), wrapped.named_buffers(), strict=True):
        assert torch.equal(a, b), name
    for (name, a), (_, b) in zip(plain.named_parameters(), wrapped.named_parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), name


class _DenseLayer(nn.Module):
    """torchvision's _DenseLayer: it concatenates the list of every earlier output."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.lin = nn.Linear(channels, 2)

    def forward(self, features: list[torch.Tensor]) -> torch.Tensor:
        return torch.tanh(self.lin(torch.cat(features, 1)))


class _DenseStage(nn.Module):
    """torchvision's _DenseBlock: after each layer, its output joins the list it was given."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_DenseLayer(2 + 2 * i) for i in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        features = [x]
        for layer in self.layers:
            features.append(layer(features))
        return torch.cat(features, 1)


def test_the_recompute_sees_a_list_argument_as_forward_did_though_the_caller_grew_it() -> None:
    """Rule: a list (or dict) a block was given and its caller changed afterwards is
    recomputed as it was at the call; the caller's own list still grows as it did."""
    torch.manual_seed(0)
    plain = _DenseStage()
    wrapped = copy.deepcopy(plain)
    applied(CKPT, wrapped, ["layers.0", "layers.1", "layers.2"], None)
    x = torch.randn(3, 2)
    outs = []
    for model in (plain, wrapped):
        outs.append(model(x))
        outs[-1].pow(2).sum().backward()
    assert outs[1].shape == (3, 8) and torch.equal(outs[0], outs[1])
    for (name, a), (_, b) in zip(plain.named_parameters(), wrapped.named_parameters(), strict=True):
        assert torch.equal(a.grad, b.grad), name


def test_a_checkpointed_batchnorm_trains_on_fake_tensors() -> None:
    """Rule: the buffer guard never reads values, which fake tensors (fake planning) lack."""
    from memadvisor._torch_private import fake_tensor_mode

    with fake_tensor_mode():
        model = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)), nn.Linear(4, 1))
        applied(CKPT, model, ["0"], None)
        for _ in range(2):
            model(torch.randn(3, 4)).sum().backward()
        assert model[0][1].num_batches_tracked.shape == ()
