"""DDPWATCH_PROBES: which parts of the agent run."""

from __future__ import annotations

import logging

import pytest

from ddpwatch.agent import switches


def test_nothing_set_runs_every_part() -> None:
    probes = switches.from_env({})
    assert all(probes.on(part) for part in switches.PARTS)


def test_minus_switches_a_part_off_and_plus_back_on() -> None:
    probes = switches.from_env({"DDPWATCH_PROBES": " -split, -GRADS ,-hostmem,+hostmem"})
    assert probes.off == {"split", "grads"}
    assert probes.on("hostmem") and probes.on("batches")


def test_an_unknown_part_is_logged_and_ignored(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="ddpwatch"):
        probes = switches.from_env({"DDPWATCH_PROBES": "-splt,-grads"})
    assert probes.off == {"grads"}
    assert "-splt" in caplog.text


def test_the_older_switches_still_hold() -> None:
    env = {"DDPWATCH_STEP_SPLIT": "0", "DDPWATCH_GRAD_CHECK": "0"}
    assert switches.from_env(env).off == {"split", "grads"}
    assert switches.from_env({"DDPWATCH_STEP_SPLIT": "1"}).off == frozenset()
