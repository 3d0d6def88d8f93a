"""What the extras install: a rank must import torch without warnings of our making."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import ROOT


def test_the_torch_extras_bring_numpy() -> None:
    """Without numpy every rank prints torch's "Failed to initialize NumPy" warning."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    for extra in ("torch", "test"):
        assert any(req.startswith("numpy") for req in extras[extra]), extra


def test_torch_imports_without_the_numpy_warning() -> None:
    pytest.importorskip("torch")
    result = subprocess.run(
        [sys.executable, "-c", "import torch; torch.tensor([1.0]).numpy()"],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "NumPy" not in result.stderr
