"""The command line's own behaviour: thread count and argument checks (the pipelines it runs are
tested in test_reproduce.py)."""

from __future__ import annotations

import pytest
import torch

from cpsuper import cli


@pytest.fixture
def threads_restored():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_threads_default_to_the_cores_the_process_may_use(threads_restored, capsys, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert cli.set_threads(None) == cli.available_cores() == torch.get_num_threads()
    assert f"torch uses {cli.available_cores()} CPU thread(s)" in capsys.readouterr().err
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # as torchrun and the test workers set it
    assert cli.set_threads(None) == 1 == torch.get_num_threads()


def test_threads_can_be_set_and_must_be_positive(threads_restored, capsys):
    assert cli.set_threads(1) == 1 and torch.get_num_threads() == 1
    with pytest.raises(SystemExit, match="--threads must be at least 1"):
        cli.set_threads(0)


@pytest.mark.parametrize("command", [["conflicts"], ["reproduce", "--quick"]])
def test_every_command_takes_threads(command):
    args = cli._parser().parse_args([*command, "--threads", "3"])
    assert args.threads == 3
