import pytest

from .support import RecordingTool


@pytest.fixture
def record() -> RecordingTool:
    return RecordingTool("record")


@pytest.fixture
def other() -> RecordingTool:
    return RecordingTool("other")
