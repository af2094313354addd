"""labkit.validate: errors that give the value, the constraint and the fix."""

from __future__ import annotations

import pytest

from labkit import validate


def test_messages_name_value_constraint_and_fix():
    with pytest.raises(ValueError) as info:
        validate.positive_int("world_size", 0, "launch(fn, world_size=2)")
    assert (
        str(info.value)
        == "world_size=0 must be a positive whole number (>= 1); e.g. launch(fn, world_size=2)"
    )
    with pytest.raises(ValueError, match=r"^op='x' must be one of 'a', 'b'$"):
        validate.one_of("op", "x", ["a", "b"])


@pytest.mark.parametrize("bad", [0, -1, 1.0, "2", True, None])
def test_positive_int_rejects(bad):
    with pytest.raises(ValueError, match="must be a positive whole number"):
        validate.positive_int("n", bad)


@pytest.mark.parametrize("bad", [-1, 0.5, False])
def test_non_negative_int_rejects(bad):
    with pytest.raises(ValueError, match=">= 0"):
        validate.non_negative_int("n", bad)


@pytest.mark.parametrize("bad", [0, -0.1, "1", True, float("nan")])
def test_positive_number_rejects(bad):
    with pytest.raises(ValueError, match="must be a number > 0"):
        validate.positive_number("x", bad)


def test_good_values_come_back():
    assert validate.positive_int("n", 3) == 3
    assert validate.non_negative_int("n", 0) == 0
    assert validate.positive_number("x", 0.25) == 0.25
    assert validate.one_of("p", "fp32", ("fp32", "bf16")) == "fp32"


def test_a_param_error_writes_its_fix_where_the_value_was_typed():
    err = validate.ParamError("d_model", 30, "a multiple of 4", 32, form="set", why="4 heads")
    assert isinstance(err, ValueError) and (err.name, err.value, err.example) == ("d_model", 30, 32)
    assert str(err) == "d_model=30 must be a multiple of 4 (4 heads); set it with --set d_model 32"
    cell = err.in_form("cell")
    assert cell.form == "cell" and cell.why == "4 heads"
    assert str(cell).endswith(
        "write d_model = 32 in the parameters cell (or -p d_model 32 with labkit run / papermill)"
    )
    # a list is one quoted shell word; a bare word stays bare; no example, no fix
    assert str(validate.ParamError("caps", [0], "> 0", [0.5, 1], form="p")).endswith("-p caps '[0.5, 1]'")
    assert str(validate.ParamError("dir", 3, "a string", "traces", form="set")).endswith("--set dir traces")
    assert str(validate.ParamError("x", 1, "a parameter")) == "x=1 must be a parameter"
