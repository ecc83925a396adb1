"""``scripts/hf_model_tests.py``: transformers' model tests run both ways, and the differential.

End to end on a stand-in tests directory (transformers' own model tests are not on PyPI): a
model file with a test that passes either way and one that asserts the default is named
``"sdpa"``; only the second is reported, and the attnkit run says that models got attnkit.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "hf_model_tests.py"

FAKE_MODEL_TESTS = """
import torch
import transformers


def _model():
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2)
    return transformers.AutoModelForCausalLM.from_config(config)


def test_forward_runs():
    assert _model()(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 64)


def test_default_is_named_sdpa():
    assert _model().config._attn_implementation == "sdpa"
"""


def _script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("hf_model_tests_script", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_parse_reads_verbose_lines_and_the_short_summary() -> None:
    script = _script()
    output = "\n".join(
        [
            "tests/models/m/test_modeling_m.py::T::test_a PASSED                 [ 33%]",
            "tests/models/m/test_modeling_m.py::T::test_b SKIPPED (no GPU)       [ 66%]",
            "tests/models/m/test_modeling_m.py::T::test_c FAILED                 [100%]",
            "tests/models/m/test_modeling_m.py::T::test_d PASSED                 [100%]",
            "FAILED tests/models/m/test_modeling_m.py::T::test_c - AssertionError: False",
            # a failed subtest: its test's -v line said PASSED
            "SUBFAILED[LlamaForCausalLM] tests/models/m/test_modeling_m.py::T::test_d - Error: x",
        ]
    )
    run = script.parse(output)
    assert run.summary() == "1 passed, 2 failed, 1 skipped"
    assert run.reasons == {
        "tests/models/m/test_modeling_m.py::T::test_c": "AssertionError: False",
        "tests/models/m/test_modeling_m.py::T::test_d": "[LlamaForCausalLM] Error: x",
    }
    passing = output.replace("test_c FAILED", "test_c PASSED").split("\n")[:4]
    default = script.parse("\n".join(passing))
    assert script.only_with_attnkit(default, run) == [
        "tests/models/m/test_modeling_m.py::T::test_c",
        "tests/models/m/test_modeling_m.py::T::test_d",
    ]
    assert script.only_with_attnkit(run, default) == []


def test_end_to_end_reports_only_the_test_that_needs_sdpa_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "tests" / "models" / "fake"
    folder.mkdir(parents=True)
    (folder / "test_modeling_fake.py").write_text(FAKE_MODEL_TESTS)
    script = _script()
    status = script.main([str(tmp_path), "fake", "--timeout", "300"])
    printed = capsys.readouterr().out
    assert status == 1
    assert "  default  2 passed, 0 failed, 0 skipped" in printed
    assert "  attnkit  1 passed, 1 failed, 0 skipped; 2 models got attnkit by default" in printed
    assert "fail only with attnkit: 1\n    test_default_is_named_sdpa: AssertionError" in printed


def test_a_missing_model_file_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        _script().main([str(tmp_path), "nosuchmodel"])
    assert "test_modeling_nosuchmodel.py" in capsys.readouterr().err
