"""Shared fixtures: the real SmolLM2 tokenizer, a tiny random model of its architecture, and registries
restored after every test."""

from __future__ import annotations

import pytest

from turnrl.config import ModelConfig


def _registries() -> list[dict]:
    """Every plug-in registry: environments, estimators, losses, samplers, tracking sinks."""
    from turnrl import credit, envs, losses, sampling, tracking

    return [envs.ENV_REGISTRY, credit.ESTIMATORS, losses.LOSSES, sampling.SAMPLERS, tracking.SINKS]


@pytest.fixture(autouse=True)
def _restore_registries():
    """A test may register plug-ins freely: each registry is put back as it was when the test ends."""
    saved = [(registry, dict(registry)) for registry in _registries()]
    yield
    for registry, entries in saved:
        registry.clear()
        registry.update(entries)


@pytest.fixture(scope="session")
def tokenizer():
    from turnrl.models import load_tokenizer

    return load_tokenizer("tiny")


@pytest.fixture()
def tiny_model():
    from turnrl.models import load_model

    model, _ = load_model(ModelConfig(name="tiny"), seed=0)
    return model


_MEASURED: list[str] = []


@pytest.fixture(scope="session")
def report_line():
    """``report_line(text)``: a measured number for the run's log, printed in a "measured" section at the end
    (with or without ``-s``), e.g. the real engines' log-prob agreement."""
    return _MEASURED.append


def pytest_terminal_summary(terminalreporter):
    if _MEASURED:
        terminalreporter.section("measured")
        for line in _MEASURED:
            terminalreporter.write_line(line)
