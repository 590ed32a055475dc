"""materialize_optimizer_state: a parked spare's optimizer slots made ahead of the copy, as placeholders that the
copy fills or that are dropped, so that an optimizer never trains on them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from stalwart.restart import materialize_optimizer_state
from stalwart.restart.optimizer_slots import placeholders, settle

OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, weight_decay=0.01),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01, weight_decay=0.01),
    "adamw-amsgrad": lambda ps: torch.optim.AdamW(ps, lr=torch.tensor(0.01), amsgrad=True),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=0.01, momentum=0.5),
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))


def _step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    torch.manual_seed(1)
    opt.zero_grad(set_to_none=True)
    model(torch.randn(5, 4)).pow(2).sum().backward()
    opt.step()


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_slots_are_made_and_nothing_else_moves(kind: str) -> None:
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    opt = OPTIMIZERS[kind](model.parameters())
    lrs = [g["lr"] for g in opt.param_groups]

    assert materialize_optimizer_state(opt) is True

    params = list(model.parameters())
    assert all(torch.equal(a, p) for a, p in zip(before, params, strict=True))
    assert all(p.grad is None for p in params)
    assert [g["lr"] for g in opt.param_groups] == lrs
    assert {id(p) for p, _ in placeholders(opt)} == {id(p) for p in params}
    assert all(opt.state[p] for p in params)


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_slots_no_copy_filled_are_dropped_and_the_optimizer_trains_as_a_fresh_one(kind: str) -> None:
    fresh_model, model = _model(), _model()
    fresh = OPTIMIZERS[kind](fresh_model.parameters())
    opt = OPTIMIZERS[kind](model.parameters())
    materialize_optimizer_state(opt)

    settle(opt, None)  # a copy that filled nothing (no rank held state)

    assert not opt.state and placeholders(opt) == []
    for _ in range(3):
        _step(fresh_model, fresh)
        _step(model, opt)
    assert all(torch.equal(a, b) for a, b in zip(fresh_model.parameters(), model.parameters(), strict=True))


def test_slots_a_copy_filled_stay_and_the_rest_go() -> None:
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    materialize_optimizer_state(opt)
    first, second = list(model.parameters())[:2]
    kept = opt.state[first]["exp_avg"]

    settle(opt, [(first, "exp_avg"), (first, "exp_avg_sq"), (first, "step"), (second, "exp_avg")])

    assert opt.state[first]["exp_avg"] is kept
    assert set(opt.state[first]) == {"exp_avg", "exp_avg_sq", "step"}
    assert set(opt.state[second]) == {"exp_avg"}
    assert len(opt.state) == 2  # the other two parameters' slots went, and their entries with them
    assert placeholders(opt) == []  # what stayed is state now: a later settle leaves it
    settle(opt, None)
    assert set(opt.state[second]) == {"exp_avg"}


def test_slots_state_loaded_since_is_never_touched() -> None:
    source_model, model = _model(), _model()
    source = torch.optim.Adam(source_model.parameters(), lr=0.01)
    _step(source_model, source)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    materialize_optimizer_state(opt)

    opt.load_state_dict(source.state_dict())  # e.g. a checkpoint read after the copy found no replica
    settle(opt, None)

    assert len(opt.state) == 4
    for p, q in zip(source_model.parameters(), model.parameters(), strict=True):
        assert torch.equal(source.state[p]["exp_avg"], opt.state[q]["exp_avg"])


def test_slots_not_made_for_an_optimizer_in_use() -> None:
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    _step(model, opt)
    state = {id(p): dict(s) for p, s in opt.state.items()}
    assert materialize_optimizer_state(opt) is False  # it has state
    assert {id(p): dict(s) for p, s in opt.state.items()} == state

    other = torch.optim.SGD(_model().parameters(), lr=0.1, momentum=0.9)
    for p in other.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    assert materialize_optimizer_state(other) is False  # a step is under way: its gradients are kept
    assert not other.state and all(p.grad is not None for p in other.param_groups[0]["params"])


def test_slots_of_an_optimizer_whose_step_raises_are_left_to_the_copy(caplog: pytest.LogCaptureFixture) -> None:
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1)  # its step needs a closure

    assert materialize_optimizer_state(opt) is False

    assert not opt.state and placeholders(opt) == []
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    assert opt.param_groups[0]["lr"] == 0.1
    assert "cannot make the slots of LBFGS ahead of a copy (its step raised TypeError" in caplog.text


def test_slots_of_a_plain_sgd_are_none_to_make() -> None:
    opt = torch.optim.SGD(_model().parameters(), lr=0.1)
    assert materialize_optimizer_state(opt) is False
    assert not opt.state


def test_slots_bad_input_names_the_argument() -> None:
    with pytest.raises(TypeError, match=r"optimizer: expected a torch\.optim\.Optimizer, got Sequential"):
        materialize_optimizer_state(_model())  # type: ignore[arg-type]
