import logging

import anyio
import jsonschema
import pytest

from operate_sidecar.server.core.errors import ToolArgumentError
from operate_sidecar.server.core.tools import ToolCallContext
from operate_sidecar.server.tools import ToolSourceError, load_tool_modules

CTX = ToolCallContext(branch_id="b", call_id="c")


def by_name(tools):
    return {t.name: t for t in tools}


def test_public_functions_defined_in_the_module_become_python_tools(fixture_modules):
    tools = by_name(load_tool_modules(["sample_tools"]))
    assert set(tools) == {"add", "shout", "lookup", "renamed_tool"}
    assert all(t.source == "python" for t in tools.values())


def test_private_imported_and_class_members_are_not_tools(fixture_modules):
    names = {t.name for t in load_tool_modules(["sample_tools"])}
    assert not names & {"_private_helper", "dumps", "path_join", "join", "NotAFunction", "tool", "alias_of_add"}


def test_module_all_limits_the_public_functions(fixture_modules):
    assert [t.name for t in load_tool_modules(["exported_tools"])] == ["listed"]


def test_description_and_parameter_docs_come_from_the_docstring(fixture_modules):
    add = by_name(load_tool_modules(["sample_tools"]))["add"]
    assert add.description == "Add two integers."
    assert add.input_schema["properties"]["a"]["description"] == "the first number"
    assert add.input_schema["properties"]["a"]["type"] == "integer"
    assert add.input_schema["required"] == ["a"]


def test_every_schema_is_valid_json_schema_2020_12(fixture_modules):
    for t in load_tool_modules(["sample_tools", "exported_tools"]):
        jsonschema.Draft202012Validator.check_schema(t.input_schema)


def test_optional_int_parameter_gives_a_valid_schema(fixture_modules):
    shout = by_name(load_tool_modules(["sample_tools"]))["shout"]
    schema = shout.input_schema
    jsonschema.Draft202012Validator.check_schema(schema)
    v = jsonschema.Draft202012Validator(schema)
    assert v.is_valid({"text": "a", "times": 2})
    assert v.is_valid({"text": "a", "times": None})
    assert not v.is_valid({"text": "a", "times": "two"})


def test_tool_decorator_read_only_timeout_and_name_are_honoured(fixture_modules):
    tools = by_name(load_tool_modules(["sample_tools"]))
    assert tools["lookup"].read_only is True and tools["lookup"].timeout == 5
    assert tools["add"].read_only is False and tools["add"].timeout is None
    assert "renamed_tool" in tools and "original_name" not in tools


def test_sync_and_async_functions_are_called(fixture_modules):
    tools = by_name(load_tool_modules(["sample_tools"]))

    async def main():
        with anyio.fail_after(10):
            add_args = tools["add"].validate_arguments({"a": 2})
            shout_args = tools["shout"].validate_arguments({"text": "hi", "times": 2})
            return await tools["add"].call(add_args, CTX), await tools["shout"].call(shout_args, CTX)

    assert anyio.run(main) == (3, "HIHI")


def test_bad_arguments_raise_tool_argument_error(fixture_modules):
    add = by_name(load_tool_modules(["sample_tools"]))["add"]
    with pytest.raises(ToolArgumentError, match="a"):
        add.validate_arguments({"a": "not a number"})
    with pytest.raises(ToolArgumentError):
        add.validate_arguments({"b": 1})  # a is required
    with pytest.raises(ToolArgumentError):
        add.validate_arguments({"a": 1, "c": 2})  # unknown argument


def test_unschemable_and_positional_only_functions_are_skipped_with_a_warning(fixture_modules, caplog):
    caplog.set_level(logging.WARNING, logger="operate_sidecar.server.tools.python_modules")
    names = {t.name for t in load_tool_modules(["sample_tools"])}
    assert "bad_signature" not in names and "positional_only" not in names
    messages = "\n".join(r.getMessage() for r in caplog.records)
    assert "sample_tools.bad_signature" in messages
    assert "sample_tools.positional_only" in messages


def test_module_that_fails_to_import_is_named_with_the_reason(fixture_modules):
    with pytest.raises(ToolSourceError, match=r"'broken_tools'.*RuntimeError: broken on purpose"):
        load_tool_modules(["broken_tools"])


def test_missing_module_is_a_tool_source_error(fixture_modules):
    with pytest.raises(ToolSourceError, match="no_such_tool_module_xyz") as info:
        load_tool_modules(["no_such_tool_module_xyz"])
    assert isinstance(info.value, ValueError)


def test_same_tool_name_in_two_modules_is_an_error(fixture_modules):
    with pytest.raises(ToolSourceError, match="'add'.*'sample_tools'.*'clash_tools'"):
        load_tool_modules(["sample_tools", "clash_tools"])


@pytest.mark.parametrize("name", ["os", "subprocess", "shutil", "os.path", "importlib.util"])
def test_standard_library_modules_are_refused_with_a_clear_error(name):
    """``toolModules: ["os", "subprocess", "shutil"]`` used to expose popen, getoutput, rmtree,
    getenv ... with policy allow: a module of the standard library is never a tool source."""
    with pytest.raises(ToolSourceError, match="standard library"):
        load_tool_modules([name])


@pytest.mark.parametrize(("module", "raised"), [("skipping_tools", "Skipped: needs numpy"),
                                                ("interrupting_tools", "KeyboardInterrupt")])
def test_a_module_raising_a_base_exception_at_import_is_a_tool_source_error(fixture_modules, module, raised):
    """A test runner's skip or a KeyboardInterrupt raised by the module's code is that module's
    failure, named, like any other (never an escape that takes the other modules' tools along)."""
    with pytest.raises(ToolSourceError, match=rf"{module!r} could not be imported: {raised}"):
        load_tool_modules([module])


def test_arguments_are_checked_against_the_advertised_schema_before_pydantic_converts_them(fixture_modules):
    """pydantic's lax mode took "1" for an integer: the tool's inputSchema is what decides."""
    add = by_name(load_tool_modules(["sample_tools"]))["add"]
    with pytest.raises(ToolArgumentError, match=r"^invalid arguments: a: '1' is not of type 'integer'"):
        add.validate_arguments({"a": "1", "b": 2})
    assert add.validate_arguments({"a": 1.0, "b": 2}) == {"a": 1, "b": 2}
