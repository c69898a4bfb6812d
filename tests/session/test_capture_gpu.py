"""The capture probe on a GPU: it names the blocking line and leaves the training alone."""

from __future__ import annotations

import pytest
import torch

import barrierguard
from _runif import run_if

pytestmark = run_if(min_cuda_gpus=1)


def _train(
    steps: int, probe_at: int | None, blocked: bool = False
) -> tuple[list[float], list[torch.Tensor]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Dropout(0.1)).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = torch.randn(steps, 8, 16, device="cuda")
    losses = []

    def fwd_bwd(x: torch.Tensor) -> torch.Tensor:
        loss = model(x).pow(2).mean()
        loss.backward()
        return loss

    def with_item(x: torch.Tensor) -> float:
        return float(fwd_bwd(x).item())

    with barrierguard.watch(policy="record", memory=False) as guard:
        for i in range(steps):
            if i == probe_at:
                torch.cuda.synchronize()
                allocated = torch.cuda.memory_allocated()
                result = guard.probe_capture(with_item if blocked else fwd_bwd, data[i])
                assert result.status == ("blocked" if blocked else "capturable"), result
                # Nothing of the capture stays allocated (a failed one gives its pool back).
                assert torch.cuda.memory_allocated() == allocated
            loss = fwd_bwd(data[i])
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
    return [float(x) for x in losses], [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("blocked", [False, True])
def test_probe_leaves_the_training_bit_for_bit_as_it_was(blocked: bool) -> None:
    plain = _train(6, None)
    probed = _train(6, 3, blocked)
    assert plain[0] == probed[0]
    for a, b in zip(plain[1], probed[1], strict=True):
        assert torch.equal(a, b)


def test_probe_names_the_item_that_blocks_capture() -> None:
    x = torch.randn(4, device="cuda")

    def step() -> float:
        return x.sum().item()  # blocks

    with barrierguard.watch(policy="record", memory=False) as guard:
        result = guard.probe_capture(step)
    assert result.status == "blocked"
    assert (result.file, result.line) == (__file__, step.__code__.co_firstlineno + 1)
    assert "# blocks" in result.code
    (site,) = [s for s in guard.report.sites if s.file == __file__ and s.kind == "item"]
    assert dict(site.phases) == {"probe": 1} and site.step_count == 0
