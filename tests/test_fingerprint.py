"""Deterministic tokens (dask_surge.fingerprint): generic, below every package; a torch module by its weights."""

import ast
from pathlib import Path

import pytest

from dask_surge import fingerprint
from dask_surge.models import modelid


def test_the_fingerprint_module_imports_nothing_of_the_package():
    tree = ast.parse(Path(fingerprint.__file__).read_text())
    relative = [n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level]
    absolute = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert relative == [] and not [m for m in absolute if m.startswith("dask_surge")]


def test_modelid_tokens_plain_values_as_the_fingerprint_does():
    assert modelid.stable_token([1, "a"]) == fingerprint.stable_token([1, "a"]) == [1, "a"]


def test_a_torch_module_is_its_weights_digest_through_modelid_only():
    torch = pytest.importorskip("torch")
    layer = torch.nn.Linear(2, 2)
    with pytest.raises(fingerprint.NotDeterministic, match="torch module.*modelid.stable_token"):
        fingerprint.stable_token(layer, "the model")
    assert modelid.stable_token(layer) == {"torch_module": modelid.object_digest(layer)}
    assert fingerprint.stable_token(layer, module_digest=lambda m: "w") == {"torch_module": "w"}
