"""Shared fixtures: the real SmolLM2 tokenizer and a tiny random model of its architecture."""

from __future__ import annotations

import pytest

from turnrl.config import ModelConfig


@pytest.fixture(scope="session")
def tokenizer():
    from turnrl.models import load_tokenizer

    return load_tokenizer("tiny")


@pytest.fixture()
def tiny_model():
    from turnrl.models import load_model

    model, _ = load_model(ModelConfig(name="tiny"), seed=0)
    return model
