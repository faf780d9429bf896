"""errors: every error class has a unique wire code that rebuilds the same class."""

from __future__ import annotations

import pytest

from gpumesh import errors
from gpumesh.errors import GPUMeshError, error_from_code


def _all_error_classes() -> list[type[GPUMeshError]]:
    found: list[type[GPUMeshError]] = []
    pending: list[type[GPUMeshError]] = [GPUMeshError]
    while pending:
        cls = pending.pop()
        found.append(cls)
        pending.extend(cls.__subclasses__())
    return found


ERROR_CLASSES = _all_error_classes()


def test_every_exported_error_is_in_the_tree() -> None:
    exported = {
        getattr(errors, name) for name in errors.__all__ if isinstance(getattr(errors, name), type)
    } - {errors.ExitCode}
    assert exported <= set(ERROR_CLASSES)
    assert len(exported) >= 20


def test_codes_are_unique() -> None:
    codes = [cls.code for cls in ERROR_CLASSES]
    assert len(codes) == len(set(codes))


@pytest.mark.parametrize("cls", ERROR_CLASSES, ids=lambda cls: cls.__name__)
def test_error_from_code_rebuilds_the_same_class(cls: type[GPUMeshError]) -> None:
    rebuilt = error_from_code(cls.code, "what to do next")
    assert type(rebuilt) is cls
    assert rebuilt.message == "what to do next"
    assert str(rebuilt) == "what to do next"


def test_unknown_code_gives_the_root_error_with_the_message() -> None:
    rebuilt = error_from_code("some_future_code", "readable anyway")
    assert type(rebuilt) is GPUMeshError
    assert str(rebuilt) == "readable anyway"


def test_subclass_codes_are_caught_by_their_parents() -> None:
    assert isinstance(error_from_code("not_paired", "m"), errors.AccessDeniedError)
    assert isinstance(error_from_code("expired_code", "m"), errors.PairingCodeError)
    assert isinstance(error_from_code("frame_too_large", "m"), errors.ProtocolError)
