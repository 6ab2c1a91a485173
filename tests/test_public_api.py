"""The plugin API is what ``certlm`` exports. Its names and signatures are kept in ``tests/public_api.txt``: a change
to them fails here until the snapshot is written again (``python -m tests.test_public_api --write``) and CHANGELOG.md
records it under the plugin API version it belongs to. That makes a change to what vendors build on a deliberate,
visible act, never a side effect of a refactor of the host."""

from __future__ import annotations

import dataclasses
import difflib
import enum
import inspect
import re
import sys
import types
from pathlib import Path

import pydantic
from tortoise.models import Model

import certlm

SNAPSHOT = Path(__file__).with_name("public_api.txt")
CHANGELOG = Path(__file__).resolve().parent.parent / "CHANGELOG.md"


def _signature(value: object) -> str:
    try:
        text = str(inspect.signature(value))  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return "(...)"
    return re.sub(r" at 0x[0-9a-f]+", "", text)  # a default's repr must not carry an address


def _own_members(cls: type) -> list[tuple[str, object]]:
    """Public attributes that certlm's classes define on ``cls`` (inherited from certlm classes too), not those of
    Python, pydantic or tortoise."""
    members: dict[str, object] = {}
    for base in reversed(cls.__mro__):
        if not base.__module__.startswith("certlm"):
            continue
        for name, value in vars(base).items():
            if not name.startswith("_") or name in ("__init__", "__call__"):
                members[name] = value
    return sorted(members.items())


def _class_lines(name: str, cls: type) -> list[str]:
    bases = ", ".join(base.__name__ for base in cls.__bases__ if base is not object)
    lines = [f"class {name}({bases})"]
    if issubclass(cls, pydantic.BaseModel):
        for field, info in cls.model_fields.items():
            lines.append(f"    field {field}: {info.annotation!r}".replace("typing.", ""))
    if issubclass(cls, Model):
        # The columns the model declares; not what Tortoise.init adds (reverse relations, a foreign key's ``_id``
        # column and their properties), so that the snapshot does not depend on whether the ORM was started.
        declared = cls._meta.fields_map
        for field, column in sorted(declared.items()):
            foreign_key_column = field.endswith("_id") and field[: -len("_id")] in declared
            if not type(column).__name__.startswith("Backward") and not foreign_key_column:
                lines.append(f"    column {field}: {type(column).__name__}")
    fields = {field.name for field in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    if issubclass(cls, enum.Enum):
        lines.extend(f"    member {member.name} = {member.value!r}" for member in cls)
    for member, value in _own_members(cls):
        if isinstance(value, staticmethod | classmethod):
            lines.append(f"    {type(value).__name__} {member}{_signature(value.__func__)}")
        elif isinstance(value, property) and not issubclass(cls, Model):
            lines.append(f"    property {member}")
        elif inspect.isfunction(value):
            prefix = "async def" if inspect.iscoroutinefunction(value) else "def"
            lines.append(f"    {prefix} {member}{_signature(value)}")
        elif issubclass(cls, pydantic.BaseModel) or issubclass(cls, Model) or issubclass(cls, enum.Enum):
            continue  # fields and members are listed above
        elif member not in fields and not inspect.isclass(value) and not callable(value):
            lines.append(f"    attribute {member}: {type(value).__name__}")
    return lines


def _lines(name: str, value: object) -> list[str]:
    if inspect.isclass(value):
        return _class_lines(name, value)
    if isinstance(value, types.ModuleType):
        lines = [f"module {name}"]
        for member in sorted(getattr(value, "__all__", None) or vars(value)):
            if member.startswith("_"):
                continue
            attribute = getattr(value, member)
            if getattr(attribute, "__module__", None) != value.__name__:
                continue  # what the module imported, not what it defines
            lines.extend("    " + line for line in _lines(member, attribute))
        return lines
    if inspect.isfunction(value) or inspect.isbuiltin(value):
        prefix = "async def" if inspect.iscoroutinefunction(value) else "def"
        return [f"{prefix} {name}{_signature(value)}"]
    if name == "PLUGIN_API_VERSION":
        return [f"constant {name} = {value!r}"]
    return [f"constant {name}: {type(value).__name__}"]


def public_api() -> str:
    """The snapshot's text: every name in ``certlm.__all__`` with its signature, fields and members."""
    lines: list[str] = []
    for name in sorted(certlm.__all__):
        lines.extend(_lines(name, getattr(certlm, name)))
    return "\n".join(lines) + "\n"


def test_every_exported_name_exists_and_is_listed_once() -> None:
    assert len(certlm.__all__) == len(set(certlm.__all__))
    assert [name for name in certlm.__all__ if not hasattr(certlm, name)] == []


def test_the_public_api_matches_its_snapshot() -> None:
    """A failure here is a change of the plugin API: if it is meant, write the snapshot again and record the change
    in CHANGELOG.md (a new minor version for an addition, a new major version for anything a plugin may rely on)."""
    current, recorded = public_api(), SNAPSHOT.read_text()
    diff = "".join(difflib.unified_diff(recorded.splitlines(True), current.splitlines(True), "snapshot", "certlm"))
    assert current == recorded, f"the plugin API changed (python -m tests.test_public_api --write):\n{diff}"


def test_the_changelog_records_the_current_plugin_api_version() -> None:
    assert re.search(rf"^## Plugin API {re.escape(certlm.PLUGIN_API_VERSION)}\b", CHANGELOG.read_text(), re.M)


def test_a_changed_signature_is_seen(monkeypatch) -> None:
    """The snapshot notices a renamed parameter of an exported function, so it cannot pass whatever the API is."""

    def changed(value: str, *, schemes: tuple[str, ...]) -> str:
        return value

    monkeypatch.setattr(certlm, "serial_hex", changed)
    assert public_api() != SNAPSHOT.read_text()


if __name__ == "__main__" and sys.argv[1:] == ["--write"]:
    SNAPSHOT.write_text(public_api())
    print(f"wrote {SNAPSHOT}")
