"""The audit on checkpoints, index lists and cuDNN RNNs (audit_rules.install_patches)."""

from __future__ import annotations

import io
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn

import barrierguard

HERE = __file__


def _sites(body: Callable[[], None]) -> dict[str, tuple[str, str, int]]:
    """Run ``body`` under the audit: {code of a line in this file: (kind, detail, count)}."""
    with barrierguard.watch(engine="audit", policy="record") as guard:
        body()
    return {s.code: (s.kind, s.detail, s.count) for s in guard.report.sites if s.file == HERE}


def test_save_of_device_tensors_is_a_copy_per_tensor_and_its_load_goes_back(
    tmp_path: Path,
) -> None:
    path = tmp_path / "model.pt"

    def body() -> None:
        device = "cpu"
        model = nn.Linear(4, 2).to(device)
        torch.save(model.state_dict(), path)
        state = torch.load(path)
        model.load_state_dict(state)
        state["weight"].sum().item()

    sites = _sites(body)
    assert sites["torch.save(model.state_dict(), path)"] == ("copy", "d2h", 2)
    assert sites["state = torch.load(path)"] == ("copy", "h2d", 1)
    # Loaded onto the device: the parameters' copy_ is on the device, and a read syncs.
    assert "model.load_state_dict(state)" not in sites
    assert sites['state["weight"].sum().item()'][0] == "item"


def test_host_checkpoints_stay_quiet(tmp_path: Path) -> None:
    path = tmp_path / "host.pt"
    torch.save({"w": torch.ones(3)}, path)  # saved before the audit: its tensors are host

    def body() -> None:
        torch.save({"w": torch.ones(3)}, tmp_path / "again.pt")
        state = torch.load(path)
        kept = torch.load(path, map_location=lambda storage, loc: storage)
        state["w"].sum().item()
        del kept

    assert _sites(body) == {}


def test_load_with_a_map_location_onto_the_training_device() -> None:
    buf = io.BytesIO()
    torch.save({"w": torch.ones(3)}, buf)

    def body() -> None:
        device = "cpu"
        buf.seek(0)
        onto = torch.load(buf, map_location=device)
        buf.seek(0)
        host = torch.load(buf, map_location="cpu")
        buf.seek(0)
        mapped = torch.load(buf, map_location={"cuda:0": device})
        model = nn.Linear(3, 1).to(device)
        model.weight.data.copy_(host["w"][None])
        del onto, mapped

    sites = _sites(body)
    assert sites["onto = torch.load(buf, map_location=device)"] == ("copy", "h2d", 1)
    assert sites['mapped = torch.load(buf, map_location={"cuda:0": device})'][0] == "copy"
    assert 'host = torch.load(buf, map_location="cpu")' not in sites
    assert sites['model.weight.data.copy_(host["w"][None])'] == ("copy", "h2d", 1)


def test_a_whole_model_saved_and_loaded_is_on_the_device(tmp_path: Path) -> None:
    path = tmp_path / "whole.pt"

    def body() -> None:
        device = "cpu"
        model = nn.Sequential(nn.Linear(4, 2)).to(device)
        torch.save(model, path)
        loaded = torch.load(path, weights_only=False)
        loaded(torch.ones(4)).sum().item()

    sites = _sites(body)
    assert sites["torch.save(model, path)"] == ("copy", "d2h", 2)
    assert sites["loaded = torch.load(path, weights_only=False)"] == ("copy", "h2d", 1)
    assert sites["loaded(torch.ones(4)).sum().item()"][0] == "item"


def test_python_lists_and_ranges_as_an_index_into_a_device_tensor() -> None:
    def body() -> None:
        device = "cpu"
        x = torch.randn(4, 3).to(device)
        y = torch.tensor([0, 1, 2, 0]).to(device)
        x[range(4), y]
        x[[0, 2]]
        x[np.array([1, 3])]
        x[range(4), y] = 0.0
        x[0, 1]
        x[torch.arange(2).to(device)]
        x[[]]
        host = torch.randn(4, 3)
        host[[0, 2]]
        host[range(4), [0, 1, 2, 0]] = 1.0

    sites = _sites(body)
    for code in ("x[range(4), y]", "x[[0, 2]]", "x[np.array([1, 3])]", "x[range(4), y] = 0.0"):
        assert sites[code] == ("index", "list", 1), code
    for code in ("x[0, 1]", "x[[]]", "host[[0, 2]]", "host[range(4), [0, 1, 2, 0]] = 1.0"):
        assert code not in sites, code


def test_flatten_parameters_of_a_device_rnn() -> None:
    def body() -> None:
        device = "cpu"
        lstm = nn.LSTM(4, 8).to(device)
        lstm.flatten_parameters()
        gru = nn.GRU(4, 8)
        gru.flatten_parameters()
        half = nn.RNN(4, 8).to(device, torch.bfloat16)
        half.flatten_parameters()

    sites = _sites(body)
    assert sites["lstm.flatten_parameters()"] == ("rnn_flatten", "", 1)
    # model.to(device) flattens too: counted at that line, as the CUDA engine reads it.
    assert sites["lstm = nn.LSTM(4, 8).to(device)"][0] == "copy"
    assert "gru.flatten_parameters()" not in sites  # host weights
    assert "half.flatten_parameters()" not in sites  # a dtype cuDNN does not take


def test_the_patches_are_undone() -> None:
    save, load, flatten = torch.save, torch.load, nn.RNNBase.flatten_parameters
    with barrierguard.watch(engine="audit", policy="record"):
        assert torch.save is not save and torch.load is not load
    assert (torch.save, torch.load, nn.RNNBase.flatten_parameters) == (save, load, flatten)
